"""MEMO's three streams and the host memory it pins.

`Streams` is the runtime's only contact with streams and events: compute (torch's current
stream), offload (device to host) and prefetch (host to device). On CUDA the side streams are real
and copies are non-blocking; on CPU every copy runs at once and events order nothing. Either way,
when given a `log` list, every event record, wait, copy and buffer access is appended to it, so a
CPU test can check the schedule a GPU would run (tests/unit_tests/memo/schedule.py).

Host memory: every byte MEMO pins goes through `host_empty`, which counts what is held now and
the peak, so the budget (--memo-host-memory-gb) can be checked against what was really taken.
"""
from __future__ import annotations

import contextlib
import mmap
import weakref
from typing import List, Optional, Tuple

import torch

SIDE = ("offload", "prefetch")
Event = Tuple[int, Optional[torch.cuda.Event]]  # (sequence number, the CUDA event or None)

HOST = {"now": 0, "peak": 0}  # bytes of host memory MEMO holds (pinned on GPU)


def _give_back(nbytes: int, pinned_at: Optional[int]) -> None:
    if pinned_at is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned_at)
    HOST["now"] -= nbytes


def host_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory (pinned when `pin`), counted until the tensor is freed. Pinned by
    registering plain memory with CUDA, not through torch's pinned allocator: that one rounds every
    request up to a power of two and keeps freed blocks, so a pool and a budget counted in bytes
    asked for would pin up to twice as much and keep it.

    The memory is a mapping of its own that forked processes do not inherit (MADV_DONTFORK): Linux
    copies pages pinned for DMA into a child at fork instead of sharing them, so every data-loader
    worker started after MEMO pinned its pool would copy all of it (on an H100, 7B-shaped layers at
    64K tokens: a 21 GiB pool, and set-up, stuck where the loader starts its workers, did not end
    within 133 s; without the copies it ended in 84 s)."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes)  # anonymous, page-aligned; the tensor keeps it mapped
    region.madvise(mmap.MADV_DONTFORK)
    t = torch.frombuffer(region, dtype=torch.uint8)
    pinned_at = None
    if pin:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"MEMO: cannot pin {nbytes} bytes of host memory (cudaHostRegister error {int(rc)})")
        pinned_at = t.data_ptr()
    HOST["now"] += nbytes
    HOST["peak"] = max(HOST["peak"], HOST["now"])
    weakref.finalize(t, _give_back, nbytes, pinned_at)
    return t


def reset_host_peak() -> None:
    HOST["peak"] = HOST["now"]


class Streams:
    def __init__(self, device: torch.device, log: Optional[List[tuple]] = None):
        self.device, self.log = device, log
        self.cuda = device.type == "cuda"
        self.side = {name: torch.cuda.Stream(device) for name in SIDE} if self.cuda else {}
        self.recorded = 0

    def _stream(self, name: str):
        return torch.cuda.current_stream(self.device) if name == "compute" else self.side[name]

    def _note(self, *entry) -> None:
        if self.log is not None:
            self.log.append(entry)

    def event(self, name: str) -> Event:
        """An event at the current end of stream `name`."""
        self.recorded += 1
        cuda_event = None
        if self.cuda:
            cuda_event = torch.cuda.Event()
            cuda_event.record(self._stream(name))
        self._note("record", name, self.recorded)
        return self.recorded, cuda_event

    def wait(self, name: str, event: Optional[Event]) -> None:
        """Work queued on `name` from now on runs after `event` (None: nothing to wait for)."""
        if event is None:
            return
        if self.cuda:
            self._stream(name).wait_event(event[1])
        self._note("wait", name, event[0])

    def copy(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(name)) if self.cuda else contextlib.nullcontext():
            dst.copy_(src, non_blocking=self.cuda)

    def access(self, op: str, name: str, buffer, owner: int) -> None:
        """For the log: stream `name` reads or writes `buffer` (a rounding buffer's index, or
        ("host", block)) for layer `owner`."""
        self._note(op, name, buffer, owner)
