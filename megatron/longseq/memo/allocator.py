"""The planned allocator (arena.c) from Python: build it, load a plan, replay it each iteration, read its
counters; on a GPU, install it as torch's allocator and record the job profiler's trace with it.

The C library is compiled on first use with the system C compiler into a per-user cache (keyed by
the source's hash, replaced atomically) and loaded with ctypes; torch loads the same file as a
CUDAPluggableAllocator, so both see one set of globals.

What the runtime does with it on a GPU (`--memo-allocator planned`):
  1. install before the first CUDA allocation (every request now goes through arena.c);
  2. record one iteration with the layer windows marked: the trace, windows included;
  3. plan it (planner.bilevel_plan) and load the composed plan (MemoryPlan.replay, also in a saved
     plan): every request of the iteration with its arena offset, both levels, and where each
     window mark falls; the arena is reserved at the plan's peak;
  4. every training iteration replays it; each layer window's marks put a diverged replay back
     in step.
Streams: torch's pluggable allocator drops record_stream, so arena.c keeps streams itself (a freed
block is reused by its own stream only, and waits for the streams `record_stream` named here);
NCCL keeps the tensors of a collective alive until its wait(): the default of recent torch (2.11's
ProcessGroupNCCL warns that TORCH_NCCL_AVOID_RECORD_STREAMS is deprecated); `install` sets that
variable before torch 2.8 (a bound on the safe side: the warning is all a version in between
costs). Point-to-point tensors get only record_stream, which never reaches this allocator: every
send and receive buffer is held by its caller until its wait() or completion (the ring's _Pending,
the pipeline's Inbox and Outbox).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import contextlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Optional

import torch

from megatron.longseq.memo.planner import Replay
from megatron.longseq.memo.trace import Trace

SOURCE = Path(__file__).with_name("arena.c")
STATS = ("planned_allocs", "planned_bytes", "cached_allocs", "cache_hits", "divergences",
         "overlap_refusals", "retries", "failed_allocs", "backend_bytes", "allocated_bytes",
         "peak_allocated_bytes", "cached_free_bytes", "pending_bytes", "marks_matched", "peak_backend_bytes",
         "device_syncs")
_I64 = ctypes.c_int64
INSTALLED: Optional["PlannedAllocator"] = None  # the process's CUDA allocator, once installed


def build_problem() -> Optional[str]:
    """Why the allocator could not be built here (None: it is built, or a compiler is there)."""
    if _library_target().exists():
        return None
    compiler = _compiler()
    return None if shutil.which(compiler) else f"no C compiler ({compiler}) to build {SOURCE.name} with (set CC)"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _library_target() -> Path:
    cache = Path(os.environ.get("MEGATRON_LONGSEQ_CACHE", Path.home() / ".cache" / "megatron-longseq"))
    return cache / f"libmemo_arena-{hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]}.so"


def library_path() -> Path:
    """The compiled allocator, built once per source version."""
    target = _library_target()
    if target.exists():
        return target
    cache = target.parent
    cache.mkdir(parents=True, exist_ok=True)
    compiler = _compiler()
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
        pass
    try:
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", tmp.name, str(SOURCE), "-ldl", "-lpthread"],
                       check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        os.unlink(tmp.name)
        detail = getattr(err, "stderr", "") or str(err)
        raise RuntimeError(f"MEMO planned allocator: cannot compile {SOURCE} with {compiler}: {detail.strip()}") from err
    os.replace(tmp.name, target)  # atomic: a concurrent rank sees the old name or the whole file
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.arena_init.argtypes = [ctypes.c_int, _I64, ctypes.c_int]
    lib.arena_malloc.restype = ctypes.c_void_p
    lib.arena_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.arena_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.arena_reserve.argtypes = [_I64]
    lib.arena_set_plan.argtypes = [_I64, ctypes.POINTER(_I64), ctypes.POINTER(_I64), _I64, ctypes.POINTER(_I64),
                                   ctypes.POINTER(_I64)]
    lib.arena_iteration.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.arena_mark.argtypes = [ctypes.c_int]
    lib.arena_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.arena_fake_stream_done.argtypes = [ctypes.c_void_p]
    lib.arena_stats.argtypes = [ctypes.POINTER(_I64)]
    lib.arena_stat_count.restype = _I64
    lib.arena_base.restype = _I64
    lib.arena_size.restype = _I64
    lib.arena_record.argtypes = [ctypes.c_int]
    lib.arena_events.restype = _I64
    lib.arena_events.argtypes = [ctypes.POINTER(_I64), _I64]
    assert lib.arena_stat_count() == len(STATS), "arena.c and allocator.py disagree on the counters"
    return lib


def _array(values):
    return (_I64 * max(len(values), 1))(*values)


class PlannedAllocator:
    """One per process (the C library's state is global). backend: "cuda" or "heap" (the C heap,
    optionally limited to `capacity` bytes: the same logic, testable without a GPU). abort_on_oom
    (default: on CUDA): a failed allocation ends the process with one line, since torch would
    take the NULL for a tensor."""

    def __init__(self, backend: str = "cuda", capacity: int = -1, abort_on_oom: Optional[bool] = None):
        self.path = library_path()
        self.lib = _load(self.path)
        if backend == "heap":  # the library's state outlives instances; tests start afresh
            self.lib.arena_reset()
        fatal = backend == "cuda" if abort_on_oom is None else abort_on_oom
        rc = self.lib.arena_init(1 if backend == "cuda" else 0, capacity, int(fatal))
        if rc != 0:
            raise RuntimeError(f"MEMO planned allocator: cannot open libcuda.so.1 (code {rc})")
        self.backend = backend
        self.ids: Dict[str, int] = {}
        self.labels: Dict[int, str] = {}

    # ---- torch ---------------------------------------------------------------------------------
    def install(self) -> None:
        """Make this torch's CUDA allocator; only before the process's first CUDA allocation."""
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(self.path), "arena_malloc", "arena_free")
        torch.cuda.memory.change_current_allocator(pluggable)

    # ---- plan ----------------------------------------------------------------------------------
    def mark_id(self, label: str) -> int:
        if label not in self.ids:
            self.ids[label] = len(self.ids)
            self.labels[self.ids[label]] = label
        return self.ids[label]

    def load(self, replay: Replay) -> int:
        """Reserve the arena at the plan's extent and load its requests and marks. Returns the
        arena's bytes."""
        rc = self.lib.arena_reserve(replay.arena_bytes)
        if rc != 0:
            raise RuntimeError(f"MEMO planned allocator: cannot reserve {replay.arena_bytes} bytes (code {rc})")
        ids = [self.mark_id(label) for label, _ in replay.marks]
        at = [index for _, index in replay.marks]
        rc = self.lib.arena_set_plan(len(replay.sizes), _array(replay.sizes), _array(replay.offsets),
                                     len(ids), _array(ids), _array(at))
        if rc != 0:
            raise RuntimeError(f"MEMO planned allocator: cannot load the plan (code {rc})")
        return replay.arena_bytes

    # ---- an iteration and its marks --------------------------------------------------------------
    @contextlib.contextmanager
    def iteration(self, stream: int = 0):
        """Replay the plan for the requests of `stream` (on a GPU: the current stream) meanwhile."""
        if self.backend == "cuda":
            stream = torch.cuda.current_stream().cuda_stream
        self.lib.arena_iteration(1, stream or None)
        try:
            yield
        finally:
            self.lib.arena_iteration(0, None)

    def mark(self, label: str) -> None:
        """A layer window's mark ("begin fwd L3"): recorded, and a diverged replay resumes here."""
        self.lib.arena_mark(self.mark_id(label))

    def record_stream(self, ptr: int, stream: int) -> None:
        """torch's record_stream for this allocator (torch's pluggable allocator drops the call):
        `stream` uses the block at `ptr`, so its free waits for that stream."""
        if self.lib.arena_record_stream(ptr, stream or None) != 0:
            raise RuntimeError(f"MEMO planned allocator: cannot record stream {stream:#x} on block {ptr:#x}")

    # ---- raw requests (tests drive the heap backend with them; a stream is any handle) -----------
    def malloc(self, size: int, stream: int = 0) -> Optional[int]:
        return self.lib.arena_malloc(size, 0, stream or None)

    def free(self, ptr: int, size: int, stream: int = 0) -> None:
        self.lib.arena_free(ptr, size, 0, stream or None)

    def fake_stream_done(self, stream: int) -> None:
        """Heap backend: `stream` has run all it was given."""
        self.lib.arena_fake_stream_done(stream or None)

    @property
    def base(self) -> int:
        return self.lib.arena_base()

    @property
    def arena_bytes(self) -> int:
        return self.lib.arena_size()

    # ---- counters and recording -----------------------------------------------------------------
    def stats(self) -> Dict[str, int]:
        out = (_I64 * len(STATS))()
        self.lib.arena_stats(out)
        return dict(zip(STATS, out))

    def reset_peak(self) -> None:
        """Peaks from now, retries and failures from zero (what metrics.reset_memory_peaks asks of
        torch's allocator too)."""
        self.lib.arena_reset_peak()

    def empty_cache(self) -> None:
        self.lib.arena_empty_cache()

    def settle(self) -> None:
        """An iteration's end: every free still waiting for another stream may be reused once the
        streams have passed (the device is synchronized only when one waits)."""
        self.lib.arena_settle()

    def reset(self) -> None:
        self.lib.arena_reset()

    def record(self, on: bool) -> None:
        self.lib.arena_record(1 if on else 0)

    def recorded_trace(self) -> Trace:
        """The recorded requests and marks as a Trace (addresses named by generation)."""
        n = self.lib.arena_events(None, 0)
        raw = (_I64 * (3 * max(n, 1)))()
        self.lib.arena_events(raw, n)
        trace, names, generation = Trace(), {}, {}
        for i in range(n):
            kind, a, b = raw[3 * i], raw[3 * i + 1], raw[3 * i + 2]
            if kind == 0:
                generation[a] = generation.get(a, 0) + 1
                names[a] = f"{a:x}.{generation[a]}"
                trace.events.append(("malloc", names[a], b))
            elif kind == 1 and a in names:
                trace.events.append(("free", names.pop(a), b))
            elif kind == 2:
                trace.mark(self.labels[a])
        return trace


def torch_records_nccl_streams(version: str = torch.__version__) -> bool:
    """Whether torch's NCCL process group may still call record_stream by default (taken as before
    2.8); later ones keep a collective's tensors until it completes, and warn of the variable."""
    return torch.torch_version.TorchVersion(version) < (2, 8)


def install() -> "PlannedAllocator":
    """Install the planned allocator as this process's CUDA allocator (once)."""
    global INSTALLED
    if INSTALLED is None:
        if torch_records_nccl_streams():  # dropped here: have NCCL hold its tensors until wait() instead
            os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"
        allocator = PlannedAllocator("cuda")
        allocator.install()
        INSTALLED = allocator
    return INSTALLED
