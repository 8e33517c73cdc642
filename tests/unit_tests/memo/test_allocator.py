"""The planned allocator (arena.c) on its C-heap backend: the same code torch loads on a GPU, driven
here by the request sequences of real layer traces. Every block handed out is filled with its own
tag and checked when freed, so an overlap the bookkeeping missed would show as corrupted bytes."""
import ctypes

import pytest

from megatron.longseq.memo.allocator import PlannedAllocator, WindowDriver
from megatron.longseq.memo.planner import bilevel_plan, window_requests
from megatron.longseq.memo.trace import Trace
from tests.unit_tests.memo.test_planner import _real_trace


@pytest.fixture(scope="module")
def traced():
    trace = _real_trace(0.5)
    return trace, bilevel_plan(trace, "cpsat", time_limit=10)


class Replayer:
    """Replays a trace's mallocs, frees and marks against the allocator, tagging memory."""

    def __init__(self, alloc: PlannedAllocator):
        self.alloc, self.driver = alloc, WindowDriver(alloc)
        self.live = {}  # trace id -> (address, size, tag)
        self.addresses = {}

    def run(self, trace: Trace, keep=()):
        for kind, tid, size in trace.events:
            if kind == "mark":
                self.driver.mark(tid)
            elif kind == "malloc":
                ptr = self.alloc.malloc(size)
                assert ptr, f"{tid}: allocation failed"
                self._check_disjoint(ptr, size)
                tag = len(self.addresses) % 251 + 1
                ctypes.memset(ptr, tag, size)
                self.live[tid] = (ptr, size, tag)
                self.addresses[tid] = ptr
            elif kind == "free" and tid in self.live and tid not in keep:
                ptr, size, tag = self.live.pop(tid)
                assert ctypes.string_at(ptr, size) == bytes([tag]) * size, f"{tid}: overwritten while alive"
                self.alloc.free(ptr, size)

    def _check_disjoint(self, ptr, size):
        for other, (p, s, _) in self.live.items():
            assert ptr + size <= p or p + s <= ptr, f"overlaps live {other}"


def test_windows_replay_the_planned_offsets(traced):
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    half = alloc.load(plan.windows)
    assert half >= max(p.peak for p in plan.level1.values())
    replay = Replayer(alloc)
    replay.run(trace)
    stats = alloc.stats()
    # Only the last occurrence of a label is a window of the plan; the trace has one micro-batch,
    # so every window runs once and every transient in it lands at its planned offset.
    requests = window_requests(trace, plan.level1)
    assert requests == plan.windows
    planned = {tid for label in requests for tid in plan.level1[label].offsets}
    assert stats["planned_allocs"] == len(planned) > 0
    assert stats["diverged_windows"] == 0 and stats["overlap_refusals"] == 0
    windows = trace.windows()
    for label, level1 in plan.level1.items():
        half_index = int(label.rsplit("L", 1)[1]) % 2
        for tid, offset in level1.offsets.items():
            assert replay.addresses[tid] == alloc.base + half_index * alloc.half_bytes + offset, (label, tid)
    assert len(windows) == stats["windows_run"]
    assert stats["allocated_bytes"] == sum(s for _, s, _ in replay.live.values())


def test_a_diverging_window_falls_back_to_the_cache(traced):
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    alloc.load(plan.windows)
    lo, hi = trace.windows()["fwd L1"]
    events = list(trace.events)
    first = next(i for i in range(lo, hi) if events[i][0] == "malloc")
    kind, tid, size = events[first]
    events[first] = (kind, tid, size + 8)  # one request of another size: the rest of the window
    Replayer(alloc).run(Trace(events))  # no overlap, no corruption (checked while replaying)
    stats = alloc.stats()
    assert stats["diverged_windows"] == 1 and stats["overlap_refusals"] == 0
    windowed = sum(len(p.offsets) for p in plan.level1.values())
    assert stats["planned_allocs"] == windowed - len(plan.level1["fwd L1"].offsets)


def test_a_tensor_that_outlives_its_plan_is_never_overwritten(traced):
    """A transient kept past its planned free (a lifetime the trace did not show): the planned
    block that would reuse its bytes is refused and served by the cache."""
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    alloc.load(plan.windows)
    level1 = plan.level1["bwd L2"]
    lo, hi = trace.windows()["bwd L2"]
    frees = [tid for kind, tid, _ in trace.events[lo:hi] if kind == "free" and tid in level1.offsets]
    # the first transient freed inside the window whose bytes a later transient reuses
    blocks = {b.id: b for b in trace.blocks()}
    victim = next(t for t in frees if any(
        o != t and blocks[o].start > blocks[t].end and level1.offsets[o] < level1.offsets[t] + blocks[t].size
        and level1.offsets[t] < level1.offsets[o] + blocks[o].size for o in level1.offsets))
    Replayer(alloc).run(trace, keep={victim})
    stats = alloc.stats()
    assert stats["overlap_refusals"] >= 1 and stats["diverged_windows"] >= 1


S, T = 0x51, 0x7E  # two streams (any handles on the heap backend)


def test_cache_reuses_a_block_on_its_own_stream_and_retries_when_full():
    alloc = PlannedAllocator("heap", capacity=4 * 4096)
    a = alloc.malloc(4096, S)
    alloc.free(a, 4096, S)
    b = alloc.malloc(4096, T)
    assert b != a  # another stream: its work may run before S is done with a
    assert alloc.malloc(4096, S) == a  # the same stream: stream order makes reuse safe
    c, d = alloc.malloc(4096, S), alloc.malloc(4096, S)
    assert d is not None and alloc.stats()["backend_bytes"] == 4 * 4096
    alloc.free(c, 4096, S)
    e = alloc.malloc(4096, T)  # the heap is full and c is S's: synchronize and retry
    assert e == c
    stats = alloc.stats()
    assert stats["retries"] == 1 and stats["failed_allocs"] == 0 and stats["backend_bytes"] <= 4 * 4096
    assert alloc.malloc(8192, S) is None  # nothing left to reclaim: a clean failure, counted
    assert alloc.stats()["failed_allocs"] == 1


def test_a_block_another_stream_used_waits_for_that_stream():
    alloc = PlannedAllocator("heap")
    a = alloc.malloc(4096, S)
    alloc.record_stream(a, T)  # T reads it (a copy, a collective)
    alloc.free(a, 4096, S)
    assert alloc.malloc(4096, S) != a  # T has not passed the free yet
    alloc.fake_stream_done(T)
    assert alloc.malloc(4096, S) == a


def test_a_planned_range_another_stream_used_is_not_replayed_until_it_passed():
    alloc = PlannedAllocator("heap")
    alloc.load({"fwd L2": ((4096,), (0,))})

    def window():
        alloc.begin("fwd L2", S)
        p = alloc.malloc(4096, S)
        alloc.end("fwd L2")
        return p

    p = window()
    assert p == alloc.base
    alloc.record_stream(p, T)
    alloc.free(p, 4096, S)
    q = window()
    assert q != alloc.base and alloc.stats()["overlap_refusals"] == 1  # T may still read it
    alloc.free(q, 4096, S)
    alloc.fake_stream_done(T)
    assert window() == alloc.base
    alloc.begin("fwd L2", S)
    assert alloc.malloc(4096, T) != alloc.base  # another stream's request keeps its place, not the plan's


def test_recorded_trace_is_a_plannable_trace(traced):
    """What the allocator records (on a GPU: the profiler's trace) plans like the tracer's."""
    trace, _ = traced
    alloc = PlannedAllocator("heap")
    alloc.record(True)
    Replayer(alloc).run(trace)
    alloc.record(False)
    recorded = alloc.recorded_trace()

    def shape(t):  # ids differ (addresses there, counters here); kinds, sizes and marks agree
        return [(k, tid if k == "mark" else size) for k, tid, size in t.events]

    assert shape(recorded) == shape(trace)
    assert set(recorded.windows()) == set(trace.windows())
    bilevel_plan(recorded, "greedy")  # validates every block against the recorded trace
