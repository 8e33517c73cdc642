"""Local attention kernels behind one interface: forward -> (out, lse), backward -> (dq, dk, dv).

Layout everywhere: q [b, hq, sq, d], k and v [b, hkv, sk, d] with hq % hkv == 0 (GQA: query head i
uses KV head i // (hq / hkv)); out [b, hq, sq, d] in q's dtype; lse [b, hq, sq] float32, natural
log. `causal` means sq == sk with query i seeing keys 0..i; a block whose causal edge is elsewhere
is composed by the caller from full blocks (ring and segment attention do this), so every kernel
only needs the two shapes every library has.

The backward takes the *final* out and lse: when partial results are merged (ring attention), the
gradient of each block is exactly the kernel backward evaluated with the merged out/lse
(FlashAttention-2, section 3.1.2: dS = P o (dP - rowsum(dO o O)) with P = exp(S - lse)).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


class AttentionKernel:
    """Interface of a local kernel. `name` appears in logs and benchmark tables."""

    name = "abstract"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError


def _expand_kv(x: Tensor, hq: int) -> Tensor:
    # [b, hkv, s, d] -> [b, hq, s, d]: each KV head repeated for its hq/hkv query heads.
    return x if x.shape[1] == hq else x.repeat_interleave(hq // x.shape[1], dim=1)


def _reduce_kv_grad(dx: Tensor, hkv: int) -> Tensor:
    # [b, hq, s, d] -> [b, hkv, hq/hkv, s, d] -> sum over the query heads that shared a KV head.
    if dx.shape[1] == hkv:
        return dx
    b, hq, s, d = dx.shape
    return dx.view(b, hkv, hq // hkv, s, d).sum(dim=2)


class ReferenceKernel(AttentionKernel):
    """Plain math in fp32 (materialises the [sq, sk] scores). The numerical reference of every test,
    and the `unfused` / `local` backend."""

    name = "reference"

    @staticmethod
    def _scores(q, k, causal, scale):
        # [b, hq, sq, d] x [b, hq, d, sk] -> scores [b, hq, sq, sk] in fp32
        scores = torch.matmul(q.float(), _expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return scores

    def forward(self, q, k, v, causal, scale):
        scores = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        out = torch.matmul(probs, _expand_kv(v, q.shape[1]).float())
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        hq, hkv = q.shape[1], k.shape[1]
        probs = torch.exp(self._scores(q, k, causal, scale) - lse.unsqueeze(-1))  # with the final lse
        dout32, vf = dout.float(), _expand_kv(v, hq).float()
        dv = torch.matmul(probs.transpose(-1, -2), dout32)
        dprobs = torch.matmul(dout32, vf.transpose(-1, -2))
        delta = (dout32 * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dO o O)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, _expand_kv(k, hq).float())
        dk = torch.matmul(dscores.transpose(-1, -2), q.float())
        return (dq.to(q.dtype), _reduce_kv_grad(dk, hkv).to(k.dtype), _reduce_kv_grad(dv, hkv).to(v.dtype))


class TorchCpuFlashKernel(AttentionKernel):
    """torch's CPU flash-attention kernel (aten::_scaled_dot_product_flash_attention_for_cpu):
    tiled, fp32 accumulation, native GQA, returns the logsumexp."""

    name = "torch-cpu-flash"

    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale
        )


class TorchCudaFlashKernel(AttentionKernel):
    """torch's fused flash kernel on CUDA (fp16/bf16). It wants equal head counts, so GQA KV heads
    are expanded here and their gradients summed back."""

    name = "torch-cuda-flash"

    def forward(self, q, k, v, causal, scale):
        hq = q.shape[1]
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand_kv(k, hq), _expand_kv(v, hq), 0.0, causal, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        hq, hkv = q.shape[1], k.shape[1]
        sq, sk = q.shape[2], k.shape[2]
        empty = torch.empty(0, dtype=torch.int64, device=q.device)  # philox state: unused, p = 0
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, _expand_kv(k, hq), _expand_kv(v, hq), out, lse,
            None, None, sq, sk, 0.0, causal, empty, empty, scale=scale,
        )
        return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)


class TorchCudaEfficientKernel(AttentionKernel):
    """torch's memory-efficient kernel on CUDA: any float dtype (the fp32 path on GPU)."""

    name = "torch-cuda-efficient"

    def forward(self, q, k, v, causal, scale):
        hq = q.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_kv(k, hq), _expand_kv(v, hq), None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float()  # the kernel pads lse to a multiple of 32

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        hq, hkv = q.shape[1], k.shape[1]
        pad = (-lse.shape[-1]) % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q, _expand_kv(k, hq), _expand_kv(v, hq), None, out, lse_p.contiguous(),
            seed, seed, 0.0, [True, True, True, False], causal, scale=scale,
        )
        return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)


class FlashAttnKernel(AttentionKernel):
    """The flash-attn package (2.x), native GQA. It takes [b, s, h, d]; we transpose views."""

    name = "flash-attn"

    def __init__(self):
        from flash_attn import flash_attn_interface as fai  # noqa: F401  (optional dependency)

        self._fai = fai

    def forward(self, q, k, v, causal, scale):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, s, d] -> [b, s, h, d]
        res = self._fai._flash_attn_forward(
            qt, kt, vt, 0.0, scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, return_softmax=False,
        )
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt, ot, dot = (x.transpose(1, 2) for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        self._fai._flash_attn_backward(
            dot.contiguous(), qt, kt, vt, ot, lse, dq, dk, dv, 0.0, scale, causal,
            -1, -1, 0.0, None, torch.are_deterministic_algorithms_enabled(),
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---- selection ------------------------------------------------------------------------------

BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """Megatron's --attention-backend values mapped to the kernels present:
    auto  -> the fastest: flash-attn (CUDA, 16-bit) > torch flash (CUDA, 16-bit) > torch
             memory-efficient (CUDA, fp32) ; on CPU torch's CPU flash kernel;
    flash -> flash-attn if installed else torch's flash kernel (CPU or CUDA);
    fused -> torch's memory-efficient kernel on CUDA, torch's CPU flash kernel on CPU;
    unfused / local -> the fp32 reference (materialises scores)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend in ("unfused", "local"):
        return ReferenceKernel()
    if device.type != "cuda":
        return TorchCpuFlashKernel()
    half = dtype in (torch.float16, torch.bfloat16)
    if backend == "fused":
        return TorchCudaEfficientKernel()
    if half and _flash_attn_available():
        return FlashAttnKernel()
    if half:
        return TorchCudaFlashKernel()
    if backend == "flash":
        raise ValueError("--attention-backend flash needs fp16/bf16 on GPU (use --bf16)")
    return TorchCudaEfficientKernel()


def default_scale(head_dim: int, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
