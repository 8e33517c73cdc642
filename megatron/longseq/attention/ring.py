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
from megatron.longseq.attention.kernels import AttentionKernel, grad_like

CAUSAL, KV_FIRST, Q_SECOND, FULL = "causal", "kv-first", "q-second", "full"


def step_plan(j: int, src: int, causal: bool = True) -> str:
    """What this rank's queries see of ring position src's block. Not causal: the block belongs
    to an earlier Seq1F1B segment, wholly in the past."""
    if not causal:
        return FULL
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
    if plan in (CAUSAL, FULL):
        return kernel.forward(q, k, v, plan == CAUSAL, scale)
    if plan == KV_FIRST:
        return kernel.forward(q, _halves(k)[0], _halves(v)[0], False, scale)
    return kernel.forward(_halves(q)[1], k, v, False, scale)


def merge(out, lse, block_out, block_lse, rows):
    """Online-softmax merge into the fp32 accumulators, in place, over all rows or the second half.

    With d = block_lse - lse: the new lse is lse + softplus(d) and the rows merged so far keep the
    weight exp(lse - new lse) = sigmoid(-d), so out = block + (out - block) * sigmoid(-d). Two
    lse-sized temporaries and three in-place passes over out; binary in-place ops cast a bf16
    block on the fly, so no fp32 copy of it is made."""
    if out is None:  # the first block of a ring is the causal diagonal: it covers every row
        return block_out, block_lse
    if out.dtype != torch.float32:  # a second block: from here on accumulate in fp32
        out = out.float()
    o_rows = out if rows == "all" else _halves(out)[1]
    l_rows = lse if rows == "all" else lse[:, :, lse.shape[2] // 2 :]
    d = block_lse - l_rows  # [b, h, s']
    l_rows += torch.nn.functional.softplus(d)
    old_weight = d.neg_().sigmoid_().unsqueeze(-1)  # [b, h, s', 1]
    o_rows.sub_(block_out).mul_(old_weight).add_(block_out)
    return out, lse


class _Rows:
    """What a block's backward reads of the query side: (dout, out, lse) of all rows, or of the
    second half. Kernels read lse through a raw pointer as a contiguous [b, h, s] tensor, and a
    slice of its last dim is not one, so the second half of lse is copied -- once per backward."""

    def __init__(self, dout, out, lse):
        self.all = (dout, out, lse)
        self._second = None

    def second(self):
        if self._second is None:
            dout, out, lse = self.all
            h = lse.shape[2] // 2
            self._second = (dout[:, :, h:], out[:, :, h:], lse[:, :, h:].contiguous())
        return self._second


def block_backward(q, kv, rows: _Rows, plan, kernel: AttentionKernel, scale, dq):
    """Add this block's dq into `dq` (fp32, in place); return its (dK, dV) for add_block_grads."""
    k, v = kv[0], kv[1]
    dout, out, lse = rows.second() if plan == Q_SECOND else rows.all
    if plan == KV_FIRST:  # the block's first chunk only
        k, v = _halves(k)[0], _halves(v)[0]
    if plan == Q_SECOND:  # the second query chunk only
        q, dq = _halves(q)[1], _halves(dq)[1]
    dq_b, dk_b, dv_b = kernel.backward(dout, q, k, v, out, lse, plan == CAUSAL, scale)
    dq += dq_b
    return dk_b, dv_b


def add_block_grads(acc, plan, grads) -> None:
    """acc [2, b, g, s, d] (fp32) += the block's (dK, dV), in place (the first chunk's rows only
    for a kv-first block)."""
    if plan == KV_FIRST:  # [2, b, g, s, d] -> the first half of s
        acc = acc[:, :, :, : acc.shape[3] // 2]
    acc[0] += grads[0]
    acc[1] += grads[1]


# ---- the double ring -------------------------------------------------------------------------------

class _Pair:
    """Receive buffers shaped like `like` (at most two, made on first use and reused for every
    later step of one ring call): a receive never lands in the buffer being sent, and the other
    one's last send has completed by then (every step waits for its send and receive together)."""

    def __init__(self, like: torch.Tensor, first: Optional[torch.Tensor] = None):
        self.like = like
        self.buffers = [first] if first is not None else []

    def other_than(self, busy: torch.Tensor) -> torch.Tensor:
        for buf in self.buffers:
            if buf is not busy:
                return buf
        buf = torch.empty_like(self.like)
        self.buffers.append(buf)
        return buf


def ring_forward(q, k, v, rc: RingContext, kernel, scale, layer=None, causal=True, out=None, lse=None):
    """Merge this rank's queries q [b, h, s, d] against every ring position's k/v [b, g, s, d]
    into the accumulators (out, lse) -- None to start; the first block must be the causal diagonal
    or a full block. Returns (out, lse): fp32 once two blocks were merged, lse always fp32."""
    if rc.size == 1:  # no ring: one kernel call
        block_out, block_lse = kernel.forward(q, k, v, causal, scale)
        return merge(out, lse, block_out, block_lse, "all")
    kv = torch.stack([k, v])  # [2, b, g, s, d]: one message per step
    outer_bufs, inner_bufs = _Pair(kv, first=kv), _Pair(kv)
    for o in range(rc.outer_size):
        # The next outer block is fetched while this inner ring runs (LoongTrain 4.3).
        outer = rc.outer.send_recv(kv, outer_bufs.other_than(kv), layer, "fwd") if o + 1 < rc.outer_size else None
        cur = kv
        for t in range(rc.inner_size):
            inner = rc.inner.send_recv(cur, inner_bufs.other_than(cur), layer, "fwd") if t + 1 < rc.inner_size else None
            plan = step_plan(rc.ring_index, rc.source(o, t), causal)
            block_out, block_lse = block_forward(q, cur, plan, kernel, scale)
            out, lse = merge(out, lse, block_out, block_lse, "second" if plan == Q_SECOND else "all")
            if inner is not None:
                cur = inner.wait()
        if outer is not None:
            kv = outer.wait()
    return out, lse


def ring_backward(dout, q, k, v, out, lse, rc: RingContext, kernel, scale, layer=None, causal=True, dq=None):
    """Add this rank's dq (fp32 accumulator `dq`) over every ring block; return dK/dV of this
    rank's own k/v block as [2, b, g, s, d] fp32 (accumulated over all ranks' queries).

    A block's dK/dV accumulator travels with it: each holder adds its share and passes it on, so
    after W inner steps it is back where it started, and after every outer step it moves on to
    the next inner ring with the block. Each step computes its block before waiting for the
    accumulator it adds to, so every transfer -- outer ones included -- overlaps a kernel."""
    kv = torch.stack([k, v])
    rows = _Rows(dout, out, lse)
    acc = torch.zeros_like(kv, dtype=torch.float32)  # dK/dV of this rank's own block
    kv_outer, kv_inner = _Pair(kv, first=kv), _Pair(kv)
    acc_outer, acc_inner = _Pair(acc, first=acc), _Pair(acc)
    incoming = None  # the accumulator of the block in hand, on its way here
    for o in range(rc.outer_size):
        outer = rc.outer.send_recv(kv, kv_outer.other_than(kv), layer, "bwd") if o + 1 < rc.outer_size else None
        cur = kv
        for t in range(rc.inner_size):
            inner = rc.inner.send_recv(cur, kv_inner.other_than(cur), layer, "bwd") if t + 1 < rc.inner_size else None
            plan = step_plan(rc.ring_index, rc.source(o, t), causal)
            grads = block_backward(q, cur, rows, plan, kernel, scale, dq)  # before the wait: overlap
            if incoming is not None:
                acc = incoming.wait()
            add_block_grads(acc, plan, grads)
            incoming = rc.inner.send_recv(acc, acc_inner.other_than(acc), layer, "bwd") if rc.inner_size > 1 else None
            if inner is not None:
                cur = inner.wait()
        if rc.outer_size > 1:  # to the next inner ring, which holds this block next outer step
            if incoming is not None:
                acc = incoming.wait()
            incoming = rc.outer.send_recv(acc, acc_outer.other_than(acc), layer, "bwd")
        if outer is not None:
            kv = outer.wait()
    # After the last hop the accumulator in hand is this rank's own block's.
    return incoming.wait() if incoming is not None else acc


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over this segment's keys, plus full attention over the cached keys
    and values of the micro-batch's earlier Seq1F1B segments (`segment`, or None)."""

    @staticmethod
    def forward(ctx, q, k, v, rc, kernel, scale, layer, cached, segment):
        prefix = segment.prefix(layer) if segment is not None else []
        if cached is not None:
            out, lse = cached
        else:
            out, lse = ring_forward(q, k, v, rc, kernel, scale, layer)
            for k_j, v_j in prefix:
                out, lse = ring_forward(q, k_j, v_j, rc, kernel, scale, layer, False, out, lse)
            out = out.to(q.dtype)
        if segment is not None:
            segment.keep(layer, k.detach(), v.detach())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (rc, kernel, scale, layer, segment)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        rc, kernel, scale, layer, segment = ctx.args
        dout = grad_like(dout, out)  # the kernels take dout in out's layout
        if rc.size == 1 and segment is None:  # local attention: the kernel's backward as is
            dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale)
            return dq, dk, dv, None, None, None, None, None, None
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = ring_backward(dout, q, k, v, out, lse, rc, kernel, scale, layer, True, dq)
        if segment is not None:
            for j, (k_j, v_j) in enumerate(segment.prefix(layer)):
                segment.add_grad(layer, j, ring_backward(dout, q, k_j, v_j, out, lse, rc, kernel, scale, layer, False, dq))
            later = segment.take_grad(layer)  # what later segments sent back to this one
            if later is not None:
                dkv = dkv + later
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, rc: RingContext, kernel, scale, layer=None, cached=None, segment=None):
    """(out, lse) of causal attention of this rank's queries over the whole ring's keys (and the
    earlier segments' keys). `cached` = (out, lse) from an earlier forward skips the computation
    (Selective Checkpoint++)."""
    return _RingAttention.apply(q, k, v, rc, kernel, scale, layer, cached, segment)
