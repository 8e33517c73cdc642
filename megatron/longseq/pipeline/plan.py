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

The interleaved schedule runs units in groups of P per chunk. Eq. 6 counts the forwards before
the first backward unit (0, k-1) reaches the last chunk when it lies in the first group (k <= P).
For k > P it lies in group (k-1) // P, and the count becomes
  w_i = 2 (P - i - 1) + ((k-1) // P) P v + (v - 1) P + (k - 1) mod P,
which is Eq. 6 for k <= P. Groups must hold whole micro-batches or whole multiples of them, so
k must divide P or P divide k: otherwise a group's backward order (LIFO within a micro-batch)
asks for a segment its forward group has not run, and the schedule deadlocks (see the simulator).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

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


def warmup_count(p: int, rank: int, k: int, v: int, total: int) -> int:
    if v == 1:
        w = p - rank - 2 + k  # Eq. 4
    else:  # Eq. 6, with the first backward unit's group for k > P (module docstring)
        w = 2 * (p - rank - 1) + ((k - 1) // p) * p * v + (v - 1) * p + (k - 1) % p
    return min(w, total)


def check(p: int, m: int, k: int, v: int) -> None:
    if min(p, m, k, v) < 1:
        raise ScheduleError(f"pipeline size {p}, micro-batches {m}, splits {k}, chunks {v} must be >= 1")
    if v > 1 and (m * k) % p:
        raise ScheduleError(
            f"the interleaved schedule runs the {m} micro-batches x {k} segments = {m * k} units in "
            f"groups of the pipeline size {p}: {m * k} is not divisible by {p}")
    if v > 1 and p % k and k % p:
        raise ScheduleError(
            f"the interleaved schedule needs the sequence splits {k} to divide the pipeline size {p} "
            f"or the pipeline size to divide the splits (micro-batches must fill whole groups)")


def _interleaved_op(kind: str, index: int, p: int, v: int, order: List[Unit]) -> Op:
    """The index-th forward (or backward) of a rank: P units on chunk 0, the same P on chunk 1, ...
    (backwards walk the chunks from the last)."""
    group, within = divmod(index, p * v)
    chunk = (within // p) if kind == "F" else v - 1 - (within // p)
    return Op(kind, chunk, order[group * p + within % p])


def rank_schedule(p: int, rank: int, m: int, k: int, v: int = 1) -> RankSchedule:
    check(p, m, k, v)
    fwd, bwd = forward_units(m, k), backward_units(m, k)
    total = m * k * v
    w = warmup_count(p, rank, k, v, total)

    def f(i):
        return _interleaved_op("F", i, p, v, fwd) if v > 1 else Op("F", 0, fwd[i])

    def b(i):
        return _interleaved_op("B", i, p, v, bwd) if v > 1 else Op("B", 0, bwd[i])

    warm = Phase("warm-up", [f(i) for i in range(w)])
    steady = Phase("steady", [op for j in range(total - w) for op in (f(w + j), b(j))])
    cool = Phase("cool-down", [b(total - w + j) for j in range(w)])
    return RankSchedule(rank, [warm, steady, cool])


def all_schedules(p: int, m: int, k: int, v: int = 1) -> List[RankSchedule]:
    check(p, m, k, v)
    return [rank_schedule(p, r, m, k, v) for r in range(p)]
