"""Point-to-point between pipeline stages, in the order the schedules fix.

Every (purpose, sender, receiver) link has its own two-rank group, so a group carries one kind of
message in one direction. Sends are asynchronous and never block; a receiver takes a link's
messages in exactly the order the sender's schedule sends them (computed from that schedule),
keeping early arrivals until their operation runs. The shapes come from the segment lengths, known
on both sides. This is deadlock-free whenever the schedules' dependencies are (simulate.py), on
gloo and NCCL alike.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.pipeline.plan import Op

Key = Tuple[int, int, int]  # (receiver's chunk, micro-batch, segment)


def sent_messages(sender_ops: List[Op], p: int, sender: int, v: int, purpose: str) -> List[Key]:
    """The messages a rank sends on its `purpose` link, in order: a forward that is not the
    last virtual stage sends activations on; a backward that is not the first sends gradients
    back. Keyed by the receiving chunk and the unit."""
    last = p * v - 1
    out = []
    for op in sender_ops:
        vs = op.chunk * p + sender
        if purpose == "act" and op.kind == "F" and vs < last:
            out.append(((vs + 1) // p, *op.unit))
        elif purpose == "grad" and op.kind == "B" and vs > 0:
            out.append(((vs - 1) // p, *op.unit))
    return out


class Inbox:
    """The receiving end of one link."""

    def __init__(self, group, src: int, expected: Iterator[Key], shape_of, dtype, device):
        self.group, self.src, self.expected = group, src, expected
        self.shape_of, self.dtype, self.device = shape_of, dtype, device
        self.early: Dict[Key, torch.Tensor] = {}

    def get(self, key: Key) -> torch.Tensor:
        while key not in self.early:
            nxt = next(self.expected)
            buf = torch.empty(self.shape_of(nxt), dtype=self.dtype, device=self.device)
            dist.recv(buf, src=self.src, group=self.group)
            self.early[nxt] = buf
        return self.early.pop(key)


class Outbox:
    """The sending end of one link: asynchronous sends, kept alive until done."""

    def __init__(self, group, dst: int, purpose: str):
        self.group, self.dst, self.purpose = group, dst, purpose
        self.pending: List[Tuple[torch.Tensor, object]] = []

    def send(self, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        LEDGER.record(None, "pp", "p2p", self.purpose, tensor.numel() * tensor.element_size())
        self.pending.append((tensor, dist.isend(tensor, dst=self.dst, group=self.group)))
        if len(self.pending) > 64:  # drop finished sends now and then
            self.pending = [(t, w) for t, w in self.pending if not w.is_completed()]

    def flush(self) -> None:
        for _, work in self.pending:
            work.wait()
        self.pending = []
