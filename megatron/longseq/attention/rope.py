"""Rotary position embedding applied from explicit position ids.

Megatron's convention (non-interleaved): the first rot_dim = kv_channels * rotary_percent channels
of each head are rotated; frequencies inv_freq[j] = base^(-2j / rot_dim); channel pairs are
(x[j], x[j + rot_dim/2]) ("rotate half"). Taking the angles from position ids rather than from
0..s-1 is what lets a rank hold any subset of the sequence (context-parallel chunks, pipeline
segments, reset position ids) and still rotate each token by its true position.
"""
from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0):
        super().__init__()
        rot_dim = int(kv_channels * rotary_percent)
        if rot_dim % 2 or rot_dim == 0:
            raise ValueError(
                f"rotary dim kv_channels ({kv_channels}) x rotary_percent ({rotary_percent}) = "
                f"{rot_dim} must be a positive even number"
            )
        self.rot_dim = rot_dim
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
        # Not persistent: derived from the config, never checkpointed.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [s, b, h, d]; position_ids [b, s] -> x rotated, same shape and dtype."""
        # angles [b, s, rot/2] -> [s, b, 1, rot/2]
        angles = position_ids.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq
        angles = angles.transpose(0, 1).unsqueeze(2)
        cos, sin = angles.cos(), angles.sin()
        rot, rest = x[..., : self.rot_dim].float(), x[..., self.rot_dim :]
        x1, x2 = rot.chunk(2, dim=-1)  # each [s, b, h, rot/2]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((rotated.to(x.dtype), rest), dim=-1) if rest.numel() else rotated.to(x.dtype)
