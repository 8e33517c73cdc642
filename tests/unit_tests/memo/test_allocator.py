"""The planned allocator (arena.c) on its C-heap backend: the same code torch loads on a GPU, driven
here by the request sequences of real layer traces. Every block handed out is filled with its own
tag and checked when freed, so an overlap the bookkeeping missed would show as corrupted bytes."""
import ctypes

import pytest

from megatron.longseq.memo.allocator import PlannedAllocator
from megatron.longseq.memo.planner import Replay, bilevel_plan
from megatron.longseq.memo.trace import Trace
from tests.unit_tests.memo.test_planner import _real_trace


@pytest.fixture(scope="module")
def traced():
    trace = _real_trace(0.5, microbatches=2)  # every layer window runs twice
    return trace, bilevel_plan(trace, "cpsat", time_limit=10)


class Replayer:
    """Replays a trace's mallocs, frees and marks against the allocator, tagging memory."""

    def __init__(self, alloc: PlannedAllocator):
        self.alloc = alloc
        self.live = {}  # trace id -> (address, size, tag)
        self.addresses = {}

    def run(self, trace: Trace, keep=()):
        for kind, tid, size in trace.events:
            if kind == "mark":
                self.alloc.mark(tid)
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

    def iteration(self, trace: Trace, keep=()):
        with self.alloc.iteration():
            self.run(trace, keep)

    def _check_disjoint(self, ptr, size):
        # torch keys live blocks by address: an empty one counts as a byte, as its own address
        for other, (p, s, _) in self.live.items():
            assert ptr + max(size, 1) <= p or p + max(s, 1) <= ptr, f"overlaps live {other}"


def _placed(trace):
    """The tensors the plan places: all but those alive at the trace's end."""
    return {b.id: b for b in trace.blocks() if b.end < len(trace.events)}


def test_every_iteration_replays_both_plan_levels(traced):
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    assert alloc.load(plan.replay) == alloc.arena_bytes == plan.replay.arena_bytes <= plan.peak
    placed = _placed(trace)
    windows = trace.windows()
    assert plan.reused["fwd L1#1"] == "fwd L1"  # the second micro-batch's windows reuse level 1
    transient = {tid for lo, hi in windows.values() for kind, tid, _ in trace.events[lo:hi] if kind == "malloc"}
    # level 1 places the window transients, level 2 the windows and what outlives them
    assert placed.keys() & transient and placed.keys() - transient
    kept = sum(b.size for b in trace.blocks() if b.id not in placed)  # alive at the end: from the cache
    marks = sum(kind == "mark" for kind, _, _ in trace.events)
    replay = Replayer(alloc)
    for n in (1, 2):  # the second iteration lands where the first did
        replay.iteration(trace)
        stats = alloc.stats()
        assert stats["divergences"] == 0 and stats["overlap_refusals"] == 0
        for tid in placed:
            assert replay.addresses[tid] == alloc.base + plan.offsets[tid], tid
        assert stats["planned_allocs"] == n * len(placed) and stats["marks_matched"] == n * marks
        assert stats["allocated_bytes"] == n * kept


def test_a_diverging_request_goes_to_the_cache_until_the_next_mark(traced):
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    alloc.load(plan.replay)
    lo, hi = trace.windows()["fwd L1"]
    events = list(trace.events)
    first = next(i for i in range(lo, hi) if events[i][0] == "malloc")
    kind, tid, size = events[first]
    events[first] = (kind, tid, size + 8)  # one request of another size
    resync = next(i for i in range(first, len(events)) if events[i][0] == "mark")
    placed = _placed(trace)
    lost = {t for k, t, _ in events[first:resync] if k == "malloc" and t in placed}
    Replayer(alloc).iteration(Trace(events))  # no overlap, no corruption (checked while replaying)
    stats = alloc.stats()
    assert stats["divergences"] == 1 and stats["overlap_refusals"] == 0
    assert stats["planned_allocs"] == len(placed) - len(lost)


def test_a_tensor_that_outlives_its_plan_is_never_overwritten(traced):
    """A tensor kept past its planned free (a lifetime the trace did not show): the planned block
    that would reuse its bytes is refused and served by the cache."""
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    alloc.load(plan.replay)
    placed = _placed(trace)

    def reuses(o, t):  # o comes after t's free, in t's bytes
        return (o != t and placed[o].start > placed[t].end and plan.offsets[o] < plan.offsets[t] + placed[t].size
                and plan.offsets[t] < plan.offsets[o] + placed[o].size)

    victim = next(t for t in placed if any(reuses(o, t) for o in placed))
    Replayer(alloc).iteration(trace, keep={victim})
    stats = alloc.stats()
    assert stats["overlap_refusals"] >= 1 and stats["divergences"] >= 1


def test_outside_an_iteration_nothing_is_replayed(traced):
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    alloc.load(plan.replay)
    Replayer(alloc).run(trace)  # evaluation, the optimizer step: marks come, the plan is not used
    stats = alloc.stats()
    assert stats["planned_allocs"] == 0 and stats["marks_matched"] == 0


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
    alloc.reset_peak()  # training starts: set-up's retries are not the iterations' (as torch's counters)
    stats = alloc.stats()
    assert stats["retries"] == 0 and stats["failed_allocs"] == 0
    assert stats["peak_allocated_bytes"] == stats["allocated_bytes"] == 4 * 4096  # b, a, d, e live


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
    alloc.load(Replay([4096], [0], [("begin fwd L2", 0)], 4096))

    def window():
        with alloc.iteration(S):
            return alloc.malloc(4096, S)

    p = window()
    assert p == alloc.base
    alloc.record_stream(p, T)
    alloc.free(p, 4096, S)
    q = window()
    assert q != alloc.base and alloc.stats()["overlap_refusals"] == 1  # T may still read it
    alloc.free(q, 4096, S)
    alloc.fake_stream_done(T)
    assert window() == alloc.base
    with alloc.iteration(S):
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
        # A real trace may free tensors born before it began (what earlier code in the process
        # left to the collector); nothing allocated them here, so nothing replays their frees.
        born = {tid for k, tid, _ in t.events if k == "malloc"}
        return [(k, tid if k == "mark" else size) for k, tid, size in t.events if k != "free" or tid in born]

    assert shape(recorded) == shape(trace)
    assert set(recorded.windows()) == set(trace.windows())
    bilevel_plan(recorded, "greedy")  # validates every block against the recorded trace


def test_settle_synchronizes_only_when_a_block_waits_for_another_stream():
    alloc = PlannedAllocator("heap")
    a = alloc.malloc(4096, S)
    alloc.free(a, 4096, S)
    alloc.settle()
    assert alloc.stats()["device_syncs"] == 0  # an iteration's end costs no device synchronization
    b = alloc.malloc(4096, S)
    alloc.record_stream(b, T)
    alloc.free(b, 4096, S)
    alloc.settle()
    assert alloc.stats()["device_syncs"] == 1 and alloc.stats()["pending_bytes"] == 0


def test_reserving_the_arena_gives_the_cache_back_first():
    """The profiling iterations fill the cache; the arena is reserved after them, and the cached
    blocks must not stay beside it (here they would not even leave it room)."""
    alloc = PlannedAllocator("heap", capacity=8 * 4096)
    blocks = [alloc.malloc(4096, S) for _ in range(6)]
    for ptr in blocks:
        alloc.free(ptr, 4096, S)
    assert alloc.stats()["cached_free_bytes"] == 6 * 4096
    assert alloc.load(Replay([4096], [0], [("begin fwd L2", 0)], 4 * 4096)) == 4 * 4096
    stats = alloc.stats()
    assert stats["cached_free_bytes"] == 0 and stats["backend_bytes"] == 4 * 4096


# A stand-in for libcuda's driver API: the heap, and a context that is current per thread only once
# set (a thread's first driver call without one fails, as CUDA_ERROR_INVALID_CONTEXT).
FAKE_DRIVER = r"""
#include <stdint.h>
#include <stdlib.h>
static __thread void *current = 0;
static int64_t held = 0, capacity = 1 << 20;
int cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
int cuCtxSetCurrent(void *ctx) { current = ctx; return 0; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(intptr_t)(dev + 1); return 0; }
int cuMemAlloc_v2(uint64_t *p, size_t n) {
    if (!current) return 201;
    if (held + (int64_t)n > capacity) { const char *rc = getenv("FAKE_ALLOC_ERROR"); return rc ? atoi(rc) : 2; }
    held += n; *p = (uint64_t)(uintptr_t)malloc(n); return 0;
}
int cuMemFree_v2(uint64_t p) { if (!current) return 201; free((void *)(uintptr_t)p); return 0; }
int cuCtxSynchronize(void) { return current ? 0 : 201; }
int cuEventCreate(void **e, unsigned f) { *e = malloc(1); return current ? 0 : 201; }
int cuEventRecord(void *e, void *s) { return 0; }
int cuEventQuery(void *e) { const char *rc = getenv("FAKE_EVENT_QUERY"); return rc ? atoi(rc) : 0; }
int cuEventDestroy_v2(void *e) { free(e); return 0; }
"""

DRIVER_CHECK = """
import sys, threading
from megatron.longseq.memo.allocator import PlannedAllocator
alloc = PlannedAllocator("cuda")
got = []
thread = threading.Thread(target=lambda: got.append(alloc.malloc(4096)))  # a thread with no context
thread.start(); thread.join()
assert got[0], "the first allocation of a fresh thread failed"
alloc.free(got[0], 4096)
print("allocated", flush=True)
alloc.malloc(1 << 21)  # more than the device holds: the process ends here
print("returned")
"""


@pytest.mark.parametrize("error, line", [
    ("2", "MEMO planned allocator: out of device memory for 2097152 bytes"),
    ("700", "MEMO planned allocator: the driver refused 2097152 bytes with CUDA error 700, not out of memory")],
    ids=["out-of-memory", "illegal-address"])
def test_the_cuda_backend_binds_a_context_and_ends_the_process_when_out_of_memory(tmp_path, error, line):
    """The CUDA backend's driver calls, against a stand-in driver: a thread without a current context
    (autograd's device thread before its first runtime call) still allocates, and a failed
    allocation ends the process with one line instead of handing torch a NULL tensor -- naming the
    driver's error where it is not out of memory."""
    import os
    import signal
    import subprocess
    import sys

    source = tmp_path / "fake_cuda.c"
    source.write_text(FAKE_DRIVER)
    driver = tmp_path / "libfakecuda.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(driver), str(source)], check=True)
    proc = subprocess.run([sys.executable, "-c", DRIVER_CHECK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEMO_LIBCUDA": str(driver), "FAKE_ALLOC_ERROR": error})
    assert proc.stdout.split() == ["allocated"], proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGABRT
    assert line in proc.stderr


EVENT_CHECK = """
from megatron.longseq.memo.allocator import PlannedAllocator
alloc = PlannedAllocator("cuda")
S, T = 0x5, 0x7
a = alloc.malloc(4096, S)
alloc.record_stream(a, T)
alloc.free(a, 4096, S)
b = alloc.malloc(4096, S)
print(b == a, alloc.stats()["device_syncs"], alloc.stats()["pending_bytes"])
"""


@pytest.mark.parametrize("query, reused, syncs", [("0", True, 0), ("600", False, 0), ("201", True, 1)],
                         ids=["done", "not-ready", "failed"])
def test_a_failed_event_query_waits_for_the_device_instead_of_holding_the_block(tmp_path, query, reused, syncs):
    """The CUDA backend's event check, against the stand-in driver: CUDA_SUCCESS frees a block another
    stream used, CUDA_ERROR_NOT_READY keeps it pending, and any other answer (a failed query) waits
    for the whole device and frees it, instead of holding it pending for ever."""
    import os
    import subprocess
    import sys

    source = tmp_path / "fake_cuda.c"
    source.write_text(FAKE_DRIVER)
    driver = tmp_path / "libfakecuda.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(driver), str(source)], check=True)
    proc = subprocess.run([sys.executable, "-c", EVENT_CHECK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEMO_LIBCUDA": str(driver), "FAKE_EVENT_QUERY": query})
    assert proc.returncode == 0, proc.stderr
    got_reused, got_syncs, pending = proc.stdout.split()
    assert (got_reused == "True", int(got_syncs)) == (reused, syncs)
    assert (int(pending) == 0) == reused


def test_smaller_requests_replay_at_their_planned_places(traced):
    """Shorter micro-batches or Seq1F1B segments than the profiled ones ask for less at every
    request: each still lands where the plan put it, with no divergence."""
    trace, plan = traced
    alloc = PlannedAllocator("heap")
    alloc.load(plan.replay)
    smaller = Trace([(kind, tid, size - size // 8 if kind in ("malloc", "free") else size)
                     for kind, tid, size in trace.events])
    replay = Replayer(alloc)
    replay.iteration(smaller)
    stats = alloc.stats()
    assert stats["divergences"] == 0 and stats["overlap_refusals"] == 0
    placed = _placed(trace)
    for tid in placed:
        assert replay.addresses[tid] == alloc.base + plan.offsets[tid], tid


def test_an_empty_tensor_gets_an_address_no_live_block_has():
    """torch asks a pluggable allocator for 0 bytes too (an empty tensor) and keys its blocks by
    address: an empty block planned at a live block's start (the greedy planner puts every empty
    one at the window's base) would give torch one address twice, and it aborts at the second
    free. The empty request is no request of the plan and takes 512 bytes of the cache."""
    trace = Trace()
    trace.mark("begin fwd L1")
    trace.events += [("malloc", "big", 1 << 20), ("malloc", "empty", 0), ("free", "empty", 0),
                     ("malloc", "after", 4096), ("free", "after", 4096), ("free", "big", 1 << 20)]
    trace.mark("end fwd L1")
    plan = bilevel_plan(trace, "greedy")
    assert plan.offsets["empty"] == plan.offsets["big"]  # what made it dangerous
    alloc = PlannedAllocator("heap")
    alloc.load(plan.replay)
    replay = Replayer(alloc)
    replay.iteration(trace)
    assert replay.addresses["empty"] != replay.addresses["big"]
    assert replay.addresses["after"] == alloc.base + plan.offsets["after"]  # the plan goes on
    stats = alloc.stats()
    assert stats["divergences"] == 0 and stats["planned_allocs"] == 2


def test_a_plan_replays_whether_or_not_its_recorder_saw_empty_requests(traced):
    """On a GPU the pluggable allocator is asked for every empty tensor (MEMO makes three per
    managed layer, at each window's start), which torch's caching allocator, and so its history,
    never sees: a plan traced there must replay in full against requests that include them."""
    trace, plan = traced
    with_empty = Trace()
    for i, event in enumerate(trace.events):
        with_empty.events.append(event)
        if event[0] == "mark":
            with_empty.events += [("malloc", f"empty{i}", 0), ("free", f"empty{i}", 0)]
    alloc = PlannedAllocator("heap")
    alloc.load(plan.replay)
    replay = Replayer(alloc)
    replay.iteration(with_empty)
    stats = alloc.stats()
    assert stats["divergences"] == 0 and stats["planned_allocs"] == len(_placed(trace))
    for tid in _placed(trace):
        assert replay.addresses[tid] == alloc.base + plan.offsets[tid], tid


def test_nccl_is_asked_to_hold_its_tensors_only_where_torch_does_not_by_default():
    """torch's pluggable allocator drops record_stream; recent torch keeps a collective's tensors
    until it completes and warns if TORCH_NCCL_AVOID_RECORD_STREAMS is set (2.11 does)."""
    from megatron.longseq.memo.allocator import torch_records_nccl_streams

    assert torch_records_nccl_streams("2.5.1+cu124") and torch_records_nccl_streams("2.7.1")
    assert not any(torch_records_nccl_streams(v) for v in ("2.8.0", "2.11.0+cu130", "2.13.0+cpu"))
