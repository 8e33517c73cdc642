"""Rotary position embedding applied from explicit position ids.

Megatron's convention (non-interleaved): the first rot_dim = kv_channels * rotary_percent channels
of each head are rotated; frequencies inv_freq[j] = base^(-2j / rot_dim); channel pairs are
(x[j], x[j + rot_dim/2]) ("rotate half"), or with --rotary-interleaved (x[2j], x[2j+1]). Taking
the angles from position ids rather than from
0..s-1 is what lets a rank hold any subset of the sequence (context-parallel chunks, pipeline
segments, reset position ids) and still rotate each token by its true position.

The angles are computed in fp32 once per step (per batch, shared by every layer through the
batch's cache) and cast to the input dtype; the rotation runs in the input dtype, as Megatron's
unfused RoPE does, and saves only cos and sin for backward (the backward is the inverse rotation).
"""
from __future__ import annotations

from typing import Optional

import torch


def _pairs(t: torch.Tensor, rot_dim: int, interleaved: bool):
    """The two members of every rotated channel pair, as views [..., rot/2]."""
    if interleaved:
        return t[..., 0:rot_dim:2], t[..., 1:rot_dim:2]
    return t[..., : rot_dim // 2], t[..., rot_dim // 2 : rot_dim]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, interleaved: bool) -> torch.Tensor:
    """x [s, b, h, d] rotated by the angles whose cos/sin are [s, b, 1, rot/2] (x's dtype): pairs
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). One new tensor, no temporaries."""
    x1, x2 = _pairs(x, rot_dim, interleaved)
    out = torch.empty_like(x)
    o1, o2 = _pairs(out, rot_dim, interleaved)
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    if rot_dim < x.shape[-1]:
        out[..., rot_dim:] = x[..., rot_dim:]
    return out


class _Rotation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, rot_dim, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.rot_dim, ctx.interleaved = rot_dim, interleaved
        return _rotate(x, cos, sin, rot_dim, interleaved)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin, ctx.rot_dim, ctx.interleaved), None, None, None, None  # the inverse rotation


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0,
                 interleaved: bool = False):
        super().__init__()
        rot_dim = int(kv_channels * rotary_percent)
        if rot_dim % 2 or rot_dim == 0:
            raise ValueError(
                f"rotary dim kv_channels ({kv_channels}) x rotary_percent ({rotary_percent}) = "
                f"{rot_dim} must be a positive even number"
            )
        self.rot_dim, self.base, self.interleaved = rot_dim, float(rotary_base), interleaved
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
        # Not persistent: derived from the config, never checkpointed.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype, cache: Optional[dict] = None):
        """cos and sin [s, b, 1, rot/2] in `dtype` for position ids [b, s]: computed in fp32, and
        kept in `cache` (the batch's) so the other layers of the step reuse them."""
        key = (self.rot_dim, self.base, dtype, position_ids.device)
        if cache is not None and key in cache:
            return cache[key]
        # angles [b, s, rot/2] -> [s, b, 1, rot/2]
        angles = (position_ids.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq).transpose(0, 1).unsqueeze(2)
        value = (angles.cos().to(dtype), angles.sin().to(dtype))
        if cache is not None:
            cache[key] = value
        return value

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: Optional[dict] = None) -> torch.Tensor:
        """x [s, b, h, d]; position_ids [b, s] -> x rotated, same shape and dtype."""
        cos, sin = self.cos_sin(position_ids, x.dtype, cache)
        return _Rotation.apply(x, cos, sin, self.rot_dim, self.interleaved)
