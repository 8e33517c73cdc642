"""Rotary position embedding applied from explicit position ids.

Megatron's convention (non-interleaved): the first rot_dim = kv_channels * rotary_percent channels
of each head are rotated; frequencies inv_freq[j] = base^(-2j / rot_dim); channel pairs are
(x[j], x[j + rot_dim/2]) ("rotate half"), or with --rotary-interleaved (x[2j], x[2j+1]). Taking
the angles from position ids rather than from
0..s-1 is what lets a rank hold any subset of the sequence (context-parallel chunks, pipeline
segments, reset position ids) and still rotate each token by its true position.

The angles are computed in fp32 once per step (per batch, shared by every layer through the
batch's cache) and cast to the input dtype; the rotation runs in the input dtype, as Megatron's
unfused RoPE does, and saves only cos and sin for backward (the backward is the transposed rotation).

Context extension stretches the frequencies (RopeScaling), each as Megatron's flag and Hugging Face's
rope type define it:
  linear   --rotary-seq-len-interpolation-factor f: every frequency / f (position interpolation)
  llama3   --use-rope-scaling --rope-scaling-factor f: wavelengths longer than the original context
           divided by f, shorter than a quarter of it kept, a smooth blend between (Llama 3.1)
  yarn     --rope-type yarn --rotary-scaling-factor f: per-dimension blend of divided and kept
           frequencies by the rotations each makes over the original context (beta_fast, beta_slow),
           and cos/sin multiplied by the attention factor 0.1 ln f + 1 (or its mscale ratio)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

LLAMA3_CONTEXT, YARN_CONTEXT = 8192, 4096  # the original context each type assumes by default


@dataclass(frozen=True)
class RopeScaling:
    """How the frequencies are stretched for a longer context; the defaults stretch nothing."""
    kind: str = "rope"  # rope | llama3 | yarn
    factor: float = 1.0  # llama3's --rope-scaling-factor or yarn's --rotary-scaling-factor
    interpolation: float = 1.0  # --rotary-seq-len-interpolation-factor, composable with either
    original_context: Optional[int] = None  # --original-max-position-embeddings
    low_freq_factor: float = 1.0  # llama3: Megatron's fixed values
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def context(self) -> int:
        if self.original_context is not None:
            return self.original_context
        return LLAMA3_CONTEXT if self.kind == "llama3" else YARN_CONTEXT


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths divided by the factor, short ones kept, a linear blend in 1/wavelength
    between them."""
    wavelen = 2 * math.pi / inv
    long_w, short_w = s.context() / s.low_freq_factor, s.context() / s.high_freq_factor
    smooth = ((s.context() / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    return torch.where(wavelen > long_w, inv / s.factor, torch.where(wavelen < short_w, inv, blended))


def _yarn_dim(rotations: float, rot_dim: int, base: float, context: int) -> float:
    """The (fractional) pair index whose frequency turns `rotations` times over `context` tokens."""
    return rot_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn(inv: torch.Tensor, s: RopeScaling, base: float, rot_dim: int) -> torch.Tensor:
    """Pairs that turn more than beta_fast times over the original context keep their frequency,
    those turning fewer than beta_slow times are divided by the factor, a linear ramp between
    (the ramp's ends rounded outwards to whole pairs, as Megatron and Hugging Face do)."""
    low = max(math.floor(_yarn_dim(s.beta_fast, rot_dim, base, s.context())), 0)
    high = min(math.ceil(_yarn_dim(s.beta_slow, rot_dim, base, s.context())), rot_dim - 1)
    span = (high - low) or 0.001  # one-pair ramp: a step, not a division by zero
    ramp = ((torch.arange(rot_dim // 2, dtype=inv.dtype) - low) / span).clamp(0, 1)
    return inv / s.factor * ramp + inv * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(s: RopeScaling) -> float:
    """YaRN's multiplier of cos and sin (so of every score, squared); 1 for the other types. Always
    the ratio of the two mscales, as megatron-core (--mscale 1 over --mscale-all-dim 0, the defaults,
    is YaRN's 0.1 ln f + 1); transformers' other rule for a lone mscale is mapped in convert/hf.py."""
    if s.kind != "yarn":
        return 1.0
    return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)


def inverse_frequencies(base: float, rot_dim: int, s: RopeScaling) -> torch.Tensor:
    """inv_freq [rot/2] in fp64: base^(-2j / rot_dim), stretched as `s` says."""
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    if s.kind == "llama3":
        inv = _llama3(inv, s)
    elif s.kind == "yarn":
        inv = _yarn(inv, s, base, rot_dim)
    return inv / s.interpolation


def _pairs(t: torch.Tensor, rot_dim: int, interleaved: bool):
    """The two members of every rotated channel pair, as views [..., rot/2]."""
    if interleaved:
        return t[..., 0:rot_dim:2], t[..., 1:rot_dim:2]
    return t[..., : rot_dim // 2], t[..., rot_dim // 2 : rot_dim]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, interleaved: bool) -> torch.Tensor:
    """x [s, b, h, d] rotated by the angles whose cos/sin are [s, b, 1, rot/2] (x's dtype): pairs
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). One new tensor, no temporaries. cos and sin
    may carry a common factor m (YaRN): the map is then m times a rotation, and the same call with
    -sin is its transpose, which is what backward needs."""
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
        return _rotate(grad, cos, -sin, ctx.rot_dim, ctx.interleaved), None, None, None, None  # the transpose


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0,
                 interleaved: bool = False, scaling: RopeScaling = RopeScaling()):
        super().__init__()
        rot_dim = int(kv_channels * rotary_percent)
        if rot_dim % 2 or rot_dim == 0:
            raise ValueError(
                f"rotary dim kv_channels ({kv_channels}) x rotary_percent ({rotary_percent}) = "
                f"{rot_dim} must be a positive even number"
            )
        self.rot_dim, self.base, self.interleaved = rot_dim, float(rotary_base), interleaved
        self.scaling, self.attention_factor = scaling, attention_factor(scaling)
        inv_freq = inverse_frequencies(self.base, rot_dim, scaling)
        # Not persistent: derived from the config, never checkpointed.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def _apply(self, fn, recurse=True):
        """inv_freq follows the module's device moves but not its casts: Float16Module's .bfloat16()
        would round the frequencies, and the positions multiplied by them, to 8 significant bits
        (every position past 256, 512 apart at 100K tokens)."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)  # fp32, on the device the buffer moved to
        return self

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype, cache: Optional[dict] = None):
        """cos and sin [s, b, 1, rot/2] in `dtype` for position ids [b, s]: computed in fp32, and
        kept in `cache` (the batch's) so the other layers of the step reuse them."""
        key = (self.rot_dim, self.base, self.scaling, dtype, position_ids.device)
        if cache is not None and key in cache:
            return cache[key]
        # angles [b, s, rot/2] -> [s, b, 1, rot/2]
        angles = (position_ids.float().unsqueeze(-1) * self.inv_freq).transpose(0, 1).unsqueeze(2)  # fp32
        m = self.attention_factor
        value = ((angles.cos() * m).to(dtype), (angles.sin() * m).to(dtype))
        if cache is not None:
            cache[key] = value
        return value

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cache: Optional[dict] = None) -> torch.Tensor:
        """x [s, b, h, d]; position_ids [b, s] -> x rotated, same shape and dtype."""
        cos, sin = self.cos_sin(position_ids, x.dtype, cache)
        return _Rotation.apply(x, cos, sin, self.rot_dim, self.interleaved)
