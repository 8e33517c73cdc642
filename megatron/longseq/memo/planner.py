"""MEMO's bi-level memory plan (section 4.2) over a trace with layer windows.

Level 1: the transient tensors of one layer's forward window (allocated and freed inside it) and of
its backward window are planned once; every layer whose request sequence (sizes in order) is the
same reuses that plan, others get their own. Level 2: the whole trace with each window replaced by
one pseudo block of its level-1 peak, plus every tensor that outlives a window. The composed plan
(window offset + in-window offset) is checked tensor by tensor against the full trace, and is what
the planned allocator replays (`Replay`).
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.longseq.memo import dsa
from megatron.longseq.memo.buffers import aligned
from megatron.longseq.memo.trace import Trace


@dataclass
class Replay:
    """What the planned allocator replays each iteration: the trace's requests in order with their
    composed offsets in an arena of `arena_bytes` (-1: a tensor alive at the iteration's end, whose
    free no plan can foresee, goes to the cache), and each mark with the request index where it fell."""

    sizes: List[int]
    offsets: List[int]
    marks: List[Tuple[str, int]]
    arena_bytes: int


@dataclass
class MemoryPlan:
    peak: int
    lower_bound: int
    offsets: Dict[str, int]
    level1: Dict[str, dsa.Plan]  # window label -> its own plan (reused plans point to the same)
    level2: dsa.Plan
    reused: Dict[str, str] = field(default_factory=dict)  # window -> window whose plan it reuses
    replay: Replay = field(default_factory=lambda: Replay([], [], [], 0))

    def summary(self) -> dict:
        return {
            "peak_bytes": self.peak,
            "lower_bound_bytes": self.lower_bound,
            "gap": self.peak / self.lower_bound - 1 if self.lower_bound else 0.0,
            "level1": {label: {"solver": p.solver, "peak": p.peak, "lower_bound": p.lower_bound,
                               "optimal": p.optimal, "seconds": round(p.seconds, 3), "notes": p.notes,
                               "reuses": self.reused.get(label)}
                       for label, p in self.level1.items()},
            "level2": {"solver": self.level2.solver, "peak": self.level2.peak,
                       "lower_bound": self.level2.lower_bound, "optimal": self.level2.optimal,
                       "seconds": round(self.level2.seconds, 3), "notes": self.level2.notes},
            "windows_reusing_a_plan": len(self.reused),
        }

    def save(self, path: str, planned_for: Optional[dict]) -> None:
        """The plan, with what the caller says of the run it was made for (its sizes' settings)."""
        with open(path, "w") as f:
            json.dump({"format": PLAN_FORMAT, **self.summary(), "planned_for": planned_for, "offsets": self.offsets,
                       "replay": asdict(self.replay)}, f)


PLAN_FORMAT = "memo-plan-4"  # 3: empty requests are no request of the plan; 4: the run it was made for


def replay_of(trace: Trace, offsets: Dict[str, int], blocks: List[dsa.Block]) -> Replay:
    """The composed plan as the allocator replays it (see Replay); `blocks` are the trace's. Empty
    requests are no request of the plan: torch's caching allocator never sees them (so neither
    does its history), and the arena answers them from its cache (arena.c)."""
    outlives = {b.id for b in blocks if b.end == len(trace.events)}
    sizes, placed, marks = [], [], []
    for kind, tid, size in trace.events:
        if kind == "mark":
            marks.append((tid, len(sizes)))
        elif kind == "malloc" and size > 0:
            sizes.append(size)
            placed.append(-1 if tid in outlives else offsets[tid])
    extent = max((o + aligned(s) for s, o in zip(sizes, placed) if o >= 0), default=0)
    return Replay(sizes, placed, marks, extent)


def _window_finder(windows: Dict[str, Tuple[int, int]]):
    """block -> the window it lives in, or None. Windows overlap only by marks (a backward begins
    just before the next layer's ends), so the only candidate for an allocation is the window
    that began last before it."""
    spans = sorted((lo, hi, label) for label, (lo, hi) in windows.items())
    starts = [lo for lo, _, _ in spans]

    def window_of(block: dsa.Block):
        i = bisect.bisect_left(starts, block.start) - 1
        return spans[i][2] if i >= 0 and block.end < spans[i][1] else None

    return window_of


def _signature(bs: List[dsa.Block]) -> tuple:
    """What a window's plan depends on: its sizes in request order and which pairs are alive
    together. Windows equal in both share one plan; equal sizes alone may overlap otherwise."""
    return tuple(b.size for b in bs), frozenset(frozenset(pair) for pair in dsa.conflicts(bs))


def bilevel_plan(trace: Trace, solver: str = "gurobi", time_limit: float = 30.0) -> MemoryPlan:
    windows = trace.windows()
    blocks = trace.blocks()
    inside: Dict[str, List[dsa.Block]] = {label: [] for label in windows}
    outside = []
    window_of = _window_finder(windows)
    for b in blocks:
        label = window_of(b)
        (inside[label] if label else outside).append(b)
    level1: Dict[str, dsa.Plan] = {}
    reused: Dict[str, str] = {}
    solved: Dict[tuple, Tuple[str, dsa.Plan]] = {}  # request signature -> (first window, plan)
    for label, bs in inside.items():
        signature = _signature(bs)
        if signature in solved:
            first, p = solved[signature]
            ids = [b.id for b in inside[first]]
            level1[label] = dsa.Plan(p.solver, p.peak, p.lower_bound,
                                     {b.id: p.offsets[i] for b, i in zip(bs, ids)}, 0.0, p.optimal)
            reused[label] = first
        else:
            level1[label] = dsa.plan(bs, solver, time_limit)
            solved[signature] = (label, level1[label])
    pseudo = [dsa.Block(f"window:{label}", level1[label].peak, lo, hi + 1)
              for label, (lo, hi) in windows.items() if level1[label].peak > 0]
    level2 = dsa.plan(outside + pseudo, solver, time_limit)
    offsets = {b.id: level2.offsets[b.id] for b in outside}
    for label, bs in inside.items():
        base = level2.offsets.get(f"window:{label}", 0)
        for b in bs:
            offsets[b.id] = base + level1[label].offsets[b.id]
    dsa.check_plan(blocks, offsets, level2.peak)
    return MemoryPlan(level2.peak, dsa.lower_bound(blocks), offsets, level1, level2, reused,
                      replay_of(trace, offsets, blocks))


def load_plan_summary(path: str) -> dict:
    """A saved plan (MemoryPlan.save): its summary, offsets and replay."""
    blob = json.load(open(path))
    if blob.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path} is not a MEMO memory plan of this version ({PLAN_FORMAT}): plan again")
    bad = _misplaced(blob["replay"])
    if bad:
        raise ValueError(f"{path}: request {bad[0]} is planned at offset {bad[1]} for {bad[2]} bytes, not a "
                         f"multiple of {dsa.ALIGN} inside the {blob['replay']['arena_bytes']}-byte arena: plan again")
    return blob


def _misplaced(replay: dict):
    """(request, offset, size) of the first planned offset the arena cannot hand out: kernels
    assume torch's 512-byte alignment, and a plan edited or made elsewhere may not keep it."""
    for i, (size, offset) in enumerate(zip(replay["sizes"], replay["offsets"])):
        if offset != -1 and (offset < 0 or offset % dsa.ALIGN or offset + size > replay["arena_bytes"]):
            return i, offset, size
    return None


def stage_plan_path(path: str, stage: int, stages: int) -> str:
    """Where pipeline stage `stage`'s memory plan lives: `path` itself without pipelining, else
    one file per stage (plan.json -> plan.stage1.json): the stages hold different layers."""
    if stages == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.stage{stage}{ext}"


def saved_replay(blob: dict) -> Replay:
    r = blob["replay"]
    return Replay(r["sizes"], r["offsets"], [tuple(m) for m in r["marks"]], r["arena_bytes"])


def draw(trace: Trace, plan: MemoryPlan, path: str, title: str = "") -> None:
    """Every tensor as a rectangle: trace position (x) by planned address range (y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = trace.blocks()
    fig, ax = plt.subplots(figsize=(12, 5))
    colors = plt.get_cmap("tab20").colors
    mib = 2**20
    for i, b in enumerate(blocks):
        ax.add_patch(plt.Rectangle((b.start, plan.offsets[b.id] / mib), b.end - b.start, b.size / mib,
                                   facecolor=colors[i % 20], edgecolor="black", linewidth=0.2))
    for label, (lo, hi) in trace.windows().items():
        ax.axvspan(lo, hi, color="grey", alpha=0.08)
    ax.set_xlim(0, len(trace.events))
    ax.set_ylim(0, plan.peak / mib * 1.05)
    ax.axhline(plan.lower_bound / mib, color="red", linestyle="--", linewidth=0.8, label="lower bound")
    ax.set_xlabel("allocation event (index in the iteration's trace)")
    ax.set_ylabel("planned address (MiB)")
    ax.set_title(title or f"memory plan: peak {plan.peak / mib:.2f} MiB")
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(facecolor=colors[0], edgecolor="black", label="a tensor: its lifetime x its bytes"),
                Patch(facecolor="grey", alpha=0.2, label="a layer window (level-1 plan)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
