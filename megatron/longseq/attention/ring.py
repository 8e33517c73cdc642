"""Causal ring attention with Megatron's load balance, as Double-Ring-Attention (LoongTrain §4.3).

Ring position j holds queries and KV of chunks (j, 2R-1-j) (placement.py). The R positions form
O = R/W inner rings of W; at outer step o, inner step t, position j = W*i + p holds the KV block of
position src = W*((i - o) mod O) + (p - t) mod W. With W = R this is the plain ring (O = 1); with
R = 1 it is local causal attention: one path for every degree.

Against a block from src, by position order of the chunks (all blocks are full except the diagonal):
  src == j : causal over [chunk j ; chunk 2R-1-j] (the local sequence is in position order)
  src <  j : all queries see only the block's first chunk (src), fully
  src >  j : only the second query chunk (2R-1-j) sees the block, fully
Each case is a list of pieces (query rows x key rows, causal or full: documents.Piece), so packed
documents take the same path: their blocks split into one piece per document met on both sides
(DocumentLayout), and a block with none is skipped. Partial (out, lse) are merged in fp32.
Backward runs the kernel backward per block with the final out/lse; dK/dV accumulators (fp32)
travel with their KV block and return to its owner. Which transfers happen is route.py's: all of
them on the plain ring; with documents a block goes no further than its last reader.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Optional

import torch

from megatron.longseq.attention import varlen
from megatron.longseq.attention.comm import RingComm
from megatron.longseq.attention.documents import Piece
from megatron.longseq.attention.kernels import AttentionKernel, grad_like
from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.attention.route import Route
from megatron.longseq.random import saved_tensors_dropped

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

    @cached_property
    def plain_route(self) -> Route:
        """Every transfer of the double ring (the route without documents), made once."""
        return Route(self)

    def connect(self, device) -> None:
        """Every ring call starts here, on every member alike (RingComm.connect)."""
        for comm in (self.inner, self.outer):
            if comm is not None:
                comm.connect(device)

    def source(self, o: int, t: int) -> int:
        i, p = divmod(self.ring_index, self.inner_size)
        return self.inner_size * ((i - o) % self.outer_size) + (p - t) % self.inner_size


LOCAL = RingContext(None, None, 0, 1, 1)


# ---- one block ----------------------------------------------------------------------------------

def plain_blocks(sq: int, sk: int, causal: bool = True) -> Callable[[int, int], List[Piece]]:
    """Pieces of every block without packed documents (Megatron's chunk placement), by step_plan:
    the diagonal causal, an earlier block's first chunk, a later block for the second query chunk;
    a Seq1F1B prefix block (not causal) in full."""
    hq, hk = sq // 2, sk // 2
    plans = {CAUSAL: [Piece(0, sq, 0, sk, True)], FULL: [Piece(0, sq, 0, sk, False)],
             KV_FIRST: [Piece(0, sq, 0, hk, False)], Q_SECOND: [Piece(hq, sq, 0, sk, False)]}
    return lambda j, src: plans[step_plan(j, src, causal)]


def _batch(p: Piece) -> slice:
    return slice(None) if p.sample is None else slice(p.sample, p.sample + 1)


def _piece_inputs(q, kv, p: Piece):
    """Views of the piece's queries [b', h, q1-q0, d] and keys and values [b', g, k1-k0, d]."""
    b = _batch(p)
    return q[b, :, p.q0 : p.q1], kv[0][b, :, p.k0 : p.k1], kv[1][b, :, p.k0 : p.k1]


def _covers(p: Piece, q) -> bool:
    """Whether the piece's rows are all of q's: of every sample, or of the only one."""
    return (p.sample is None or q.shape[0] == 1) and (p.q0, p.q1) == (0, q.shape[2])


def _first_block(q, kv, pieces, kernel: AttentionKernel, scale):
    """(out, lse) of the diagonal block, the first of a ring: its pieces cover every query row
    once (every token sees itself), one kernel call without documents, one per document with."""
    if len(pieces) == 1 and _covers(pieces[0], q):
        return kernel.forward(*_piece_inputs(q, kv, pieces[0]), pieces[0].causal, scale)
    if sum(p.q1 - p.q0 for p in pieces) != q.shape[2] * (1 if pieces[0].sample is None else q.shape[0]):
        raise ValueError("the first block of a ring must cover every query row once")
    if varlen.uses_varlen(kernel, pieces):
        return varlen.first_block(q, kv, _plan(q, kv, pieces), kernel, scale)
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    for p in pieces:
        out[_batch(p), :, p.q0 : p.q1], lse[_batch(p), :, p.q0 : p.q1] = kernel.forward(
            *_piece_inputs(q, kv, p), p.causal, scale)
    return out, lse


def block_forward(q, kv, pieces: List[Piece], kernel: AttentionKernel, scale, out=None, lse=None):
    """Merge the block's pieces into the accumulators (out, lse): None to start, when the block
    must be the diagonal one. A block without pieces is skipped: no kernel call."""
    if out is None:
        return _first_block(q, kv, pieces, kernel, scale)
    if varlen.uses_varlen(kernel, pieces):
        return varlen.block_forward(q, kv, _plan(q, kv, pieces), kernel, scale, out, lse)
    for p in pieces:
        block_out, block_lse = kernel.forward(*_piece_inputs(q, kv, p), p.causal, scale)
        out, lse = merge(out, lse, block_out, block_lse, p)
    return out, lse


def _plan(q, kv, pieces):
    return varlen.plan(pieces, q.shape[0], q.shape[2], kv[0].shape[2], q.device)


def merge(out, lse, block_out, block_lse, piece: Piece):
    """Online-softmax merge into the fp32 accumulators, in place, over the piece's query rows.

    With d = block_lse - lse: the new lse is lse + softplus(d) and the rows merged so far keep the
    weight exp(lse - new lse) = sigmoid(-d), so out = block + (out - block) * sigmoid(-d). Two
    lse-sized temporaries and three in-place passes over out; binary in-place ops cast a bf16
    block on the fly, so no fp32 copy of it is made."""
    if out.dtype != torch.float32:  # a second block: from here on accumulate in fp32
        out = out.float()
    b = _batch(piece)
    o_rows, l_rows = out[b, :, piece.q0 : piece.q1], lse[b, :, piece.q0 : piece.q1]
    d = block_lse - l_rows  # [b', h, s']
    l_rows += torch.nn.functional.softplus(d)
    old_weight = d.neg_().sigmoid_().unsqueeze(-1)  # [b', h, s', 1]
    o_rows.sub_(block_out).mul_(old_weight).add_(block_out)
    return out, lse


class _Rows:
    """What a piece's backward reads of the query side: (dout, out, lse) of its rows. Kernels
    read lse through a raw pointer as a contiguous [b, h, s] tensor, and a slice of its last dim
    is not one, so a piece's lse rows are copied -- once per backward for each distinct rows."""

    def __init__(self, dout, out, lse):
        self.all = (dout, out, lse)
        self._parts: Dict[tuple, tuple] = {}

    def of(self, p: Piece):
        dout, out, lse = self.all
        if _covers(p, out):
            return self.all
        key = (p.sample, p.q0, p.q1)
        if key not in self._parts:
            b = _batch(p)
            self._parts[key] = (dout[b, :, p.q0 : p.q1], out[b, :, p.q0 : p.q1], lse[b, :, p.q0 : p.q1].contiguous())
        return self._parts[key]


def block_backward(q, kv, rows: _Rows, pieces: List[Piece], kernel: AttentionKernel, scale, dq):
    """Add the block's dq into `dq` (fp32, in place); return each piece's (piece, dK, dV) for
    add_block_grads."""
    if varlen.uses_varlen(kernel, pieces):
        return varlen.block_backward(q, kv, *rows.all, _plan(q, kv, pieces), kernel, scale, dq)
    grads = []
    for p in pieces:
        q_p, k_p, v_p = _piece_inputs(q, kv, p)
        dout_p, out_p, lse_p = rows.of(p)
        dq_b, dk_b, dv_b = kernel.backward(dout_p, q_p, k_p, v_p, out_p, lse_p, p.causal, scale)
        dq[_batch(p), :, p.q0 : p.q1] += dq_b
        grads.append((p, dk_b, dv_b))
    return grads


def add_block_grads(acc, grads) -> None:
    """acc [2, b, g, s, d] (fp32) += every piece's (dK, dV) on its key rows, in place (a
    variable-length group's on its rows)."""
    for p, dk, dv in grads:
        if isinstance(p, varlen.Group):
            varlen.add_grads(acc, p, dk, dv)
            continue
        acc[0, _batch(p), :, p.k0 : p.k1] += dk
        acc[1, _batch(p), :, p.k0 : p.k1] += dv


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


Blocks = Callable[[int, int], List[Piece]]  # (query position j, key position src) -> pieces


def _pieces(blocks: Blocks, j: int, src: int, layer, phase: str) -> List[Piece]:
    pieces = blocks(j, src)
    if not pieces:  # no document in common: neither kernel call nor merge (the ledger counts it)
        LEDGER.record(layer, phase, "skip", "block", 0)
    return pieces


def _kv_step(comm, plan, held, bufs: _Pair, layer, phase: str):
    """Start a KV transfer of `plan` = (send the held block, receive the next): the pending
    transfer, or None when neither."""
    send, recv = plan
    if not (send or recv):
        return None
    return comm.exchange([(held, 1)] if send else [], [(bufs.other_than(held), -1)] if recv else [], layer, phase)


def _arrived(pending):
    """The block a KV transfer brought (None: it sent only, or nothing moved)."""
    return pending.wait() if pending is not None else None


def _block_in_hand(cur, pieces):
    if pieces and cur is None:
        raise RuntimeError("ring route: a block this rank's queries need was not sent here")
    return cur


def ring_forward(q, k, v, rc: RingContext, kernel, scale, layer=None, blocks: Optional[Blocks] = None,
                 out=None, lse=None, route: Optional[Route] = None):
    """Merge this rank's queries q [b, h, s, d] against every ring position's k/v [b, g, s, d]
    into the accumulators (out, lse) -- None to start, when the first block must be the diagonal;
    `blocks` gives each block's pieces (default: plain causal), `route` which blocks travel how
    far (default: all the way). Returns (out, lse): fp32 once two pieces were merged, lse fp32."""
    blocks = blocks if blocks is not None else plain_blocks(q.shape[2], k.shape[2])
    if rc.size == 1:  # no ring: the diagonal block only
        return block_forward(q, (k, v), _pieces(blocks, 0, 0, layer, "fwd"), kernel, scale, out, lse)
    route = route if route is not None else rc.plain_route
    rc.connect(q.device)
    kv = torch.stack([k, v])  # [2, b, g, s, d]: one message per step
    outer_bufs, inner_bufs = _Pair(kv, first=kv), _Pair(kv)
    for o in range(rc.outer_size):
        # The next outer block is fetched while this inner ring runs (LoongTrain 4.3).
        outer = _kv_step(rc.outer, route.kv_outer(o), kv, outer_bufs, layer, "fwd")
        cur = kv
        for t in range(rc.inner_size):
            inner = _kv_step(rc.inner, route.kv_inner(o, t), cur, inner_bufs, layer, "fwd")
            pieces = _pieces(blocks, rc.ring_index, rc.source(o, t), layer, "fwd")
            if pieces:
                out, lse = block_forward(q, _block_in_hand(cur, pieces), pieces, kernel, scale, out, lse)
            cur = _arrived(inner)
        kv = _arrived(outer)
    return out, lse


class _Accumulators:
    """The dK/dV accumulators ([2, b, g, s, d] fp32) this rank holds, by block, and a pool of
    buffers for the ones arriving: a buffer goes back to the pool once its send has completed,
    so a call allocates a few, not one per step."""

    def __init__(self, own_block: int, k: torch.Tensor):
        self.held: Dict[int, torch.Tensor] = {
            own_block: torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)}  # [2, b, g, s, d]
        self.like = self.held[own_block]
        self.free: List[torch.Tensor] = []
        self.pending = None  # the last exchange, with the buffers it sent
        self.sent: List[torch.Tensor] = []

    def settle(self) -> None:
        """Wait for the last exchange: what it received is held, what it sent is free again."""
        if self.pending is not None:
            self.pending.wait()
            self.free += self.sent
        self.pending, self.sent = None, []

    def exchange(self, comm, block: int, send: Optional[int], recvs, layer) -> None:
        """Send `block`'s accumulator `send` places along (None: keep it) and receive `recvs`."""
        self.settle()
        sends = [] if send is None else [(self.held.pop(block), send)]
        incoming = []
        for b, offset in recvs:
            self.held[b] = self.free.pop() if self.free else torch.empty_like(self.like)
            incoming.append((self.held[b], offset))
        self.pending = comm.exchange(sends, incoming, layer, "bwd") if sends or incoming else None
        self.sent = [t for t, _ in sends]


def ring_backward(dout, q, k, v, out, lse, rc: RingContext, kernel, scale, layer=None,
                  blocks: Optional[Blocks] = None, dq=None, route: Optional[Route] = None):
    """Add this rank's dq (fp32 accumulator `dq`) over every ring block; return dK/dV of this
    rank's own k/v block as [2, b, g, s, d] fp32 (accumulated over all ranks' queries).

    A block's dK/dV accumulator travels with it: each holder adds its share and passes it on, and
    the last holder that needs the block sends it back (route.py; on the plain ring that is the
    next position, closing the circle), after each outer step on to the next inner ring or home.
    Each step computes its block before waiting for the accumulator it adds to, so every transfer
    -- outer ones included -- overlaps a kernel."""
    blocks = blocks if blocks is not None else plain_blocks(q.shape[2], k.shape[2])
    route = route if route is not None else rc.plain_route
    rc.connect(q.device)
    # [2, b, g, s, d]: one message per step. Without a ring k and v go to the kernel as they came,
    # as in the forward: cuDNN keys its graphs on strides, and a stacked copy would miss them.
    kv = torch.stack([k, v]) if rc.size > 1 else (k, v)
    rows = _Rows(dout, out, lse)
    accs = _Accumulators(rc.ring_index, k)
    kv_outer, kv_inner = _Pair(kv, first=kv), _Pair(kv)
    for o in range(rc.outer_size):
        outer = _kv_step(rc.outer, route.kv_outer(o), kv, kv_outer, layer, "bwd")
        cur = kv
        for t in range(rc.inner_size):
            inner = _kv_step(rc.inner, route.kv_inner(o, t), cur, kv_inner, layer, "bwd")
            block = rc.source(o, t)
            pieces = _pieces(blocks, rc.ring_index, block, layer, "bwd")
            # the block's kernels before waiting for the accumulator: the transfer overlaps them
            grads = block_backward(q, _block_in_hand(cur, pieces), rows, pieces, kernel, scale, dq)
            accs.settle()
            if grads:
                add_block_grads(accs.held[block], grads)
            if rc.inner_size > 1:
                accs.exchange(rc.inner, block, *route.acc_inner(o, t), layer)
            cur = _arrived(inner)
        if rc.outer_size > 1:  # to the next inner ring, which holds this block next outer step, or home
            accs.exchange(rc.outer, rc.source(o, 0), *route.acc_outer(o), layer)
        kv = _arrived(outer)
    accs.settle()
    return accs.held[rc.ring_index]


def _blocks(documents, q, k, q_segment: int, k_segment: int) -> Blocks:
    """The pieces of every block between q_segment's queries and k_segment's keys: by packed
    documents (a DocumentLayout), or plain causal / full."""
    if documents is None:
        return plain_blocks(q.shape[2], k.shape[2], q_segment == k_segment)
    return lambda j, src: documents.pieces(q_segment, k_segment, j, src)


def _route(documents, rc: RingContext, q_segment: int, k_segment: int) -> Optional[Route]:
    """Which blocks travel how far: by where the documents meet (kept with the layout, as every
    layer asks the same), or None for the plain ring."""
    if documents is None or rc.size == 1:
        return None
    key = (q_segment, k_segment, rc.ring_index)  # a layout may serve every position of one process
    if key not in documents.routes:
        documents.routes[key] = Route(rc, documents.meeting(q_segment, k_segment))
    return documents.routes[key]


def _prefix_met(prefix, documents, index: int, rc: RingContext, layer, phase: str):
    """(j, (k_j, v_j)) of the earlier segments this one's documents reach. The others' ring
    passes are skipped whole -- no kernel call and no transfer, on every rank alike -- and
    counted in the ledger as R skipped blocks."""
    for j, kv in enumerate(prefix):
        if documents is None or documents.meet(index, j):
            yield j, kv
        else:
            for _ in range(rc.size):
                LEDGER.record(layer, phase, "skip", "block", 0)


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over this segment's keys, plus full attention over the cached keys
    and values of the micro-batch's earlier Seq1F1B segments (`segment`, or None), within
    documents when `documents` (a DocumentLayout) is given."""

    @staticmethod
    def forward(ctx, q, k, v, rc, kernel, scale, layer, cached, segment, documents):
        index = segment.index if segment is not None else 0
        prefix = segment.prefix(layer) if segment is not None else []
        if cached is not None:
            out, lse = cached
        else:
            out, lse = ring_forward(q, k, v, rc, kernel, scale, layer, _blocks(documents, q, k, index, index),
                                    route=_route(documents, rc, index, index))
            for j, (k_j, v_j) in _prefix_met(prefix, documents, index, rc, layer, "fwd"):
                out, lse = ring_forward(q, k_j, v_j, rc, kernel, scale, layer, _blocks(documents, q, k_j, index, j),
                                        out, lse, _route(documents, rc, index, j))
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (rc, kernel, scale, layer, segment, documents)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        rc, kernel, scale, layer, segment, documents = ctx.args
        dout = grad_like(dout, out)  # the kernels take dout in out's layout
        none = (None,) * 7
        if rc.size == 1 and segment is None and documents is None:  # local attention: the kernel's backward as is
            return (*kernel.backward(dout, q, k, v, out, lse, True, scale), *none)
        index = segment.index if segment is not None else 0
        dq = torch.zeros_like(q, dtype=torch.float32)
        blocks, route = _blocks(documents, q, k, index, index), _route(documents, rc, index, index)
        dkv = ring_backward(dout, q, k, v, out, lse, rc, kernel, scale, layer, blocks, dq, route)
        if segment is not None:
            for j, (k_j, v_j) in _prefix_met(segment.prefix(layer), documents, index, rc, layer, "bwd"):
                blocks, route = _blocks(documents, q, k_j, index, j), _route(documents, rc, index, j)
                segment.add_grad(layer, j, ring_backward(dout, q, k_j, v_j, out, lse, rc, kernel, scale, layer, blocks,
                                                         dq, route))
            later = segment.take_grad(layer)  # what later segments sent back to this one
            if later is not None:
                dkv.add_(later)  # the ring's own new fp32 tensor
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), *none


def ring_attention(q, k, v, rc: RingContext, kernel, scale, layer=None, cached=None, segment=None, documents=None):
    """(out, lse) of causal attention of this rank's queries over the whole ring's keys (and the
    earlier segments' keys), within packed documents when `documents` is given. `cached` =
    (out, lse) from an earlier forward skips the computation (Selective Checkpoint++)."""
    out, lse = _RingAttention.apply(q, k, v, rc, kernel, scale, layer, cached, segment, documents)
    if segment is not None:
        # Under recompute or MEMO nothing else keeps this forward's tensors, and a view -- v is a
        # slice of the fused qkv projection -- would keep its whole storage to the segment's
        # backward. Otherwise the backward keeps k and v anyway: views cost nothing.
        segment.keep(layer, k.detach(), v.detach(), own=saved_tensors_dropped())
    return out, lse
