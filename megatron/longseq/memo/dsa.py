"""Offline dynamic storage allocation (MEMO section 4.2): place every tensor of an allocation trace
at an address so that tensors alive at the same time never overlap, minimising the peak.

    min M  s.t.  A_i + S_i <= M
                 A_i + S_i <= A_j + z_ij M_cap,  A_j + S_j <= A_i + (1 - z_ij) M_cap   (i, j) alive together
Solvers, in order: Gurobi (the paper's MIP; its pip licence stops at 2000 variables or
constraints, error 10010), OR-Tools CP-SAT (address intervals under NoOverlap2D with the fixed
lifetime intervals), then greedy best-fit by size. A plan records which solver ran, its peak, the
lower bound (the most bytes ever alive at once) and whether optimality was proven.

Every offset is a multiple of ALIGN = 512 bytes: sizes are rounded up to it and every solver works
in those units (torch's caching allocator hands out 512-byte-aligned blocks, and cuBLAS and the
attention kernels assume at least 16).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

SOLVERS = ("gurobi", "cpsat", "greedy")
ALIGN = 512


@dataclass(frozen=True)
class Block:
    """A tensor: `size` bytes, alive over trace positions [start, end)."""

    id: str
    size: int
    start: int
    end: int

    def overlaps(self, other: "Block") -> bool:
        return self.start < other.end and other.start < self.end


@dataclass
class Plan:
    solver: str
    peak: int
    lower_bound: int
    offsets: Dict[str, int]
    seconds: float
    optimal: bool
    notes: List[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        return self.peak / self.lower_bound - 1.0 if self.lower_bound else 0.0


def lower_bound(blocks: Sequence[Block]) -> int:
    """The most bytes alive at any position: no placement can use less."""
    events = sorted([(b.start, b.size) for b in blocks] + [(b.end, -b.size) for b in blocks],
                    key=lambda e: (e[0], e[1]))  # frees before allocations at the same position
    live = best = 0
    for _, delta in events:
        live += delta
        best = max(best, live)
    return best


class PlanError(AssertionError):
    """A placement that breaks the plan's contract: overlapping live tensors, or past the peak."""


def check_plan(blocks: Sequence[Block], offsets: Dict[str, int], peak: int) -> None:
    """Raise PlanError if two tensors alive together overlap in memory, or one exceeds the peak."""
    for b in blocks:
        if offsets[b.id] < 0 or offsets[b.id] + b.size > peak:
            raise PlanError(f"{b.id} at {offsets[b.id]} + {b.size} exceeds the peak {peak}")
    ordered = sorted(blocks, key=lambda b: b.start)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b.start >= a.end:
                break
            lo_a, lo_b = offsets[a.id], offsets[b.id]
            if lo_a < lo_b + b.size and lo_b < lo_a + a.size:
                raise PlanError(f"{a.id} and {b.id} are alive together and overlap in memory")


def conflicts(blocks: Sequence[Block]) -> List[Tuple[int, int]]:
    """Index pairs of the blocks alive together (the pairs that need a non-overlap constraint)."""
    ordered = sorted(range(len(blocks)), key=lambda i: blocks[i].start)
    pairs = []
    for x, i in enumerate(ordered):
        for j in ordered[x + 1:]:
            if blocks[j].start >= blocks[i].end:
                break
            pairs.append((i, j))
    return pairs


# ---- solvers -------------------------------------------------------------------------------------

def greedy(blocks: Sequence[Block]) -> Dict[str, int]:
    """Largest first (then earliest); each at the lowest address free over its whole lifetime."""
    placed: List[Tuple[Block, int]] = []
    offsets = {}
    for b in sorted(blocks, key=lambda b: (-b.size, b.start)):
        busy = sorted((off, off + o.size) for o, off in placed if o.overlaps(b))
        addr = 0
        for lo, hi in busy:
            if addr + b.size <= lo:
                break
            addr = max(addr, hi)
        offsets[b.id] = addr
        placed.append((b, addr))
    return offsets


def _unit(blocks: Sequence[Block]) -> int:
    g = 0
    for b in blocks:
        g = math.gcd(g, b.size)
    return max(g, 1)


def cpsat(blocks: Sequence[Block], time_limit: float, hint: Dict[str, int], bound: int):
    from ortools.sat.python import cp_model

    unit = _unit(blocks)
    cap = max(hint[b.id] + b.size for b in blocks) // unit  # the warm start's peak: no worse plan is wanted
    model = cp_model.CpModel()
    peak = model.NewIntVar(-(-bound // unit), cap, "peak")  # never below the live-bytes bound
    xs, ys, addr = [], [], {}
    for b in blocks:
        size = b.size // unit
        a = model.NewIntVar(0, cap - size, f"a_{b.id}")
        addr[b.id] = a
        ys.append(model.NewIntervalVar(a, size, a + size, f"y_{b.id}"))
        xs.append(model.NewFixedSizeIntervalVar(b.start, b.end - b.start, f"x_{b.id}"))
        model.Add(a + size <= peak)
        model.AddHint(a, hint[b.id] // unit)
    model.AddNoOverlap2D(xs, ys)
    model.Minimize(peak)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 2
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return {k: solver.Value(v) * unit for k, v in addr.items()}, status == cp_model.OPTIMAL


class SolverUnavailable(RuntimeError):
    """The solver could not run here; the message says why (for the plan's notes)."""


def _gurobi_failure(err) -> SolverUnavailable:
    if err.errno == 10010:  # the pip licence stops at 2000 variables or constraints
        return SolverUnavailable(f"gurobi: size-limited licence ({err})")
    return SolverUnavailable(f"gurobi: error {err.errno} ({err})")  # e.g. 10009: no valid licence


def gurobi(blocks: Sequence[Block], time_limit: float, hint: Dict[str, int], bound: int):
    import gurobipy as gp

    pairs = conflicts(blocks)
    # The warm start's peak bounds every address and is the big-M: a plan no better is not wanted,
    # and a smaller M keeps Gurobi's integrality tolerance (z within 1e-9 of 0 or 1) below a unit.
    cap = float(max(hint[b.id] + b.size for b in blocks))
    try:
        with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as m:
            m.Params.TimeLimit = time_limit
            m.Params.BestObjStop = bound  # a plan at the live-bytes bound is optimal: stop there
            # Gurobi calls a plan optimal within a 1e-4 relative gap by default, megabytes at a
            # real peak; the objective is whole units, so a gap under one unit is a proof
            m.Params.MIPGap, m.Params.MIPGapAbs, m.Params.IntFeasTol = 0.0, 0.999, 1e-9
            peak = m.addVar(lb=float(bound), ub=cap, name="M")
            # integral addresses (in ALIGN units): a continuous optimum could sit between them
            a = [m.addVar(lb=0.0, ub=cap, vtype=gp.GRB.INTEGER, name=f"A{i}") for i in range(len(blocks))]
            for i, b in enumerate(blocks):
                m.addConstr(a[i] + b.size <= peak)
                a[i].Start = hint[b.id]
            for i, j in pairs:
                z = m.addVar(vtype=gp.GRB.BINARY)
                m.addConstr(a[i] + blocks[i].size <= a[j] + z * cap)
                m.addConstr(a[j] + blocks[j].size <= a[i] + (1 - z) * cap)
            m.setObjective(peak, gp.GRB.MINIMIZE)
            m.optimize()
            if m.SolCount == 0:
                return None
            offsets = {b.id: int(round(a[i].X)) for i, b in enumerate(blocks)}
            return offsets, m.Status == gp.GRB.OPTIMAL
    except gp.GurobiError as err:
        raise _gurobi_failure(err) from None


def plan(blocks: Sequence[Block], solver: str = "gurobi", time_limit: float = 30.0) -> Plan:
    """Solve with `solver`, falling back down SOLVERS; the greedy plan is the safety net and the
    warm start of the exact solvers. Offsets, peak and bound are in bytes, multiples of ALIGN."""
    if solver not in SOLVERS:
        raise ValueError(f"--memo-planner must be one of {SOLVERS}, got {solver!r}")
    blocks = list(blocks)
    units = _solve([Block(b.id, -(-b.size // ALIGN), b.start, b.end) for b in blocks], solver, time_limit)
    # _solve checked the plan in units; sizes were rounded up, so it holds for the true sizes too
    offsets = {k: v * ALIGN for k, v in units.offsets.items()}
    return Plan(units.solver, units.peak * ALIGN, units.lower_bound * ALIGN, offsets, units.seconds, units.optimal,
                units.notes)


def _solve(blocks: List[Block], solver: str, time_limit: float) -> Plan:
    """plan() on blocks whose sizes are ALIGN units."""
    bound = lower_bound(blocks)
    start = time.perf_counter()
    base = greedy(blocks)
    base_peak = max((base[b.id] + b.size for b in blocks), default=0)
    notes = []
    if not blocks:
        return Plan("greedy", 0, 0, {}, 0.0, True)
    for name in SOLVERS[SOLVERS.index(solver):]:
        if name == "greedy":
            break
        t0 = time.perf_counter()
        try:
            result = (gurobi if name == "gurobi" else cpsat)(blocks, time_limit, base, bound)
        except SolverUnavailable as err:
            notes.append(f"{err}; falling back")
            continue
        except ImportError as err:
            notes.append(f"{name}: not installed ({err}); falling back")
            continue
        if result is None:
            notes.append(f"{name}: no solution in {time_limit:.0f}s; falling back")
            continue
        offsets, optimal = result
        peak = max(offsets[b.id] + b.size for b in blocks)
        if peak > base_peak:
            notes.append(f"{name}: peak {peak} worse than greedy's {base_peak}; kept greedy")
            break
        try:
            check_plan(blocks, offsets, peak)
        except PlanError as err:  # a solver's tolerance let tensors touch: never hand that out
            notes.append(f"{name}: its plan failed the check ({err}); falling back")
            continue
        return Plan(name, peak, bound, offsets, time.perf_counter() - t0, optimal or peak == bound, notes)
    check_plan(blocks, base, base_peak)
    return Plan("greedy", base_peak, bound, base, time.perf_counter() - start, base_peak == bound, notes)
