"""Megatron-LongSeq: the megatron.training and megatron.longseq namespace portions.

megatron.core comes from the megatron-core wheel; there is deliberately no megatron/__init__.py,
so both portions share the `megatron` namespace.
"""
from setuptools import find_namespace_packages, setup

setup(
    name="megatron-longseq",
    version="0.1.0",
    description="Megatron-LM-compatible GPT pretraining for long sequences on megatron-core",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.training*", "megatron.longseq*"]),
    py_modules=["pretrain_gpt"],
    # the planned allocator's C source, compiled on first use (memo/allocator.py)
    package_data={"megatron.longseq.memo": ["arena.c"]},
    install_requires=[
        "torch>=2.5",  # SDPA enable_gqa; the cuDNN attention op with attn_bias and compute_log_sumexp
        "megatron-core>=0.16.1,<0.17",
        "numpy",
        "einops",
        "gurobipy",
        "ortools",
        "tensorboard",
        "psutil",  # megatron-core's torch_dist checkpoint writer measures its worker processes with it
        # HuggingFaceTokenizer and GPT2BPETokenizer load local files through transformers; the
        # converter and passkey_eval read RoPE from config.rope_parameters, which 4.x does not have
        "transformers>=5",
        "tokenizers",
        "matplotlib",  # timelines and plans drawn by tools/
    ],
    extras_require={
        # flash-attn: the private interface FlashAttnKernel calls (kernels.FLASH_ATTN_SUPPORTED)
        "gpu": ["transformer-engine[pytorch]", "flash-attn>=2.7.0,<2.9"],
        "test": ["pytest"],
    },
)
