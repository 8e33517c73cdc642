"""Wall-clock timers with Megatron's log levels, min/max across ranks."""
from __future__ import annotations

import time
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.longseq.collectives import all_reduce_values


class Timer:
    def __init__(self, sync: bool):
        self.sync = sync
        self.elapsed_s = 0.0
        self._start = None

    def start(self):
        if self.sync:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def stop(self):
        if self.sync:
            torch.cuda.synchronize()
        self.elapsed_s += time.perf_counter() - self._start
        self._start = None

    def read(self, reset: bool) -> float:
        value = self.elapsed_s
        if reset:
            self.elapsed_s = 0.0
        return value


class Timers:
    """timers(name, level) returns a timer; timers above --timing-log-level are no-ops."""

    class _Null:
        def start(self):
            pass

        def stop(self):
            pass

    def __init__(self, log_level: int, cuda: bool):
        self.log_level, self.cuda = log_level, cuda
        self.timers: Dict[str, Timer] = {}

    def __call__(self, name: str, level: int = 0):
        """The first call fixes the timer's level; later calls (stop) return the same timer."""
        if name not in self.timers:
            self.timers[name] = Timer(self.cuda) if level <= self.log_level else self._Null()
        return self.timers[name]

    def per_rank(self, names: List[str], reset: bool = True) -> Dict[str, List[float]]:
        """Elapsed ms of each timer since the last reset on every rank, in rank order (one
        all-reduce of a world-long vector per timer: --timing-log-option all)."""
        names = [n for n in names if isinstance(self.timers.get(n), Timer)]
        values = [self.timers[n].read(reset) * 1000.0 for n in names]
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        grid = [0.0] * (world * len(names))  # [world x timers], row-major: this rank fills its row
        grid[rank * len(names) : (rank + 1) * len(names)] = values
        if names and world > 1:
            grid = all_reduce_values(grid, dist.ReduceOp.SUM)
        return {n: grid[i :: len(names)] for i, n in enumerate(names)}

    def min_max(self, names: List[str], reset: bool = True) -> Dict[str, tuple]:
        """Elapsed ms of each timer since the last reset, as (min, max) over all ranks."""
        names = [n for n in names if isinstance(self.timers.get(n), Timer)]
        if not names:
            return {}
        values = [self.timers[n].read(reset) * 1000.0 for n in names]
        if dist.is_initialized() and dist.get_world_size() > 1:
            lo = all_reduce_values(values, dist.ReduceOp.MIN)
            hi = all_reduce_values(values, dist.ReduceOp.MAX)
            return {n: (a, b) for n, a, b in zip(names, lo, hi)}
        return {n: (v, v) for n, v in zip(names, values)}
