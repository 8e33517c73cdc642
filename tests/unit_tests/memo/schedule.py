"""The schedule a GPU would run, checked from MEMO's stream log (memo/streams.py).

Each stream runs its entries in order; a wait on an event orders everything after it behind
everything its stream had before the record. Happens-before is tracked with vector clocks. The
rules, for every rounding buffer:
  - a read of layer X's contents happens after the write of them (no compute op reads a buffer
    before its copy is done; no offload copies what is not staged yet);
  - a write for layer Y happens after every earlier access for another layer (no copy overwrites
    a buffer before its last reader is done).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List


@dataclass
class Access:
    op: str
    stream: str
    buffer: int
    owner: int
    position: int  # in the log
    stamp: int  # its stream's own clock
    seen: Dict[str, int]  # what it has waited for: stream -> clock


class ScheduleError(AssertionError):
    pass


def accesses(log: List[tuple]) -> List[Access]:
    clocks: Dict[str, Dict[str, int]] = {}
    events: Dict[int, Dict[str, int]] = {}
    out = []
    for position, entry in enumerate(log):
        kind = entry[0]
        clock = clocks.setdefault(entry[1], {})
        if kind == "wait":
            for stream, count in events[entry[2]].items():
                clock[stream] = max(clock.get(stream, 0), count)
            continue
        clock[entry[1]] = clock.get(entry[1], 0) + 1
        if kind == "record":
            events[entry[2]] = dict(clock)
        else:
            out.append(Access(kind, entry[1], entry[2], entry[3], position, clock[entry[1]], dict(clock)))
    return out


def before(a: Access, b: Access) -> bool:
    return b.seen.get(a.stream, 0) >= a.stamp


def check(log: List[tuple]) -> List[Access]:
    """Raise ScheduleError at the first race; return the accesses."""
    done = accesses(log)
    for i, b in enumerate(done):
        earlier = [a for a in done[:i] if a.buffer == b.buffer]
        if b.op == "read":
            writes = [a for a in earlier if a.op == "write" and a.owner == b.owner]
            if not writes or not before(writes[-1], b):
                raise ScheduleError(f"{b.stream} reads buffer {b.buffer} of layer {b.owner} before its copy")
        else:
            for a in earlier:
                if a.owner != b.owner and not before(a, b):
                    raise ScheduleError(f"{b.stream} writes buffer {b.buffer} for layer {b.owner} before "
                                        f"{a.stream}'s {a.op} for layer {a.owner} is done")
    return done
