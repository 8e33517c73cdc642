"""Stopping before the job's time limit does (Megatron's flags): --exit-interval,
--exit-duration-in-mins and --exit-signal-handler. A job killed by its scheduler loses the work done
since its last checkpoint; one that stops itself saves (with --save) and exits 0.

Every rank must stop after the same iteration: one that stops alone leaves the others waiting in
a collective. An interval needs no agreement (every rank counts the same iterations), but a clock
and a signal do: each rank's clock runs on its own, and a signal may reach some ranks only (a
`kill` of one process; a launcher forwarding it to its workers one by one). So after every
iteration one all-reduce (MAX over the world) decides for all: stop if any rank's clock has
passed the duration or any rank has got the signal.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

import torch.distributed as dist

from megatron.longseq.collectives import all_reduce_values


class ExitWatch:
    """The run's exit conditions. install() at start-up catches the signal (its arrival is only
    noted: the iteration under way finishes); reason() after every iteration, on every rank."""

    def __init__(self, args, start: float):
        self.interval, self.minutes = args.exit_interval, args.exit_duration_in_mins
        self.start = start  # time.perf_counter() at launch
        self.signum = signal.Signals[args.exit_signal] if args.exit_signal_handler else None
        self.received = False
        self._previous = None

    def install(self) -> None:
        if self.signum is not None:
            self._previous = signal.signal(self.signum, self._note)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def _note(self, signum, frame) -> None:
        self.received = True

    def reason(self, iteration: int) -> Optional[str]:
        """Why every rank stops after this iteration, or None to go on."""
        if self.interval and iteration % self.interval == 0:
            return f"at iteration {iteration}"
        why = self.urgent()
        return why and f"{why} at iteration {iteration}"

    def urgent(self) -> Optional[str]:
        """The clock or the signal, agreed by every rank (also between evaluation iterations, as
        Megatron checks the time there: a long evaluation must not run past the save)."""
        if self.minutes is None and self.signum is None:
            return None  # nothing to agree on: no collective
        late, caught = self._vote(self.minutes is not None and self.elapsed_minutes() > self.minutes)
        if late:
            return f"after {self.minutes:g} minutes (--exit-duration-in-mins)"
        if caught:
            return f"on {self.signum.name}"
        return None

    def elapsed_minutes(self) -> float:
        return (time.perf_counter() - self.start) / 60

    def _vote(self, late: bool):
        """(any rank late, any rank signalled)."""
        flags = all_reduce_values([late, self.received], op=dist.ReduceOp.MAX)
        return tuple(bool(f) for f in flags)
