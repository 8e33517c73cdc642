"""Which local attention kernel runs: Megatron's --attention-backend values mapped to the kernels
this machine has (kernels.py), with the limits of each library's CUDA kernels refused or worked
around here, so that a run that cannot work is one line at start-up, not a crash in the first
forward or backward."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch

from megatron.longseq.attention.kernels import (
    FLASH_ATTN_SUPPORTED, AttentionKernel, FlashAttnKernel, PaddedHeadDim, ReferenceKernel, TorchCpuFlashKernel,
    TorchCudaEfficientKernel, TorchCudaFlashKernel, TorchCudnnKernel,
)

BACKENDS = ("auto", "flash", "fused", "unfused", "local")

KERNELS = {k.name: k for k in (ReferenceKernel, TorchCpuFlashKernel, TorchCudaFlashKernel, TorchCudnnKernel,
                                TorchCudaEfficientKernel, FlashAttnKernel)}


# GPUs with 100 KB of shared memory per SM (A10/A40, Jetson Orin, L4/L40/RTX 4090, RTX 50xx)
SMALL_SHARED_MEMORY = ((8, 6), (8, 7), (8, 9), (12, 0))


@dataclass(frozen=True)
class KernelEnv:
    """What the choice of a kernel depends on; `probe` reads it off the machine, tests build it."""

    device_type: str  # "cpu" or "cuda"
    dtype: torch.dtype
    head_dim: int
    capability: Tuple[int, int] = (0, 0)  # CUDA compute capability
    cudnn_version: int = 0  # torch.backends.cudnn.version(), 0 without cuDNN
    flash_attn_version: Optional[str] = None  # None: flash-attn not installed
    deterministic: bool = False  # torch.are_deterministic_algorithms_enabled()

    @classmethod
    def probe(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> "KernelEnv":
        cuda = device.type == "cuda"
        return cls(device.type, dtype, head_dim,
                   capability=torch.cuda.get_device_capability(device) if cuda else (0, 0),
                   cudnn_version=(torch.backends.cudnn.version() or 0) if cuda else 0,
                   flash_attn_version=_flash_attn_version() if cuda else None,
                   deterministic=torch.are_deterministic_algorithms_enabled())

    @property
    def half(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def kernel_head_dim(self) -> int:
        """The head dim the kernels are given: fp16/bf16 CUDA kernels take multiples of 8 only, so
        others are zero-padded (PaddedHeadDim)."""
        return -(-self.head_dim // 8) * 8 if self.device_type == "cuda" and self.half else self.head_dim

    def flash_refusal(self) -> Optional[str]:
        """Why the flash kernels (torch's and flash-attn's) cannot take this run (None: they can)."""
        if tuple(self.capability) < (8, 0):
            return f"they need an sm80 or newer GPU (found {self.sm})"
        if self.head_dim > 256:  # a multiple of 8 by now (kernel_head_dim)
            return f"they need a head dim <= 256 (got {self.head_dim})"
        if tuple(self.capability) in SMALL_SHARED_MEMORY and 192 < self.head_dim <= 224:
            # FlashAttention-2's backward for these head dims has no variant for their 100 KB of
            # shared memory per SM (torch's SDPA refuses the same range there)
            return f"their backward for head dims 193-224 does not fit {self.sm}'s shared memory"
        return None

    def cudnn_refusal(self) -> Optional[str]:
        """Why torch's cuDNN attention cannot take this run (None: it can)."""
        if not self.half:
            return "it needs fp16/bf16"
        if not (8, 0) <= tuple(self.capability) <= (12, 1):  # torch's check_cudnn_hardware_support
            return f"it needs an sm80 to sm121 GPU (found {self.sm})"
        if self.cudnn_version < 90000:
            return f"it needs cuDNN >= 9 (found {self.cudnn_version or 'none'})"
        if self.head_dim > 128:
            return f"it needs a head dim <= 128 (got {self.head_dim})"
        if self.deterministic:  # called directly, its backward ignores deterministic mode
            return "its backward is not deterministic (--deterministic-mode)"
        return None


def _flash_attn_version() -> Optional[str]:
    try:
        import flash_attn
    except ImportError:
        return None
    return getattr(flash_attn, "__version__", "0")


def check_flash_attn_version(version: str) -> None:
    """One line when the installed flash-attn has other private signatures than FlashAttnKernel's."""
    from packaging.specifiers import SpecifierSet

    supported = SpecifierSet(",".join(FLASH_ATTN_SUPPORTED))
    if version not in supported:
        raise ValueError(f"flash-attn {version} is installed, but this trainer calls the flash-attn "
                         f"{supported} interface: pip install 'flash-attn{supported}', or uninstall it")


def choose_kernel(backend: str, env: KernelEnv) -> str:
    """Megatron's --attention-backend values mapped to the kernels present (names in KERNELS):
    unfused / local -> the fp32 reference (materialises scores), on any device;
    on CPU every other value -> torch's CPU flash kernel;
    on CUDA:
      auto  -> fp16/bf16: Hopper or Blackwell (sm90/sm100): torch cuDNN attention, else flash-attn,
               else torch's flash kernel; older GPUs: flash-attn, else torch's flash kernel; where
               no flash kernel can run (before sm80, a head dim above 256, FlashAttention-2's
               backward of head dims 193-224 on SMALL_SHARED_MEMORY GPUs): torch's
               memory-efficient kernel. fp32: torch's memory-efficient kernel.
               (torch's SDPA, too, puts cuDNN first on sm90/sm100 with a recent cuDNN, flash first
               elsewhere, the memory-efficient kernel last.)
      flash -> flash-attn if installed, else torch's flash kernel (fp16/bf16 only);
      fused -> torch cuDNN attention for fp16/bf16 (Megatron's "fused" is TE's cuDNN attention),
               torch's memory-efficient kernel for fp32.
    fp16/bf16 head dims that are not a multiple of 8 are chosen for as padded (kernel_head_dim);
    bf16 before sm80 is refused (no CUDA kernel but the reference has it)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend in ("unfused", "local"):
        return ReferenceKernel.name
    if env.device_type != "cuda":
        return TorchCpuFlashKernel.name
    if env.dtype == torch.bfloat16 and tuple(env.capability) < (8, 0):
        raise ValueError(f"bf16 attention kernels need an sm80 or newer GPU (found {env.sm}): use --fp16, "
                         "or --attention-backend unfused")
    env = replace(env, head_dim=env.kernel_head_dim)
    if backend == "fused":
        return _fused(env)
    if not env.half:
        if backend == "flash":
            raise ValueError("--attention-backend flash needs fp16/bf16 on GPU (use --bf16)")
        return TorchCudaEfficientKernel.name
    if backend == "auto" and env.capability[0] in (9, 10) and env.cudnn_refusal() is None:
        return TorchCudnnKernel.name
    refusal = env.flash_refusal()
    if refusal is not None:
        if backend == "flash":
            raise ValueError(f"--attention-backend flash: the flash kernels cannot run here: {refusal}")
        return TorchCudaEfficientKernel.name
    if env.flash_attn_version is None:
        return TorchCudaFlashKernel.name
    check_flash_attn_version(env.flash_attn_version)  # it is the one that would run
    return FlashAttnKernel.name


def _fused(env: KernelEnv) -> str:
    if not env.half:
        return TorchCudaEfficientKernel.name
    refusal = env.cudnn_refusal()
    if refusal is not None:
        raise ValueError(f"--attention-backend fused is cuDNN attention, and {refusal}")
    return TorchCudnnKernel.name


def select_kernel(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> AttentionKernel:
    """The kernel choose_kernel names for this machine, ready to call (on a padded head dim where
    it needs one)."""
    env = KernelEnv.probe(device, dtype, head_dim)
    name = choose_kernel(backend, env)
    kernel = KERNELS[name]()
    if name == ReferenceKernel.name or env.kernel_head_dim == head_dim:
        return kernel
    return PaddedHeadDim(kernel)


def sdpa_backends(backend: str, device_type: str) -> Optional[list]:
    """What torch's SDPA may run for --attention-backend where it attends instead of our kernels
    (attention dropout, dense masks: SDPA draws the dropout), in order: unfused / local is its math
    path alone; on GPU flash and fused put their kind first, then SDPA's other kernels for what it
    cannot take (a dense mask, say). None: SDPA's own choice (auto; flash and fused on CPU, whose
    flash kernel takes no dropout with GQA)."""
    from torch.nn.attention import SDPBackend

    if backend in ("unfused", "local"):
        return [SDPBackend.MATH]
    first = {"flash": SDPBackend.FLASH_ATTENTION, "fused": SDPBackend.CUDNN_ATTENTION}.get(backend)
    if first is None or device_type != "cuda":
        return None
    order = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
    return [first] + [b for b in order if b != first]
