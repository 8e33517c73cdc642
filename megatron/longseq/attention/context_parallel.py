"""This rank's context-parallel layout, handed to every core attention through the layer spec."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron.longseq.attention.comm import RingComm
from megatron.longseq.attention.ring import LOCAL, RingContext

MODES = {"p2p": "ring", "a2a": "ulysses", "a2a+p2p": "2d"}


@dataclass
class ContextParallel:
    hp_group: object
    hp_size: int
    hp_index: int
    ring: RingContext
    # Seq1F1B segment lengths of a whole sample (None: one segment); packed documents are placed
    # segment by segment, so the attention needs them to find every rank's tokens
    segment_lengths: Optional[Sequence[int]] = None

    @property
    def size(self) -> int:
        return self.hp_size * self.ring.size

    @classmethod
    def local(cls, segment_lengths: Optional[Sequence[int]] = None) -> "ContextParallel":
        return cls(None, 1, 0, LOCAL, segment_lengths)

    @classmethod
    def from_process_groups(cls, pgs, segment_lengths: Optional[Sequence[int]] = None) -> "ContextParallel":
        grid = pgs.grid
        if grid.cp == 1:
            return cls.local(segment_lengths)
        inner = RingComm(pgs.inner, pgs.members["inner"], pgs.index("inner"), "inner") if grid.inner > 1 else None
        outer = RingComm(pgs.outer, pgs.members["outer"], pgs.index("outer"), "outer") if grid.outer > 1 else None
        ring = RingContext(inner, outer, pgs.index("ring"), grid.inner, grid.outer)
        return cls(pgs.hp, grid.hp, pgs.index("hp"), ring, segment_lengths)
