"""Point-to-point between pipeline stages, in the order the schedules fix.

Every (purpose, sender, receiver) link has its own two-rank group, so a group carries one kind of
message in one direction. Sends are asynchronous and never block; a receiver takes a link's
messages in exactly the order the sender's schedule sends them (computed from that schedule), the
next one's receive posted ahead as soon as that is safe (Inbox), keeping early arrivals until their
operation runs. The shapes come from the segment lengths, known on both sides. This is deadlock-
free whenever the schedules' dependencies are (simulate.py), on gloo and NCCL alike (connect_links
sets up NCCL's pairs first), and a device-wide synchronize on one rank cannot hang it (Inbox) --
on NCCL for interleaved groups of the pipeline's size only: with larger ones a send queued behind an
unmatched send of its link can close a cycle (validate refuses them there). A model of NCCL's
queues run on this issue order checks both claims (tests/unit_tests/pipeline/test_nccl_queues.py).
Not covered: two adjacent stages synchronizing their devices in overlapping windows (both caching
allocators retrying a failed allocation at once, say) can each wait for a posted receive whose send
the other has yet to issue; the same model finds such a pair in each schedule tried (1F1B, Seq1F1B
and interleaved, 2-4 stages). Only sends and receives paired and waited on where they are issued
(Megatron's non-overlapped 1F1B) exclude it, at the cost of every transfer's latency on the
critical path.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.pipeline.plan import Op

Key = Tuple[int, int, int]  # (receiver's chunk, micro-batch, segment)


def sent_messages(sender_ops: List[Op], p: int, sender: int, v: int, purpose: str) -> List[Tuple[Key, int]]:
    """The messages a rank sends on its `purpose` link, in order, each with the index of the
    operation that sends it: a forward that is not the last virtual stage sends activations on; a
    backward that is not the first sends gradients back. Keyed by the receiving chunk and the unit."""
    last = p * v - 1
    out = []
    for j, op in enumerate(sender_ops):
        vs = op.chunk * p + sender
        if purpose == "act" and op.kind == "F" and vs < last:
            out.append((((vs + 1) // p, *op.unit), j))
        elif purpose == "grad" and op.kind == "B" and vs > 0:
            out.append((((vs - 1) // p, *op.unit), j))
    return out


def receive_points(sender_ops: List[Op], needs: List[int], p: int, sender: int, v: int, purpose: str
                   ) -> List[Tuple[Key, int]]:
    """The messages of one link, in order, each with the first of the receiver's operations from
    which its receive may be posted: the one after every operation of the receiver that its send
    depends on. needs[j]: how many of the receiver's operations the sender's j-th one needs
    (simulate.prefix_needs)."""
    return [(key, needs[j]) for key, j in sent_messages(sender_ops, p, sender, v, purpose)]


class Inbox:
    """The receiving end of one link. The receive of the next message is posted ahead, so that it
    lands while this rank computes, but never before the operation its receive point names (see
    receive_points); get() waits for the posted one(s) until the wanted key has arrived, keeping
    early arrivals.

    Why not earlier: on NCCL a posted receive sits on the link's stream until its send comes. Were
    that send to need a later operation of this rank, a device-wide synchronize in between would
    wait for the receive, the receive for this rank, and the pipeline would hang. Such a synchronize
    needs no one's consent: the caching allocator frees its cache (cudaFree) when an allocation
    fails, and so do empty_cache() and torch.cuda.synchronize()."""

    def __init__(self, group, src: int, expected: Iterator[Tuple[Key, int]], shape_of, dtype, device):
        self.group, self.src, self.expected = group, src, expected
        self.shape_of, self.dtype, self.device = shape_of, dtype, device
        self.early: Dict[Key, torch.Tensor] = {}
        self.posted: Optional[Tuple[Key, torch.Tensor, object]] = None
        self.upcoming: Optional[Tuple[Key, int]] = next(self.expected, None)
        self.now = 0  # the operation this rank runs next
        self._post()

    def advance(self, op_index: int) -> None:
        """This rank is about to run its op_index-th operation."""
        self.now = op_index
        self._post()

    def _post(self) -> None:
        if self.posted is not None or self.upcoming is None or self.upcoming[1] > self.now:
            return
        key = self.upcoming[0]
        buf = torch.empty(self.shape_of(key), dtype=self.dtype, device=self.device)
        self.posted = (key, buf, dist.irecv(buf, src=self.src, group=self.group))
        self.upcoming = next(self.expected, None)

    def get(self, key: Key) -> torch.Tensor:
        while key not in self.early:
            if self.posted is None:
                raise RuntimeError(f"pipeline: {key} is not among the messages stage {self.src} sends by now")
            arrived, buf, work = self.posted
            work.wait()
            self.early[arrived], self.posted = buf, None
            self._post()
        return self.early.pop(key)


def connect_links(links: Dict[tuple, object], me: int, device) -> None:
    """One message over every link of this rank, all ranks in one global order (sorted keys).
    NCCL creates a pair's communicator at its first operation and blocks there until both ends
    take part: a receive posted ahead must never be that first operation, or two stages could each
    sit in the set-up of a different link, waiting for the other."""
    token = torch.zeros(1, device=device)
    for (_, src, dst), group in sorted(links.items()):
        if me == src:
            dist.send(token, dst, group=group)
        elif me == dst:
            dist.recv(token, src, group=group)


class Outbox:
    """The sending end of one link: asynchronous sends, each tensor kept alive until its send is done
    (NCCL gives point-to-point buffers only record_stream, which a pluggable allocator never sees),
    and let go at the next send after that: an activation held to the end of the iteration would
    outlive its backward, one [segment tokens, b, h] per micro-batch."""

    def __init__(self, group, dst: int, purpose: str):
        self.group, self.dst, self.purpose = group, dst, purpose
        self.pending: List[Tuple[torch.Tensor, object]] = []

    def send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        LEDGER.record(None, "pp", "p2p", self.purpose, tensor.numel() * tensor.element_size())
        self.pending = [(t, w) for t, w in self.pending if not w.is_completed()]  # a query: no wait
        self.pending.append((tensor, dist.isend(tensor, dst=self.dst, group=self.group)))

    def flush(self) -> None:
        for _, work in self.pending:
            work.wait()
        self.pending = []
