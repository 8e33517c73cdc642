"""Local (single-rank) attention as an autograd function over any AttentionKernel.

The forward returns (out, lse) so that distributed attention can merge partial results; lse carries
no gradient (it is an auxiliary output of the softmax normaliser).
"""
from __future__ import annotations

import torch

from megatron.longseq.attention.kernels import AttentionKernel, grad_like


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel: AttentionKernel, causal: bool, scale: float):
        out, lse = kernel.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.causal, ctx.scale = kernel, causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(grad_like(dout, out), q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def local_attention(q, k, v, kernel: AttentionKernel, causal: bool, scale: float):
    """q [b, hq, s, d], k/v [b, hkv, s, d] -> out [b, hq, s, d], lse [b, hq, s] (fp32)."""
    return _LocalAttention.apply(q, k, v, kernel, causal, scale)
