"""MEMO's job profiler (section 4.3.2): what one layer saves and how long it takes, the
device-to-host bandwidth, and the allocation trace of an iteration with layer windows marked.

`profile_sizes` runs one iteration with the runtime measuring (alpha 0, nothing sent to host
memory: the budget is checked before any is taken) and reads back per layer: the bytes of the
input and of the attention output and lse (offloaded whole), of everything else, and the layer's
forward time (measured separately, without offloading).
`trace_iteration` runs one micro-batch under the allocation tracer (CPU) or torch's allocator
history (GPU), with "begin/end fwd Ln" and "begin/end bwd Ln" marks around every layer (on GPU
carried through the history as allocations on a marker stream).
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch

from megatron.longseq.memo.alpha import LayerProfile, LayerSizes
from megatron.longseq.memo.buffers import ALIGN
from megatron.longseq.memo.streams import host_empty
from megatron.longseq.memo.trace import AllocationTracer, Trace, from_cuda_snapshot


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device, limit: int = 64 * 2**20) -> float:
    """Bytes/s of the slower direction between device and host memory (pinned on GPU; plain
    copies on CPU): the offload in forward and the prefetch in backward must both hide behind
    compute. Measured with at most `limit` bytes of host memory (counted with MEMO's own)."""
    nbytes = max(ALIGN, min(64 * 2**20, int(limit)))
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = host_empty(nbytes, pin=device.type == "cuda")
    return min(copy_rate(host, on_device, device), copy_rate(on_device, host, device))


def copy_rate(dst: torch.Tensor, src: torch.Tensor, device: torch.device, copies: int = 4) -> float:
    """Bytes/s of dst.copy_(src), after one copy to warm up."""
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(copies):
        dst.copy_(src, non_blocking=device.type == "cuda")
    _sync(device)
    return copies * dst.numel() * dst.element_size() / (time.perf_counter() - start)


def profile_sizes(memo, run_microbatch: Callable[[], None], layers: List[torch.nn.Module],
                  device) -> Tuple[Optional[LayerProfile], List[LayerSizes]]:
    """One iteration measured (no host memory taken): the largest managed layer's bytes by kind
    and its forward time, and every managed forward's sizes; (None, []) on a pipeline stage that
    manages no layer. Every rank must call it: the iteration communicates."""
    from megatron.longseq.memo import runtime

    first: List[runtime.LayerState] = []  # the first managed forward: its input times the layer
    original = runtime.LayerState.forward

    def recording(self):
        if not first:
            first.append(self)
        return original(self)

    runtime.LayerState.forward = recording
    try:
        sizes = memo.measure(run_microbatch)
    finally:
        runtime.LayerState.forward = original
    if not sizes:
        return None, []
    return LayerProfile.largest(sizes, _forward_seconds(layers[0], first[0], device)), sizes


def _forward_seconds(layer, state, device, samples: int = 3) -> float:
    """One layer's forward time, without offloading: rerun on its input under no_grad, after a
    warm-up; the median of `samples` (a single short run is at the mercy of clocks ramping up)."""
    x = torch.randn(state._input_view[0], device=device,
                    dtype=next(layer.parameters()).dtype)
    times = []
    with torch.no_grad():
        for _ in range(samples + 1):
            start = time.perf_counter()
            layer(hidden_states=x, **state.kwargs)
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def mark_layer_windows(layers, trace: Trace) -> list:
    """Forward windows by module hooks; backward windows by hooks on the layer's output gradient
    (its backward begins) and its input gradient (its backward is done)."""
    handles = []
    for layer in layers:
        name = f"L{layer.layer_number}"

        def pre(module, args, kwargs, name=name):
            trace.mark(f"begin fwd {name}")
            x = kwargs.get("hidden_states", args[0] if args else None)
            if x is not None and x.requires_grad:
                x.register_hook(lambda g, name=name: trace.mark(f"end bwd {name}"))

        def post(module, args, kwargs, out, name=name):
            trace.mark(f"end fwd {name}")
            y = out[0] if isinstance(out, tuple) else out
            if y.requires_grad:
                y.register_hook(lambda g, name=name: trace.mark(f"begin bwd {name}"))

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles


class CudaMarks:
    """torch's allocator history cannot carry a mark: each one is recorded as a one-byte allocation
    on a stream of its own, which `from_cuda_snapshot` turns back into the mark."""

    def __init__(self, device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.labels: List[str] = []

    def mark(self, label: str) -> None:
        self.labels.append(label)
        with torch.cuda.stream(self.stream):
            torch.empty(1, dtype=torch.uint8, device=self.device)  # allocated and freed: one entry


@contextlib.contextmanager
def collector_off():
    """A traced iteration is the iteration's own: garbage left by earlier work is collected first,
    and the collector stays off while tracing, so that no foreign frees (or frees delayed to a
    later collection) land in it at moments that depend on what ran before."""
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def trace_iteration(run_microbatch: Callable[[], None], layers, device) -> Trace:
    trace = Trace()
    marks = CudaMarks(device) if device.type == "cuda" else trace
    handles = mark_layer_windows(layers, marks)
    try:
        with collector_off():
            trace = _traced(run_microbatch, device, marks, trace)
    finally:
        for h in handles:
            h.remove()
    return trace


# The trace reads each entry's action, address, size and stream, nothing else: no tracebacks (torch's
# default unwinds the C++ stack at every allocation and free, then symbolises every frame in
# _snapshot), and no entries of the kinds it skips filling the history's ring.
HISTORY = dict(enabled="all", context=None, stacks="python", max_entries=1_000_000, clear_history=True,
               skip_actions=["free_completed", "segment_alloc", "segment_free", "snapshot"])


def history_settings() -> dict:
    """HISTORY less what this torch's recorder does not take (skip_actions is recent): the skipped
    kinds then fill more of the ring, and the trace passes over them itself."""
    accepted = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(HISTORY)
    return {key: value for key, value in HISTORY.items() if key in accepted}


def _traced(run_microbatch, device, marks, trace: Trace) -> Trace:
    if device.type != "cuda":
        with AllocationTracer(trace):
            run_microbatch()
        return trace
    torch.cuda.memory._record_memory_history(**history_settings())
    try:  # recording stops whatever happens: left on, it would slow down every later allocation
        run_microbatch()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return from_cuda_snapshot(snapshot, device.index or 0, marks.stream.cuda_stream, marks.labels)
