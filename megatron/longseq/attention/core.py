"""The `core_attention` module our layer spec puts into megatron-core's SelfAttention.

megatron-core calls it with q [sq, b, hq/tp, d] and k, v [sk, b, hkv/tp, d] (KV not repeated for
GQA) and expects [sq, b, hq*d/tp]. Position embedding is applied here, from true position ids, not
by GPTModel: a rank may hold any subset of the tokens, and only the ids say where each one is.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.longseq.attention.kernels import AttentionKernel, default_scale, select_kernel
from megatron.longseq.attention.local import local_attention
from megatron.longseq.attention.rope import RotaryEmbedding
from megatron.longseq.random import checkpoint, get_rng_tracker


@dataclass
class AttentionInputs(PackedSeqParams):
    """Per-batch attention metadata, carried to core_attention through megatron-core's
    `packed_seq_params` argument. Its qkv_format is 'sbhd', which megatron-core treats as an
    ordinary (unpacked) batch, so nothing else on the way looks at it."""

    position_ids: Optional[torch.Tensor] = None  # [b, s] true positions of this rank's tokens

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"


class LongSeqCoreAttention(MegatronModule):
    """Causal self-attention through the fastest local kernel, RoPE from position ids."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self",
                 cp_comm_type=None, softmax_scale=None, pg_collection=None):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"only self attention is supported, got {attention_type}")
        self.layer_number = layer_number
        self.scale = default_scale(config.kv_channels, softmax_scale)
        self.dropout_p = config.attention_dropout
        self.recompute = getattr(config, "recompute_core_attention", False)
        self.rope = None
        if getattr(config, "use_rope", False):
            self.rope = RotaryEmbedding(config.kv_channels, config.rotary_percent, config.rotary_base)
        self._kernel: Optional[AttentionKernel] = None

    def kernel_for(self, x: torch.Tensor) -> AttentionKernel:
        if self._kernel is None:
            self._kernel = select_kernel(self.config.attention_backend.name, x.device, x.dtype)
        return self._kernel

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported")
        if self.rope is not None:
            positions = positions_of(packed_seq_params, query)
            query, key = self.rope(query, positions), self.rope(key, positions)
        if self.recompute and self.training:
            return checkpoint(self._attend, query, key, value, attention_mask)
        return self._attend(query, key, value, attention_mask)

    def _attend(self, query, key, value, attention_mask):
        sq, b = query.shape[:2]
        # [s, b, h, d] -> [b, h, s, d]: views, the kernels take strided inputs.
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is not None or dropout > 0.0:
            out = self._sdpa(q, k, v, attention_mask, dropout)
        else:
            out, _ = local_attention(q, k, v, self.kernel_for(q), True, self.scale)
        # [b, h, s, d] -> [s, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _sdpa(self, q, k, v, attention_mask, dropout):
        """Document masks (--reset-attention-mask) and attention dropout go through torch's SDPA:
        it takes an arbitrary mask and draws dropout itself. Megatron's mask is True where a
        query must NOT see a key; SDPA's boolean mask is True where it may."""
        mask = None if attention_mask is None else ~attention_mask
        # Heads are split over tp ranks: dropout draws from the per-rank stream.
        with get_rng_tracker().fork() if dropout > 0.0 else contextlib.nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                scale=self.scale, enable_gqa=q.shape[1] != k.shape[1],
            )


def positions_of(params, like: torch.Tensor) -> torch.Tensor:
    """[b, s] position ids from the batch metadata, or 0..s-1 when the caller gave none."""
    if isinstance(params, AttentionInputs) and params.position_ids is not None:
        return params.position_ids
    s, b = like.shape[:2]
    return torch.arange(s, device=like.device).unsqueeze(0).expand(b, s)
