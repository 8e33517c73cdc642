"""Megatron's rerun state machine (--rerun-mode): is a bad result the hardware's fault?

An iteration whose results fail a check (a NaN or infinite loss; a spiky one with
--check-for-spiky-loss) runs again, in place, on the same micro-batches and RNG streams, before the
optimizer steps. What happens next is Megatron's (same decisions, same exit codes):

  first run rejected -> run again in place
      result differs     -> a transient fault. Fatal check: checkpoint, exit 17; else go on
      result reproduced  -> fatal check: checkpoint, exit 16 (resume on other hardware); else go on
  resumed from that checkpoint, the iteration runs once more
      same node and device -> exit 16 again (no checkpoint)
      result differs     -> a persistent fault of the first hardware: exit 17
      result reproduced  -> the result is right (an application problem): exit 17
  (a non-fatal check goes on instead of exiting; the rerun's gradients are used)

The checkpoint holds the state before the failed iteration (RNG streams rewound to its start), so a
resumed run repeats it exactly, and every rank's machine state. The first iteration of a run is not
re-run (nothing to checkpoint before a step): a fatal rejection there stops the run, as
--rerun-mode disabled does on every iteration.

The checks are Megatron's: each micro-batch's loss (NaN, Inf; spiky with --check-for-spiky-loss)
and each rank's gradient norm (NaN, Inf), all under
--check-for-nan-in-loss-and-grad but the spiky one. Under --rerun-mode disabled a fatal rejection
stops the run and a spiky loss is logged.

--rerun-mode report_stats runs every iteration twice and reports the relative difference of each
checked value (how deterministic the run is); unlike Megatron's, it still stops on a NaN or Inf (a
run that goes on from one trains on nothing). --error-injection-rate N marks one check in N on each
rank as rejected, as Megatron's injector does; --error-injection-type says how the reruns then
compare: transient_error differs in place, persistent_error differs on other hardware,
correct_result agrees on both.

The decisions are pure (RerunMachine, given `any_rank`, the all-reduce of flags over the world,
and `where`, this rank's node and device); train_step drives them.
"""
from __future__ import annotations

import math
import os
import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.longseq.random import load_rng_state_dict, rng_state_dict

EXIT_RESUME_ELSEWHERE = 16  # Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_FAILED_VALIDATION = 17  # Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
SPIKY_LOSS_FACTOR = 10  # a loss >= 10x the largest of the first 100 is spiky (Megatron's pretrain_gpt)
SPIKY_SAMPLES = 100

# phases of one iteration (Megatron's RerunState)
IDLE, FIRST, IN_PLACE, WILL_RESUME, FROM_CHECKPOINT, AGAIN_FROM_CHECKPOINT = (
    "idle", "first run", "rerun in place", "will rerun from checkpoint", "rerun from checkpoint",
    "rerun again from checkpoint")
# a rank's verdict after a rerun
GO_ON, CHECKPOINT, STOP, AGAIN = "go on", "checkpoint", "stop", "again"

Call = Tuple[str, int]  # (check, its n-th call in the iteration)


def relative_difference(a: float, b: float) -> float:
    """0 when equal (two NaNs are equal); inf when only one is finite or they differ in kind."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs((a + b) / 2) if a + b else math.inf


class Injector:
    """Megatron's error injector: on the first run, a check call is rejected when
    (r + rank) % rate == 0 for r uniform in [0, rate), at most once per iteration; the injected
    type then decides how the reruns compare. r is drawn from (seed, iteration, call) alone: the
    training streams stay untouched, and a run resumed from a checkpoint draws what the
    uninterrupted run drew (no generator state to save)."""

    def __init__(self, rate: int, kind: str, rank: int, seed: int):
        self.rate, self.kind, self.rank, self.seed = rate, kind, rank, seed
        self.pending: Optional[str] = None  # the type injected and not yet judged

    def inject(self, iteration: int, call: Tuple[str, int]) -> bool:
        if self.rate <= 0 or self.pending is not None:
            return False
        draw = random.Random(f"{self.seed}:{iteration}:{call[0]}:{call[1]}").randrange(self.rate)
        if (draw + self.rank) % self.rate:
            return False
        self.pending = self.kind
        return True

    def differs(self, phase: str) -> bool:
        """How the rerun in `phase` compares for the pending injection: a transient error differs
        in place, a persistent one on other hardware; the injection is judged where it differs,
        or on other hardware at the latest."""
        kind, differing = self.pending, "transient_error" if phase == IN_PLACE else "persistent_error"
        if kind == differing or phase != IN_PLACE:
            self.pending = None
        return kind == differing


@dataclass
class Failure:
    call: Call
    value: float
    injected: bool


class SpikeDetector:
    """The largest |value| of the first SPIKY_SAMPLES is the yardstick; later values at or above
    SPIKY_LOSS_FACTOR times it are spiky (Megatron's is_unexpectedly_large)."""

    def __init__(self):
        self.seen, self.largest = 0, 0.0

    def __call__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False  # NaN and Inf have their own checks
        if self.seen < SPIKY_SAMPLES:
            self.seen, self.largest = self.seen + 1, max(self.largest, abs(value))
            return False
        return abs(value) >= SPIKY_LOSS_FACTOR * self.largest


@dataclass(frozen=True)
class Check:
    name: str
    reject: Callable[[float], bool]
    fatal: bool


def loss_checks(nan: bool, spiky: bool) -> List[Check]:
    """Megatron's pretrain_gpt checks on each micro-batch's loss: NaN and Inf (fatal, with
    --check-for-nan-in-loss-and-grad), spiky (not fatal, with --check-for-spiky-loss)."""
    checks = [Check("loss is NaN", math.isnan, True), Check("loss is Inf", math.isinf, True)] if nan else []
    return checks + ([Check("Spiky loss", SpikeDetector(), False)] if spiky else [])


# megatron-core's checks on a rank's gradient norm (per bucket there, before the data-parallel
# reduction): fatal. Its tolerance of 1e-3 changes nothing for them: a rejected norm is NaN or Inf,
# and a rerun's is then the same (reproduced) or finite (an infinite relative difference).
GRAD_CHECKS = (Check("grad norm is NaN", math.isnan, True), Check("grad norm is Inf", math.isinf, True))


class Replay:
    """An iteration's micro-batches, kept so that the iteration can run again on the same data."""

    def __init__(self, iterator: Iterator):
        self.iterator, self.taken, self.at = iterator, [], 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.at == len(self.taken):
            self.taken.append(next(self.iterator))
        self.at += 1
        return self.taken[self.at - 1]

    def rewind(self) -> None:
        self.at = 0

    def advance(self) -> None:
        self.taken, self.at = [], 0


class RerunMachine:
    """One per rank. train_step asks `should_run` before each forward-backward, calls `validate`
    for each checked value, and asks `outcome` before the optimizer step."""

    def __init__(self, mode: str, injector: Injector, any_rank: Callable[[List[bool]], List[bool]],
                 where: Tuple[str, int], checks: Sequence["Check"] = (), log: Callable[[str], None] = print,
                 say: Callable[[str], None] = print):
        """`log` speaks for this rank (its checks), `say` once for all (the decisions)."""
        self.mode, self.injector, self.any_rank, self.where = mode, injector, any_rank, where
        self.checks = list(checks)
        self.log, self.say = log, say
        self.phase, self.first_done, self.iteration = IDLE, False, 0
        self.failure: Optional[Failure] = None  # this rank's first rejected call of the iteration
        self.verdict: Optional[str] = None
        self.suspect: Optional[Tuple[str, int]] = None  # the node and device that reproduced it
        self.calls: Counter = Counter()
        self.snapshot = None
        self.first_values: Dict[int, float] = {}  # report_stats: the first run's values
        self.differences: List[float] = []  # report_stats: first run vs rerun, relative

    # ---- the loop ------------------------------------------------------------------------------
    def should_run(self, data: Optional[Replay], iteration: int) -> bool:
        """Whether to run the iteration's forward-backward (again)."""
        self.calls = Counter()
        step = {IDLE: self._start, FIRST: self._after_first, IN_PLACE: self._after_in_place,
                WILL_RESUME: self._resumed, FROM_CHECKPOINT: self._after_from_checkpoint}[self.phase]
        return step(data, iteration)

    def _start(self, data, iteration) -> bool:
        self.iteration, self.failure, self.verdict, self.first_values = iteration, None, None, {}
        if self.mode != "disabled":
            self.snapshot = rng_state_dict()
            if data is not None:
                data.advance()
        self.phase = FIRST
        return True

    def _after_first(self, data, iteration) -> bool:
        wanted = self.mode == "report_stats" or self.failure is not None
        if self.mode == "disabled" or not self.any_rank([wanted])[0]:
            self.phase = IDLE
            return False
        if self.mode == "validate_results":
            self.say(f"rerun: iteration {iteration} failed a check; running it again in place")
        self._rewind(data)
        self.phase = IN_PLACE
        return True

    def _after_in_place(self, data, iteration) -> bool:
        if self.mode == "report_stats":
            self.phase = IDLE
            return False
        go_on, checkpoint = self.any_rank([self.verdict == GO_ON, self.verdict == CHECKPOINT])
        if go_on:
            self.say("rerun: the failed check was not fatal; continuing")
            self.phase = IDLE
            return False
        if checkpoint:
            self.phase = WILL_RESUME
        self._rewind(data)  # the checkpoint holds the iteration's start
        return False

    def _resumed(self, data, iteration) -> bool:
        self.iteration, self.verdict = iteration, None
        self.phase = FROM_CHECKPOINT
        return True

    def _after_from_checkpoint(self, data, iteration) -> bool:
        again, go_on = self.any_rank([self.verdict == AGAIN, self.verdict == GO_ON])
        if again:
            self.say("rerun: resumed on the node and device that reproduced the result; resume elsewhere")
            self.phase = AGAIN_FROM_CHECKPOINT
        elif go_on:
            self.say("rerun: the failed check was not fatal; continuing")
            self.phase = IDLE
        return False

    def outcome(self) -> Tuple[bool, int]:
        """(save a checkpoint, exit status or 0), after the runs of an iteration."""
        self.first_done = True
        return {IN_PLACE: (True, EXIT_FAILED_VALIDATION), WILL_RESUME: (True, EXIT_RESUME_ELSEWHERE),
                FROM_CHECKPOINT: (False, EXIT_FAILED_VALIDATION),
                AGAIN_FROM_CHECKPOINT: (False, EXIT_RESUME_ELSEWHERE)}.get(self.phase, (False, 0))

    def _rewind(self, data) -> None:
        load_rng_state_dict(self.snapshot)
        if data is not None:
            data.rewind()

    # ---- the checks ----------------------------------------------------------------------------
    def validate(self, values: Sequence[float], tolerance: float = 0.0, checks: Optional[Sequence[Check]] = None):
        """Every check (the machine's loss checks unless given) on every value, in order (one call
        each). Tolerance 0, as Megatron's loss checks: a rerun on the same data and streams is
        bitwise the same unless something broke."""
        for value in values:
            if self.mode == "report_stats":
                self.calls["value"] += 1
                self._record(self.calls["value"], value)
            for check in self.checks if checks is None else checks:
                self._validate(value, check, tolerance)

    def _validate(self, value: float, check: Check, tolerance: float) -> None:
        self.calls[check.name] += 1
        call = (check.name, self.calls[check.name])
        if self.mode != "validate_results" or (self.phase == FIRST and not self.first_done):
            self._unjudged(value, check)
            return
        if self.phase == FIRST and self.failure is None:
            self._first(call, value, check)
        elif self.phase in (IN_PLACE, FROM_CHECKPOINT) and self.failure and call == self.failure.call:
            differs = (self.injector.differs(self.phase) if self.failure.injected
                       else relative_difference(self.failure.value, value) > tolerance)
            self.verdict = self._judge(differs, check, value)

    def _unjudged(self, value: float, check: Check) -> None:
        """A run no rerun judges (--rerun-mode disabled or report_stats, or a run's first
        iteration): a fatal rejection stops it, a non-fatal one is logged (Megatron's disabled
        mode). Under validate_results the first iteration feeds no detector: Megatron's spiky-loss
        yardstick starts with the second, past the start-up's losses."""
        if self.phase != FIRST or (self.mode == "validate_results" and not check.fatal):
            return
        if check.reject(value):
            if check.fatal:
                raise FloatingPointError(f"{check.name} ({value}) at iteration {self.iteration}")
            self.log(f"rerun: {check.name} ({value}) at iteration {self.iteration}: not rerun "
                     f"(--rerun-mode {self.mode})")

    def _record(self, i: int, value: float) -> None:
        if self.phase == FIRST:
            self.first_values[i] = value
        else:
            self.differences.append(relative_difference(self.first_values[i], value))

    def _first(self, call: Call, value: float, check: Check) -> None:
        injected = self.injector.inject(self.iteration, call)
        if injected or check.reject(value):
            self.failure = Failure(call, value, injected)
            self.log(f"rerun: {check.name} ({value}{', injected' if injected else ''}) at iteration "
                     f"{self.iteration}, call {call[1]}")

    def _judge(self, differs: bool, check: Check, value: float) -> str:
        seen = f"({value} vs {self.failure.value} first)"
        if self.phase == IN_PLACE:
            if differs:
                self.log(f"rerun: not reproducible in place {seen}: possible transient error")
                return STOP if check.fatal else GO_ON
            self.suspect = self.where
            self.log(f"rerun: reproducible in place {seen}: needs a rerun on other hardware")
            return CHECKPOINT if check.fatal else GO_ON
        if self.where == self.suspect:
            return AGAIN
        self.log(f"rerun: {'not ' if differs else ''}reproducible on other hardware {seen}: "
                 + ("possible persistent error of the first" if differs else
                    "the result is right (possible application error)"))
        return STOP if check.fatal else GO_ON

    # ---- reporting and checkpoints -------------------------------------------------------------
    def stats(self) -> Tuple[int, float]:
        """report_stats: (values compared, largest relative difference) since the last call."""
        out = (len(self.differences), max(self.differences, default=0.0))
        self.differences = []
        return out

    def state_dict(self) -> Optional[dict]:
        """What a resumed run needs (None when nothing is pending)."""
        if self.phase != WILL_RESUME:
            return None
        # the value as text: a NaN is not equal to itself, and torch_dist compares the common state
        # of the ranks (a NaN there reads as ranks that disagree)
        failure = (self.failure.call, repr(self.failure.value), self.failure.injected) if self.failure else None
        return {"phase": self.phase, "iteration": self.iteration, "failure": failure,  # plain values only
                "suspect": self.suspect, "pending_injection": self.injector.pending}

    def load_state_dict(self, state: dict) -> None:
        self.phase, self.iteration = state["phase"], state["iteration"]
        if state["failure"]:
            call, value, injected = state["failure"]
            self.failure = Failure(tuple(call), float(value), injected)
        else:
            self.failure = None
        self.suspect, self.injector.pending = state["suspect"], state["pending_injection"]


def gathered_states(machine: Optional[RerunMachine]) -> Optional[list]:
    """Every rank's machine state, for a checkpoint; None when no rank has one pending (the
    phases are the same on all ranks, so all skip the gather together)."""
    if machine is None or machine.state_dict() is None:
        return None
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, machine.state_dict())
    return states


def restore_states(machine: Optional[RerunMachine], states: Optional[list], log=print) -> None:
    """This rank's entry of a checkpoint's states (a run of another world size cannot repeat the
    iteration rank by rank: it trains on, as from any checkpoint)."""
    if machine is None or not states:
        return
    why = (f"--rerun-mode {machine.mode}" if machine.mode != "validate_results" else
           "another world size" if len(states) != dist.get_world_size() else None)
    if why:  # only validate_results judges the repeated iteration
        log(f"rerun: the checkpoint asks to rerun iteration {states[0]['iteration']} on {len(states)} ranks; "
            f"ignored ({why})")
        return
    machine.load_state_dict(states[dist.get_rank()])


def this_device(device) -> Tuple[str, int]:
    """(node, device index): what "other hardware" is compared by."""
    index = device.index if device.type == "cuda" and device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
    return os.uname()[1], index
