"""Shared test set-up: quiet warnings from optional accelerators, one thread per process."""
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module="megatron.core")
