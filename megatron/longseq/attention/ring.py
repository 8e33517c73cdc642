"""Causal ring attention with Megatron's load balance, as Double-Ring-Attention (LoongTrain §4.3).

Ring position j holds queries and KV of chunks (j, 2R-1-j) (placement.py). The R positions form
O = R/W inner rings of W; at outer step o, inner step t, position j = W*i + p holds the KV block of
position src = W*((i - o) mod O) + (p - t) mod W. With W = R this is the plain ring (O = 1); with
R = 1 it is local causal attention: one path for every degree.

Against a block from src, by position order of the chunks (all blocks are full except the diagonal):
  src == j : causal over [chunk j ; chunk 2R-1-j] (the local sequence is in position order)
  src <  j : all queries see only the block's first chunk (src), fully
  src >  j : only the second query chunk (2R-1-j) sees the block, fully
Partial (out, lse) are merged in fp32. Backward runs the kernel backward per block with the final
out/lse; dK/dV accumulators (fp32) travel with their KV block and return to its owner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.longseq.attention.comm import RingComm
from megatron.longseq.attention.kernels import AttentionKernel

CAUSAL, KV_FIRST, Q_SECOND = "causal", "kv-first", "q-second"


def step_plan(j: int, src: int) -> str:
    if src == j:
        return CAUSAL
    return KV_FIRST if src < j else Q_SECOND


@dataclass
class RingContext:
    """This rank's place in the double ring and its two communicators."""

    inner: Optional[RingComm]  # None when the ring has one position
    outer: Optional[RingComm]
    ring_index: int  # j
    inner_size: int  # W
    outer_size: int  # O

    @property
    def size(self) -> int:
        return self.inner_size * self.outer_size

    def source(self, o: int, t: int) -> int:
        i, p = divmod(self.ring_index, self.inner_size)
        return self.inner_size * ((i - o) % self.outer_size) + (p - t) % self.inner_size


LOCAL = RingContext(None, None, 0, 1, 1)


# ---- one block ----------------------------------------------------------------------------------

def _halves(x: torch.Tensor):
    h = x.shape[2] // 2
    return x[:, :, :h], x[:, :, h:]


def block_forward(q, kv, plan, kernel: AttentionKernel, scale):
    """(out, lse) of the queries this block touches (all, or the second half)."""
    k, v = kv[0], kv[1]
    if plan == CAUSAL:
        return kernel.forward(q, k, v, True, scale)
    if plan == KV_FIRST:
        return kernel.forward(q, _halves(k)[0], _halves(v)[0], False, scale)
    return kernel.forward(_halves(q)[1], k, v, False, scale)


def merge(out, lse, block_out, block_lse, rows):
    """Online-softmax merge into the fp32 accumulators, over all rows or the second half."""
    if out is None:  # the first block of a ring is the causal diagonal: it covers every row
        return block_out, block_lse
    if out.dtype != torch.float32:  # a second block: from here on accumulate in fp32
        out = out.float()
    o_rows = out if rows == "all" else _halves(out)[1]
    l_rows = lse if rows == "all" else lse[:, :, lse.shape[2] // 2 :]
    new_lse = torch.logaddexp(l_rows, block_lse)
    merged = o_rows * torch.exp(l_rows - new_lse).unsqueeze(-1) + block_out.float() * torch.exp(
        block_lse - new_lse).unsqueeze(-1)
    o_rows.copy_(merged)
    l_rows.copy_(new_lse)
    return out, lse


def block_backward(dout, q, kv, out, lse, plan, kernel: AttentionKernel, scale, dq, dkv):
    """Add this block's dq (fp32, in place) and return its dK/dV as [2, b, g, s, d] fp32."""
    k, v = kv[0], kv[1]
    if plan == CAUSAL:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, k, v, out, lse, True, scale)
        dq += dq_b
        return torch.stack([dk_b, dv_b]).float()
    if plan == KV_FIRST:
        kf, vf = _halves(k)[0], _halves(v)[0]
        dq_b, dk_b, dv_b = kernel.backward(dout, q, kf, vf, out, lse, False, scale)
        dq += dq_b
        block = torch.zeros_like(dkv)
        block[0, :, :, : kf.shape[2]], block[1, :, :, : vf.shape[2]] = dk_b, dv_b
        return block
    half = q.shape[2] // 2
    dq_b, dk_b, dv_b = kernel.backward(dout[:, :, half:], q[:, :, half:], k, v, out[:, :, half:],
                                       lse[:, :, half:], False, scale)
    dq[:, :, half:] += dq_b
    return torch.stack([dk_b, dv_b]).float()


# ---- the double ring -------------------------------------------------------------------------------

def ring_forward(q, k, v, rc: RingContext, kernel, scale, layer=None):
    """q [b, h, s, d], k/v [b, g, s, d] (local chunks) -> out (q's dtype), lse fp32 [b, h, s]."""
    if rc.size == 1:  # no ring: the local causal kernel, nothing to merge
        return kernel.forward(q, k, v, True, scale)
    kv = torch.stack([k, v])  # [2, b, g, s, d]: one message per step
    out = lse = None
    for o in range(rc.outer_size):
        outer = rc.outer.send_recv(kv, layer, "fwd") if o + 1 < rc.outer_size else None
        cur = kv
        for t in range(rc.inner_size):
            inner = rc.inner.send_recv(cur, layer, "fwd") if t + 1 < rc.inner_size else None
            plan = step_plan(rc.ring_index, rc.source(o, t))
            block_out, block_lse = block_forward(q, cur, plan, kernel, scale)
            out, lse = merge(out, lse, block_out, block_lse, "second" if plan == Q_SECOND else "all")
            if inner is not None:
                cur = inner.wait()
        if outer is not None:
            kv = outer.wait()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, rc: RingContext, kernel, scale, layer=None):
    if rc.size == 1:
        return kernel.backward(dout, q, k, v, out, lse, True, scale)
    kv = torch.stack([k, v])
    dq = torch.zeros_like(q, dtype=torch.float32)
    acc = torch.zeros_like(kv, dtype=torch.float32)  # dK/dV of the outer step's first block
    for o in range(rc.outer_size):
        outer = rc.outer.send_recv(kv, layer, "bwd") if o + 1 < rc.outer_size else None
        cur, pending_acc = kv, None
        for t in range(rc.inner_size):
            inner = rc.inner.send_recv(cur, layer, "bwd") if t + 1 < rc.inner_size else None
            plan = step_plan(rc.ring_index, rc.source(o, t))
            block = block_backward(dout, q, cur, out, lse, plan, kernel, scale, dq, acc)
            if pending_acc is not None:  # the block's accumulator, from the previous holder
                acc = pending_acc.wait()
            acc = acc + block
            if rc.inner_size > 1:  # pass it on with the block (after W steps: back to the start)
                pending_acc = rc.inner.send_recv(acc, layer, "bwd")
            if inner is not None:
                cur = inner.wait()
        if pending_acc is not None:
            acc = pending_acc.wait()
        if rc.outer_size > 1:  # to the next inner ring, which starts with this block next step
            acc = rc.outer.send_recv(acc, layer, "bwd").wait()
        if outer is not None:
            kv = outer.wait()
    # After the last outer step the accumulator in hand is this rank's own block's.
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rc, kernel, scale, layer, cached):
        out, lse = cached if cached is not None else ring_forward(q, k, v, rc, kernel, scale, layer)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (rc, kernel, scale, layer)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q, k, v, rc: RingContext, kernel, scale, layer=None, cached=None):
    """(out, lse) of causal attention of this rank's queries over the whole ring's keys.
    `cached` = (out, lse) from an earlier forward skips the computation (Selective Checkpoint++)."""
    return _RingAttention.apply(q, k, v, rc, kernel, scale, layer, cached)
