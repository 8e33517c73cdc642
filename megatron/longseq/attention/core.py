"""The `core_attention` module our layer spec puts into megatron-core's SelfAttention.

megatron-core calls it with q [sq, b, hq/tp, d] and k, v [sk, b, hkv/tp, d] (KV not repeated for
GQA) and expects [sq, b, hq*d/tp]. Position embedding is applied here, from true position ids, not
by GPTModel: a rank may hold any subset of the tokens, and only the ids say where each one is.

Every context-parallel mode is one path (LoongTrain Algorithm 1), each step the identity at
degree 1: KV replication (only when head-parallel size > KV heads), SeqAlltoAll over the
head-parallel group, Double-Ring-Attention over the ring, SeqAlltoAll back. cp = 1 is local
attention; hp = cp is DeepSpeed-Ulysses; hp = 1 is ring attention; both > 1 is 2D attention.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch.nn.attention import sdpa_kernel

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.longseq.attention.comm import seq_all_to_all
from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.documents import document_ids
from megatron.longseq.attention.kernel_choice import sdpa_backends, select_kernel
from megatron.longseq.attention.kernels import AttentionKernel, default_scale
from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.attention.placement import DocumentLayout, split_heads
from megatron.longseq.attention.ring import ring_attention
from megatron.longseq.attention.segments import SegmentSlot
from megatron.longseq.memo.runtime import active_layer
from megatron.longseq.attention.rope import RotaryEmbedding
from megatron.longseq.random import checkpoint, current_region, get_rng_tracker


SDPA = "torch-sdpa"  # document masks and attention dropout: torch picks its own kernel


@dataclass
class AttentionInputs(PackedSeqParams):
    """Per-batch attention metadata, carried to core_attention through megatron-core's
    `packed_seq_params` argument. Its qkv_format is 'sbhd', which megatron-core treats as an
    ordinary (unpacked) batch, so nothing else on the way looks at it."""

    position_ids: Optional[torch.Tensor] = None  # [b, s] true positions of this rank's tokens
    segment: Optional[SegmentSlot] = None  # Seq1F1B: which segment of which micro-batch this is
    rope_cache: dict = field(default_factory=dict)  # RoPE cos/sin of these positions, for every layer
    document_starts: Optional[torch.Tensor] = None  # [b, S] packed documents of the whole samples
    segment_lengths: Optional[List[int]] = None  # the Seq1F1B segments they chose (None: the run's)
    _documents: Optional[DocumentLayout] = None  # built from them by the first layer, for all
    _dense_mask: Optional[torch.Tensor] = None  # the same as a [b, 1, S, S] mask, on the device (SDPA)

    def __post_init__(self):
        if self.qkv_format is None:
            self.qkv_format = "sbhd"

    def documents(self, cp: ContextParallel) -> Optional[DocumentLayout]:
        """The micro-batch's packed documents as the ring sees them (None: causal attention)."""
        if self.document_starts is not None and self._documents is None:
            lengths = self.segment_lengths if self.segment_lengths is not None else cp.segment_lengths
            self._documents = DocumentLayout(self.document_starts, cp.ring.size, lengths)
        return self._documents

    def dense_mask(self, device: torch.device) -> torch.Tensor:
        """The documents as a dense mask for torch's SDPA, made on the device by the first layer."""
        if self._dense_mask is None:
            self._dense_mask = dense_document_mask(self.document_starts.to(device))
        return self._dense_mask


class LongSeqCoreAttention(MegatronModule):
    """Causal self-attention, context-parallel as `cp` says, through the fastest local kernel."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self",
                 cp_comm_type=None, softmax_scale=None, pg_collection=None, cp: ContextParallel = None):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"only self attention is supported, got {attention_type}")
        self.layer_number = layer_number
        self.cp = cp if cp is not None else ContextParallel.local()
        self.scale = default_scale(config.kv_channels, softmax_scale)
        self.dropout_p = config.attention_dropout
        self.recompute = getattr(config, "recompute_core_attention", False)
        self.keep_attention = getattr(config, "selective_checkpoint_pp", False)
        self.rope = None
        if getattr(config, "use_rope", False):
            self.rope = RotaryEmbedding(config.kv_channels, config.rotary_percent, config.rotary_base,
                                        config.rotary_interleaved, config.rope_scaling)
        self._kernel: Optional[AttentionKernel] = None
        self.kernel_ran: Optional[str] = None  # the name of the last kernel called, for the log

    def kernel_for(self, x: torch.Tensor) -> AttentionKernel:
        if self._kernel is None:
            self._kernel = select_kernel(self.config.attention_backend.name, x.device, x.dtype, x.shape[-1])
        self.kernel_ran = self._kernel.name
        return self._kernel

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported")
        if _is_thd(packed_seq_params):  # megatron-core's packed format: q [t, h, d], documents by cu_seqlens
            inputs = thd_inputs(packed_seq_params, query.shape[0], self.cp)
            # [t, h, d] -> [t, 1, h, d]: one sample of t tokens; out [t, 1, h*d] -> [t, h*d]
            out = self.forward(*(x.unsqueeze(1) for x in (query, key, value)), attention_mask,
                               packed_seq_params=inputs)
            return out.squeeze(1)
        memo = active_layer()
        if memo is None:
            return self._forward(query, key, value, attention_mask, packed_seq_params)[0]
        if memo.phase == "replay":  # MEMO recomputes the layer's other ops, never attention
            # (but its measuring iteration, which keeps no attention output)
            return memo.attention_rows(query, key, value,
                                       lambda: self._forward(query, key, value, None, packed_seq_params))
        if self._needs_sdpa(attention_mask):  # no lse to keep: everything it saves goes whole
            with memo.attention():
                out = self._forward(query, key, value, attention_mask, packed_seq_params)[0]
            memo.keep_attention_output(out)
            return out
        return _KeptAttention.apply(query, key, value, self, packed_seq_params, memo)

    def _needs_sdpa(self, attention_mask) -> bool:
        return attention_mask is not None or (self.training and self.dropout_p > 0.0)

    def _forward(self, query, key, value, attention_mask, packed_seq_params, kept=None):
        """(out [s, b, h*d], lse or None); `kept` = (out, lse) of an earlier forward skips the
        attention itself (MEMO's backward)."""
        if self.rope is not None:
            positions = positions_of(packed_seq_params, query)
            cache = packed_seq_params.rope_cache if isinstance(packed_seq_params, AttentionInputs) else None
            query, key = self.rope(query, positions, cache), self.rope(key, positions, cache)
        params = packed_seq_params if isinstance(packed_seq_params, AttentionInputs) else AttentionInputs()
        with LEDGER.scope(self.layer_number):
            if self.recompute and self.training:
                return checkpoint(self._attend, query, key, value, attention_mask, params)
            return self._attend(query, key, value, attention_mask, params, kept)

    def _attend(self, query, key, value, attention_mask, params, kept=None):
        sq, b = query.shape[:2]
        dropout = self.dropout_p if self.training else 0.0
        if self._needs_sdpa(attention_mask):
            if self.cp.size > 1 or params.segment is not None:
                raise ValueError("attention dropout and dense attention masks need --context-parallel-size 1 "
                                 "and --pipe-sp-splits 1")
            if attention_mask is None and params.document_starts is not None:
                attention_mask = params.dense_mask(query.device)
            out = self._sdpa(*(x.permute(1, 2, 0, 3) for x in (query, key, value)), attention_mask, dropout)
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1), None  # [b, h, s, d] -> [s, b, h*d]
        out, lse = self._two_d(query, key, value, params, kept)
        return out.reshape(sq, b, -1), lse  # [s, b, h, d] -> [s, b, h*d]

    def _two_d(self, query, key, value, params, kept=None):
        """LoongTrain Algorithm 1 on [s, b, h, d] tensors; returns ([s_local, b, h, d], lse)."""
        cp, layer = self.cp, self.layer_number
        split = split_heads(query.shape[2], key.shape[2], cp.hp_size)
        if split.kv_repeat > 1:  # [s, b, g, d] -> [s, b, g*r, d]; autograd sums the replicas' grads
            key, value = (x.repeat_interleave(split.kv_repeat, dim=2) for x in (key, value))
        # [s/hp, b, h, d] -> [s, b, h/hp, d] (sequence gathered, heads scattered)
        q = seq_all_to_all(query, cp.hp_group, split.q_counts, cp.hp_index, True, layer)
        k = seq_all_to_all(key, cp.hp_group, split.kv_counts, cp.hp_index, True, layer)
        v = seq_all_to_all(value, cp.hp_group, split.kv_counts, cp.hp_index, True, layer)
        ring_kept = None
        if kept is not None:  # the output goes the same way as q: [s/hp, b, h*d] -> [s, b, h/hp, d]
            out = seq_all_to_all(kept[0].view(query.shape), cp.hp_group, split.q_counts, cp.hp_index, True, layer)
            ring_kept = (out.permute(1, 2, 0, 3), kept[1])  # [s, b, h, d] -> [b, h, s, d]
        # [s, b, h, d] -> [b, h, s, d] views for the kernels
        out, lse = self._ring(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), params, ring_kept)
        # [b, h/hp, s, d] -> [s, b, h/hp, d] -> [s/hp, b, h, d]
        return seq_all_to_all(out.permute(2, 0, 1, 3), cp.hp_group, split.q_counts, cp.hp_index, False, layer), lse

    def _ring(self, q, k, v, params, kept=None):
        """Double-Ring-Attention, with Selective Checkpoint++: inside a full-recompute region the
        forward keeps (out, lse) and the recompute reuses them instead of attending again."""
        region = current_region() if self.keep_attention and kept is None else None
        if region is not None and region.phase == "recompute":
            kept = region.kept.pop(0)
        out, lse = ring_attention(q, k, v, self.cp.ring, self.kernel_for(q), self.scale, self.layer_number,
                                  kept, params.segment, params.documents(self.cp))
        if region is not None and region.phase == "forward":
            region.kept.append((out.detach(), lse.detach()))
        return out, lse

    def _sdpa(self, q, k, v, attention_mask, dropout):
        """Document masks (--reset-attention-mask) and attention dropout go through torch's SDPA:
        it takes an arbitrary mask and draws dropout itself. Megatron's mask is True where a
        query must NOT see a key; SDPA's boolean mask is True where it may."""
        mask = None if attention_mask is None else ~attention_mask
        self.kernel_ran = SDPA
        backends = sdpa_backends(self.config.attention_backend.name, q.device.type)  # the flag's kind first
        # Heads are split over tp ranks: dropout draws from the per-rank stream.
        with get_rng_tracker().fork() if dropout > 0.0 else contextlib.nullcontext(), \
                sdpa_kernel(backends, set_priority=True) if backends else contextlib.nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                scale=self.scale, enable_gqa=q.shape[1] != k.shape[1],
            )


class _KeptAttention(torch.autograd.Function):
    """Attention under MEMO. It saves its inputs q, k, v [s, b, h, d] -- before RoPE and the
    all-to-all, so token-wise: the runtime offloads alpha of their tokens and the replay
    recomputes the rest from the layer input -- and its output and lse, which the runtime
    offloads whole (S_attn). Backward runs the same path again with (out, lse) given: RoPE, the
    all-to-alls of q, k, v and out (collectives, when hp > 1), and the ring's backward; attention
    itself is not recomputed."""

    @staticmethod
    def forward(ctx, query, key, value, module, params, layer):
        out, lse = module._forward(query, key, value, None, params)
        layer.keep_attention_output(out, lse)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (module, params)
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        module, params = ctx.args
        inputs = [t.detach().requires_grad_(True) for t in (query, key, value)]
        with torch.enable_grad():
            again, _ = module._forward(*inputs, None, params, (out, lse))
        torch.autograd.backward(again, dout)
        return inputs[0].grad, inputs[1].grad, inputs[2].grad, None, None, None


def _is_thd(params) -> bool:
    return isinstance(params, PackedSeqParams) and not isinstance(params, AttentionInputs) and params.qkv_format == "thd"


def thd_inputs(params: PackedSeqParams, tokens: int, cp: ContextParallel) -> AttentionInputs:
    """megatron-core's PackedSeqParams (qkv_format 'thd', one pack of `tokens` tokens whose
    documents end at cu_seqlens) as our metadata: document starts, and positions restarting at
    every document. Made once per pack and kept on it: every layer gets the same object, and with it
    the documents' layout and RoPE tables the first layer builds (and one host read of cu_seqlens)."""
    made = getattr(params, "_longseq_inputs", None)
    if made is None or made[0] != tokens:
        made = (tokens, _thd_inputs(params, tokens, cp))
        params._longseq_inputs = made
    return made[1]


def _thd_inputs(params: PackedSeqParams, tokens: int, cp: ContextParallel) -> AttentionInputs:
    # Context parallelism places packed documents itself (the data loader's placement), so a pack
    # sharded elsewhere is refused.
    cu = params.cu_seqlens_q
    if cp.size > 1:
        raise ValueError("megatron-core's packed 'thd' batches work at --context-parallel-size 1; with context "
                         "parallelism use --reset-attention-mask (this project's data loader places the documents)")
    for other in (params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded):
        if other is not None and not torch.equal(other, cu):
            raise ValueError("packed 'thd' batches need the same cu_seqlens for queries and keys, unpadded")
    begins = cu[:-1].cpu().long()  # where each document begins; one device-to-host read
    starts = torch.zeros(1, tokens, dtype=torch.bool)
    starts[0, begins] = True
    starts[0, 0] = True
    first = torch.searchsorted(begins, torch.arange(tokens), right=True) - 1
    positions = torch.arange(tokens) - begins[first.clamp(min=0)]
    return AttentionInputs(position_ids=positions.unsqueeze(0).to(cu.device), document_starts=starts)


def dense_document_mask(starts: torch.Tensor) -> torch.Tensor:
    """[b, S] document starts -> [b, 1, S, S] bool, True where a query must NOT see a key
    (Megatron's convention): for torch's SDPA, which draws attention dropout itself. Only for
    dropout at context-parallel size 1; every other path attends by document pieces."""
    doc = document_ids(starts)
    causal = torch.ones(doc.shape[1], doc.shape[1], dtype=torch.bool, device=starts.device).tril()
    return ~((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)


def positions_of(params, like: torch.Tensor) -> torch.Tensor:
    """[b, s] position ids from the batch metadata, or 0..s-1 when the caller gave none (which
    only a whole sequence may: a Seq1F1B segment's tokens start further on)."""
    if isinstance(params, AttentionInputs) and params.position_ids is not None:
        return params.position_ids
    if isinstance(params, AttentionInputs) and params.segment is not None:
        raise ValueError("a Seq1F1B segment needs the position ids of its tokens (0..s-1 are the first segment's)")
    s, b = like.shape[:2]
    return torch.arange(s, device=like.device).unsqueeze(0).expand(b, s)
