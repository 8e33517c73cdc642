"""Attention communication: the Ulysses all-to-all (autograd) and ring P2P, all on explicit groups
and all recorded in the ledger."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.longseq.attention.ledger import LEDGER


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _backend(group):
    """torch.distributed, or the group itself where it is a loopback group (loopback.py: every
    rank of a group on one device), which takes the same calls."""
    return group if getattr(group, "loopback", False) else dist


# ---- Ulysses SeqAlltoAll ---------------------------------------------------------------------

def _pieces(flat: torch.Tensor, s: int, b: int, d: int, head_counts: List[int]):
    """A flat all-to-all buffer as its hp pieces: (first head, heads, view [s, b, h_i, d]) each."""
    start = offset = 0
    for n in head_counts:
        yield start, n, flat[offset : offset + s * b * n * d].view(s, b, n, d)
        start, offset = start + n, offset + s * b * n * d


def _scatter_heads_gather_seq(x, group, head_counts: List[int], my_rank: int):
    """[s, b, H, d] (all heads, this rank's sequence shard) -> [hp*s, b, H_me, d] (the shards of
    every hp rank in rank order = the gathered sequence, this rank's heads). One copy: packing
    each destination's heads; the received buffer is the result."""
    s, b, _, d = x.shape
    send = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    for start, n, piece in _pieces(send, s, b, d, head_counts):  # destination i's heads
        piece.copy_(x[:, :, start : start + n])
    mine = head_counts[my_rank]
    recv = torch.empty(len(head_counts) * s * b * mine * d, dtype=x.dtype, device=x.device)
    _backend(group).all_to_all_single(recv, send, [s * b * mine * d] * len(head_counts),
                                      [s * b * n * d for n in head_counts], group=group)
    return recv.view(len(head_counts) * s, b, mine, d)  # sources in rank order = sequence order


def _scatter_seq_gather_heads(x, group, head_counts: List[int], my_rank: int):
    """[hp*s, b, H_me, d] -> [s, b, H, d]: the inverse of _scatter_heads_gather_seq. One copy:
    placing each source's heads (the send buffer is x itself when it is contiguous, as the ring's
    output, laid out like q, is)."""
    hp = len(head_counts)
    S, b, mine, d = x.shape
    s = S // hp
    send = x.contiguous().view(-1)  # sequence is the outer dim: destination i gets rows i*s..
    recv = torch.empty(s * b * sum(head_counts) * d, dtype=x.dtype, device=x.device)
    _backend(group).all_to_all_single(recv, send, [s * b * n * d for n in head_counts],
                                      [s * b * mine * d] * hp, group=group)
    out = torch.empty(s, b, sum(head_counts), d, dtype=x.dtype, device=x.device)
    for start, n, piece in _pieces(recv, s, b, d, head_counts):  # source i's heads
        out[:, :, start : start + n].copy_(piece)
    return out


class _SeqAllToAll(torch.autograd.Function):
    """to_heads=True: sequence-sharded -> head-sharded (before attention); False: back. The
    backward of one direction is the other."""

    @staticmethod
    def forward(ctx, x, group, head_counts, my_rank, to_heads, layer):
        ctx.args = (group, head_counts, my_rank, to_heads, layer)
        LEDGER.record(layer, "fwd", "all_to_all", "hp", _nbytes(x))
        fn = _scatter_heads_gather_seq if to_heads else _scatter_seq_gather_heads
        return fn(x, group, head_counts, my_rank)

    @staticmethod
    def backward(ctx, grad):
        group, head_counts, my_rank, to_heads, layer = ctx.args
        LEDGER.record(layer, "bwd", "all_to_all", "hp", _nbytes(grad))
        fn = _scatter_seq_gather_heads if to_heads else _scatter_heads_gather_seq
        return fn(grad, group, head_counts, my_rank), None, None, None, None, None


def seq_all_to_all(x, group, head_counts, my_rank, to_heads: bool, layer=None):
    """Ulysses' SeqAlltoAll over the head-parallel group. Identity for one rank."""
    if len(head_counts) == 1:
        return x
    return _SeqAllToAll.apply(x, group, list(head_counts), my_rank, to_heads, layer)


# ---- ring P2P --------------------------------------------------------------------------------

@dataclass
class RingComm:
    """Send to members of a ring, receive from members (async), in batches."""

    group: object
    members: List[int]  # global ranks in ring order
    index: int  # this rank's position
    axis: str  # "inner" or "outer", for the ledger
    connected: bool = False

    @property
    def size(self) -> int:
        return len(self.members)

    def connect(self, device) -> None:
        """Once, before the first batch: a collective the whole group takes part in. NCCL makes a
        group's communicator at its first call, and a batch of P2P ops may be that call only if
        every member is in it -- a ring that skips transfers (route.py) leaves some out."""
        if not self.connected:
            _backend(self.group).all_reduce(torch.zeros(1, device=device), group=self.group)
            self.connected = True

    def peer(self, offset: int) -> int:
        """The global rank `offset` places along the ring (+1: the next member, -1: the previous)."""
        return self.members[(self.index + offset) % self.size]

    def exchange(self, sends, recvs, layer, phase: str):
        """Start the sends [(tensor, offset)] and the receives into [(buffer, offset)] (buffers the
        caller reuses) as one batch; returns a _Pending, or None when both lists are empty. Every
        member posts the matching half of each pair in the same step, so batches pair up (NCCL
        runs each as one group)."""
        if not sends and not recvs:
            return None
        for t, _ in sends:
            LEDGER.record(layer, phase, "p2p", self.axis, _nbytes(t))
        requests = _start_batch(self.group, [(t, self.peer(off)) for t, off in sends],
                                [(buf, self.peer(off)) for buf, off in recvs])
        return _Pending(requests, [buf for buf, _ in recvs], [t for t, _ in sends])


def _start_batch(group, sends, recvs) -> list:
    """Sends [(tensor, global rank)] and receives [(buffer, global rank)] as one batch; its
    requests (a loopback group's own, which P2POp would refuse: it is no registered group)."""
    if getattr(group, "loopback", False):
        return group.batch(sends, recvs)
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for buf, peer in recvs]
    return dist.batch_isend_irecv(ops)


class _Pending:
    def __init__(self, requests, received: List[torch.Tensor], sent: List[torch.Tensor]):
        self.requests, self.received, self.sent = requests, received, sent  # keep `sent` alive until done

    def wait(self) -> Optional[torch.Tensor]:
        """Wait for every send and receive of the batch; the first receive buffer (None: none)."""
        for r in self.requests:
            r.wait()
        return self.received[0] if self.received else None
