"""Run schedules against their data dependencies (pure): deadlock check, timeline, bubbles, memory.

An operation may start when its inputs exist: a forward needs the previous virtual stage's forward
of the same unit; a backward needs its own forward, the next virtual stage's backward of the unit,
and the backward of the next segment of the same micro-batch (it delivers this segment's KV
gradients). Every rank runs its list in order, as the executor does; sends never block (messages
wait in the receiver's channel). If no rank can move, the schedule deadlocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

from megatron.longseq.pipeline.plan import Op, Phase, RankSchedule


Unit = Tuple[int, int]  # (micro-batch, segment)


class Deadlock(RuntimeError):
    pass


@dataclass
class Event:
    rank: int
    op: Op
    start: float
    end: float


@dataclass
class Timeline:
    p: int
    events: List[Event] = field(default_factory=list)
    peak_activation: List[float] = field(default_factory=list)  # per rank, in activation units

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events)

    @property
    def bubble_ratio(self) -> float:
        busy = sum(e.end - e.start for e in self.events)
        return 1.0 - busy / (self.p * self.makespan)


def dependencies(op: Op, rank: int, p: int, v: int, k: int) -> List[Tuple[str, int, Tuple[int, int]]]:
    vs, last = op.chunk * p + rank, p * v - 1
    m, s = op.unit
    if op.kind == "F":
        deps = [("F", vs - 1, op.unit)] if vs > 0 else []
        return deps + ([("F", vs, (m, s - 1))] if s > 0 else [])
    deps = [("F", vs, op.unit)]
    if vs < last:
        deps.append(("B", vs + 1, op.unit))
    if s < k - 1:
        deps.append(("B", vs, (m, s + 1)))
    return deps


def simulate(schedules: Sequence[RankSchedule], v: int, k: int,
             forward_cost: Callable[[Unit], float] = lambda unit: 1.0,
             backward_cost: Callable[[Unit], float] = None,
             activation: Callable[[Unit], float] = lambda unit: 1.0,
             latency: float = 0.0) -> Timeline:
    """forward_cost(unit), backward_cost(unit) (default 2x forward), activation(unit): the memory
    a unit holds from its forward to its backward; unit = (micro-batch, segment), as packed
    documents give every micro-batch its own segments."""
    backward_cost = backward_cost or (lambda unit: 2.0 * forward_cost(unit))
    p = len(schedules)
    ops = [sched.ops for sched in schedules]
    done: Dict[tuple, float] = {}
    nxt, free = [0] * p, [0.0] * p
    live, peak = [0.0] * p, [0.0] * p
    timeline = Timeline(p)
    while any(nxt[r] < len(ops[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(ops[r]):
                op = ops[r][nxt[r]]
                deps = dependencies(op, r, p, v, k)
                if any(d not in done for d in deps):
                    break
                # a dependency on another virtual stage is a message: add the link latency
                ready = max([free[r]] + [done[d] + (latency if d[1] != op.chunk * p + r else 0.0) for d in deps])
                cost = forward_cost(op.unit) if op.kind == "F" else backward_cost(op.unit)
                timeline.events.append(Event(r, op, ready, ready + cost))
                done[(op.kind, op.chunk * p + r, op.unit)] = ready + cost
                free[r] = ready + cost
                live[r] += activation(op.unit) * (1 if op.kind == "F" else -1)
                peak[r] = max(peak[r], live[r])
                nxt[r] += 1
                moved = True
        if not moved:
            blocked = {r: str(ops[r][nxt[r]]) for r in range(p) if nxt[r] < len(ops[r])}
            raise Deadlock(f"no rank can proceed; next operations: {blocked}")
    timeline.peak_activation = peak
    return timeline


def prefix_needs(ops: Sequence[List[Op]], v: int, k: int, of: int) -> List[List[int]]:
    """needs[r][j]: how many of rank `of`'s operations (a prefix of its list) must have run before
    rank r's j-th operation can end -- the transitive closure of the dependencies, every rank
    running its list in order. Pure; `ops` are every rank's lists (forwards only for an evaluation)."""
    p = len(ops)
    index = {(op.kind, op.chunk * p + r, op.unit): (r, j) for r in range(p) for j, op in enumerate(ops[r])}
    needs = [[0] * len(row) for row in ops]
    runs = simulate([RankSchedule(r, [Phase("all", list(row))]) for r, row in enumerate(ops)], v, k)
    for event in runs.events:  # in an order in which every dependency comes first
        r, j = index[(event.op.kind, event.op.chunk * p + event.rank, event.op.unit)]
        inputs = [needs[q][i] for q, i in (index[d] for d in dependencies(event.op, r, p, v, k))]
        in_order = j + 1 if r == of else (needs[r][j - 1] if j else 0)  # a rank's list runs in order
        needs[r][j] = max([in_order] + inputs)
    return needs
