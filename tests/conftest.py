"""Shared test set-up: quiet warnings from optional accelerators, one thread per process."""
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Multi-rank tests fork their ranks from a server that imported megatron-core, whose import asks
# torch.cuda.is_available(). On a CUDA machine that asks the CUDA runtime unless told to ask NVML,
# and torch then refuses CUDA in every process forked afterwards (test_gpu_paths checks this).
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", category=UserWarning, module="megatron.core")
