"""Allocation traces: what the job profiler records and the planner reads (MEMO section 4.3.2).

A trace is the ordered list of ("malloc", id, bytes), ("free", id, bytes) and ("mark", label, 0)
events of a run; marks "begin <window>" / "end <window>" bracket each layer's forward and
backward. On GPU it comes from torch's allocator history (`from_cuda_snapshot`); on CPU from
`AllocationTracer`, which sees every new storage an operator creates and the moment it dies.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.longseq.memo.dsa import Block

Event = Tuple[str, str, int]


@dataclass
class Trace:
    events: List[Event] = field(default_factory=list)
    planned_for: Optional[dict] = None  # the settings of the run traced, passed on to its plan

    def mark(self, label: str) -> None:
        self.events.append(("mark", label, 0))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"format": "memo-trace-1", "events": self.events, "planned_for": self.planned_for}, f)

    @classmethod
    def load(cls, path: str) -> "Trace":
        with open(path) as f:
            blob = json.load(f)
        if blob.get("format") != "memo-trace-1":
            raise ValueError(f"{path} is not a memo trace file")
        return cls(checked_events(blob["events"]), blob.get("planned_for"))

    def windows(self) -> Dict[str, Tuple[int, int]]:
        """label -> (position of "begin label", position of "end label"); the k-th repeat of a
        label (another micro-batch, segment or model chunk) is "label#k"."""
        begins, out, seen = {}, {}, {}
        for pos, (kind, label, _) in enumerate(self.events):
            if kind != "mark":
                continue
            what, name = label.split(" ", 1)
            if what == "begin":
                k = seen[name] = seen.get(name, -1) + 1
                begins[name] = (pos, f"{name}#{k}" if k else name)
            elif what == "end" and name in begins:
                start, key = begins.pop(name)
                out[key] = (start, pos)
        return out

    def blocks(self) -> List[Block]:
        """Every allocation as a block over event positions; never freed: alive to the end."""
        open_at: Dict[str, Tuple[int, int]] = {}
        blocks = []
        for pos, (kind, tid, size) in enumerate(self.events):
            if kind == "malloc":
                open_at[tid] = (pos, size)
            elif kind == "free" and tid in open_at:
                start, size = open_at.pop(tid)
                blocks.append(Block(tid, size, start, pos))
        blocks += [Block(tid, size, start, len(self.events)) for tid, (start, size) in open_at.items()]
        return sorted(blocks, key=lambda b: b.start)


def checked_events(events: list) -> List[Event]:
    """A saved event list as events, or ValueError naming the first that is none: a malformed one
    would be planned silently (a repeated id at one address with its twin)."""
    live: set = set()
    for i, e in enumerate(events):
        ok = isinstance(e, list) and len(e) == 3 and e[0] in ("malloc", "free", "mark") and isinstance(e[1], str) \
            and type(e[2]) is int and e[2] >= 0
        if not ok:
            raise ValueError(f"event {i} {e!r} is not [malloc|free|mark, id, bytes >= 0]")
        if e[0] == "malloc" and e[1] in live:
            raise ValueError(f"event {i} {e!r} allocates {e[1]!r}, which is still alive")
        if e[0] == "malloc":
            live.add(e[1])
        elif e[0] == "free":
            live.discard(e[1])
    return [tuple(e) for e in events]


class AllocationTracer(TorchDispatchMode):
    """CPU stand-in for the CUDA allocator history: a storage an operator creates is a malloc
    (views and in-place results, on a storage of one of its inputs, are not: a parameter made
    before tracing began is no allocation when an op views it), its destruction -- the storage
    object dies with the storage, however many views or autograd references kept it -- is the
    free."""

    def __init__(self, trace: Trace = None):
        super().__init__()
        self.trace = trace if trace is not None else Trace()
        self.live: Dict[int, str] = {}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._record(t.untyped_storage(), inputs)
        return out

    def _record(self, storage, inputs: set) -> None:
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.live or ptr in inputs:
            return
        self.count += 1
        tid, size = f"t{self.count}", storage.nbytes()
        self.live[ptr] = tid
        self.trace.events.append(("malloc", tid, size))
        weakref.finalize(storage, self._free, ptr, tid, size)

    def _free(self, ptr: int, tid: str, size: int) -> None:
        if self.live.get(ptr) == tid:
            del self.live[ptr]
            self.trace.events.append(("free", tid, size))


def from_cuda_snapshot(snapshot: dict, device: int = 0, marker_stream: int = -1, labels: Sequence[str] = ()) -> Trace:
    """torch.cuda.memory._snapshot() after _record_memory_history(): allocator actions in order.
    The allocations on `marker_stream` are the marks `labels`, in order (profiler.CudaMarks)."""
    trace, ids, generation = Trace(), {}, {}
    marks = iter(labels)
    for e in snapshot["device_traces"][device]:
        if e["action"] not in ("alloc", "free_requested"):  # an "oom" entry has no address
            continue
        addr, size = e["addr"], e["size"]
        if e.get("stream") == marker_stream:
            if e["action"] == "alloc":
                trace.mark(next(marks))
        elif e["action"] == "alloc":
            generation[addr] = generation.get(addr, 0) + 1
            ids[addr] = f"{addr:x}.{generation[addr]}"
            trace.events.append(("malloc", ids[addr], size))
        elif e["action"] == "free_requested" and addr in ids:
            trace.events.append(("free", ids.pop(addr), size))
    missing = len(labels) - sum(kind == "mark" for kind, _, _ in trace.events)
    if missing:  # the history is a ring: an iteration longer than it loses its first entries
        raise ValueError(f"the allocator history lost {missing} of {len(labels)} window marks")
    return trace
