"""Seq1F1B schedules as data: per-rank lists of operations in named phases (pure functions).

A unit is (micro-batch m, segment s). Forwards run in order m-major, s-minor; backwards pop the
partially ordered queue of Seq1F1B: FIFO across micro-batches, LIFO across the segments of one
micro-batch (a later segment's backward produces the gradients of the earlier segments' keys and
values, so it must run first). k = 1 is 1F1B; v > 1 model chunks per rank is the interleaved
schedule (1F1B-I / Seq1F1B-I).

Warm-up forwards per rank i (Seq1F1B section 3):
  non-interleaved (Eq. 4):  w_i = P - i - 2 + k                       (k = 1: 1F1B's P - i - 1)
  interleaved     (Eq. 6):  w_i = 2 (P - i - 1) + (v - 1) P + k - 1  (k = 1: 1F1B-I's)
both capped at the number of forwards. Then the steady phase alternates one forward and one
backward; the cool-down runs the remaining backwards.

The interleaved schedule runs units in groups of G per chunk: G units on chunk 0, the same G on
chunk 1, ... (G = P by default; Megatron's --microbatch-group-size-per-virtual-pipeline-stage sets
it, in micro-batches: G = that x k). Eq. 6 (G = P) counts the forwards before the first backward
unit (0, k-1) reaches the last chunk when it lies in the first group (k <= G). For k > G it lies in
group (k-1) // G, and the count becomes
  w_i = 2 (P - i - 1) + ((k-1) // G) G v + (v - 1) G + (k - 1) mod G,
which is Eq. 6 for G = P and k <= P. Groups must hold whole micro-batches or whole multiples of
them, so k must divide G or G divide k: otherwise a group's backward order (LIFO within a
micro-batch) asks for a segment its forward group has not run, and the schedule deadlocks (see the
simulator). G < P is refused: the simulator finds deadlocks there (P = 4, v = 2, G = 2, say).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

Unit = Tuple[int, int]  # (micro-batch, segment)


@dataclass(frozen=True)
class Op:
    kind: str  # "F" or "B"
    chunk: int  # model chunk on this rank (virtual stage = chunk * P + rank)
    unit: Unit

    def __str__(self):
        return f"{self.kind}{self.chunk}:{self.unit[0]}.{self.unit[1]}"


@dataclass
class Phase:
    name: str
    ops: List[Op] = field(default_factory=list)


@dataclass
class RankSchedule:
    rank: int
    phases: List[Phase]

    @property
    def ops(self) -> List[Op]:
        return [op for phase in self.phases for op in phase.ops]


class ScheduleError(ValueError):
    """A (P, m, k, v) combination the schedule cannot run; the message has the numbers."""


def forward_units(m: int, k: int) -> List[Unit]:
    return [(mb, s) for mb in range(m) for s in range(k)]


def backward_units(m: int, k: int) -> List[Unit]:
    """The partially ordered queue: FIFO over micro-batches, LIFO over segments."""
    return [(mb, s) for mb in range(m) for s in reversed(range(k))]


def warmup_count(p: int, rank: int, k: int, v: int, total: int, group: Optional[int] = None) -> int:
    g = p if group is None else group
    if v == 1:
        w = p - rank - 2 + k  # Eq. 4
    else:  # Eq. 6, with the group size G and the first backward unit's group (module docstring)
        w = 2 * (p - rank - 1) + ((k - 1) // g) * g * v + (v - 1) * g + (k - 1) % g
    return min(w, total)


def check(p: int, m: int, k: int, v: int, group: Optional[int] = None) -> None:
    g = p if group is None else group
    if min(p, m, k, v) < 1:
        raise ScheduleError(f"pipeline size {p}, micro-batches {m}, splits {k}, chunks {v} must be >= 1")
    what = f"the pipeline size {p}" if group is None else f"{g} units"
    if v > 1 and g < p:
        raise ScheduleError(f"the interleaved schedule's groups of {g} units must be at least the pipeline size {p}")
    if v > 1 and (m * k) % g:
        raise ScheduleError(
            f"the interleaved schedule runs the {m} micro-batches x {k} segments = {m * k} units in "
            f"groups of {what}: {m * k} is not divisible by {g}")
    if v > 1 and g % k and k % g:
        raise ScheduleError(
            f"the interleaved schedule needs the sequence splits {k} to divide {what} "
            f"or {what} to divide the splits (micro-batches must fill whole groups)")


def _interleaved_op(kind: str, index: int, g: int, v: int, order: List[Unit]) -> Op:
    """The index-th forward (or backward) of a rank: G units on chunk 0, the same G on chunk 1, ...
    (backwards walk the chunks from the last)."""
    group, within = divmod(index, g * v)
    chunk = (within // g) if kind == "F" else v - 1 - (within // g)
    return Op(kind, chunk, order[group * g + within % g])


def rank_schedule(p: int, rank: int, m: int, k: int, v: int = 1, group: Optional[int] = None) -> RankSchedule:
    """`group`: units per interleaved group (default: the pipeline size)."""
    check(p, m, k, v, group)
    fwd, bwd, g = forward_units(m, k), backward_units(m, k), p if group is None else group
    total = m * k * v
    w = warmup_count(p, rank, k, v, total, group)

    def f(i):
        return _interleaved_op("F", i, g, v, fwd) if v > 1 else Op("F", 0, fwd[i])

    def b(i):
        return _interleaved_op("B", i, g, v, bwd) if v > 1 else Op("B", 0, bwd[i])

    warm = Phase("warm-up", [f(i) for i in range(w)])
    steady = Phase("steady", [op for j in range(total - w) for op in (f(w + j), b(j))])
    cool = Phase("cool-down", [b(total - w + j) for j in range(w)])
    return RankSchedule(rank, [warm, steady, cool])


def all_schedules(p: int, m: int, k: int, v: int = 1, group: Optional[int] = None) -> List[RankSchedule]:
    check(p, m, k, v, group)
    return [rank_schedule(p, r, m, k, v, group) for r in range(p)]
