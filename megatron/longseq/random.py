"""Device-agnostic RNG streams and activation recompute that replays them.

Dropout inside tensor-parallel regions (attention heads are split over tp) must draw different
masks on different tp ranks, while dropout on replicated activations must draw the same mask on
all of them. As in Megatron, the default generator is seeded identically across tp ranks and a
named extra stream ("model-parallel-rng", seed + 2718 + tp rank) is forked for the tp regions.
megatron-core's tracker keeps CUDA states only; this one keeps the state of whatever device the
run is on, so the same code serves CPU and GPU.
"""
from __future__ import annotations

import contextlib
import random
from typing import Dict, Optional

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    def __init__(self, device: torch.device):
        self.device = device
        self.states: Dict[str, torch.Tensor] = {}
        self.active: Optional[str] = None  # the stream a fork has made the device's generator

    def is_initialized(self) -> bool:
        """megatron-core's question (Transformer Engine's layers ask it): seeded yet?"""
        return bool(self.states)

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name} already exists")
        saved = _get_state(self.device)
        torch.manual_seed(seed) if self.device.type != "cuda" else torch.cuda.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream `name`; the default stream is left untouched. Inside a fork of
        the same stream (megatron-core forks it around a whole sequence-parallel block) the block
        goes on drawing from it: a second switch would replay the draws from the stream's start."""
        if name not in self.states:
            raise RuntimeError(f"RNG stream {name!r} is not seeded; call seed_everything() first")
        if self.active == name:
            yield
            return
        saved, outer = _get_state(self.device), self.active
        _set_state(self.device, self.states[name])
        self.active = name
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, saved)
            self.active = outer

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER: RNGTracker = RNGTracker(torch.device("cpu"))


def get_rng_tracker() -> RNGTracker:
    return _TRACKER


def seed_everything(seed: int, tp_rank: int, device: torch.device) -> None:
    """Megatron's seeding: python/numpy/torch default streams get `seed` (same on all tp ranks
    of a pipeline stage; the caller adds 100 x pp rank), the tp stream seed + 2718 + tp rank."""
    global _TRACKER
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    _TRACKER = RNGTracker(device)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    # megatron-core's other two streams, unused by a dense GPT: a checkpoint's tracker states are
    # then the set Megatron-LM's tracker expects when it loads them (its set_states replaces all).
    _TRACKER.add(DATA_PARALLEL_RNG, seed)
    _TRACKER.add(EXPERT_PARALLEL_RNG, seed + 1024 + tp_rank)  # expert rank 0, expert-tp rank = tp rank
    _serve_megatron_core(_TRACKER)


def _serve_megatron_core(tracker: RNGTracker) -> None:
    """megatron-core's modules fork *its* tracker (tensor_parallel.get_cuda_rng_tracker()) around
    sequence-parallel regions -- the whole transformer block, the embedding's dropout -- and raise
    on an unseeded one. This tracker is made megatron-core's as well (the module-level instance its
    getter returns), so one set of streams is seeded, checkpointed and replayed by recompute."""
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def rng_state_dict() -> dict:
    """Every stream a run draws from, for exact resume, under Megatron's checkpoint keys (its
    loader reads them): the tracker's streams are this device's generator states."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": _TRACKER.get_states(),
    }
    if _TRACKER.device.type == "cuda":
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def load_rng_state_dict(state: dict) -> None:
    """The host streams always; the device's (the CUDA state, the tracker's streams) only when the
    state was written on the same kind of device: a CUDA generator state cannot drive the CPU's
    generator, so a run on the other kind keeps the streams it seeded."""
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    written_on_cuda = state.get("cuda_rng_state") is not None
    if written_on_cuda != (_TRACKER.device.type == "cuda"):
        return
    if written_on_cuda:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    _TRACKER.set_states(state["rng_tracker_states"])


class CheckpointRegion:
    """One recompute region: its phase ("forward", then "recompute" in backward) and what it keeps
    between the two -- the attention outputs that Selective Checkpoint++ does not recompute
    (LoongTrain section 5.2), taken back in the order they were kept."""

    def __init__(self):
        self.phase = None
        self.kept = []


_REGION: Optional[CheckpointRegion] = None


def current_region() -> Optional[CheckpointRegion]:
    """The innermost recompute region running now, or None."""
    return _REGION


def saved_tensors_dropped() -> bool:
    """Whether autograd lets go of what the forward running now saves: grad off (an evaluation,
    a custom Function's forward -- MEMO's kept attention -- or a reentrant recompute) or inside
    a recompute region (saved tensors are recomputed, not kept)."""
    return not torch.is_grad_enabled() or _REGION is not None


@contextlib.contextmanager
def _in_region(region: CheckpointRegion, phase: str):
    global _REGION
    previous, _REGION, region.phase = _REGION, region, phase
    try:
        yield
    finally:
        _REGION = previous


@contextlib.contextmanager
def _replaying(tracker_states, active: Optional[str]):
    """The recompute runs from the named-stream states the forward started with, inside the fork
    the forward ran in; the states the forward ended with are put back afterwards (torch replays
    the default streams itself, which a fork had made the named stream)."""
    tracker = get_rng_tracker()
    after_forward, outer = tracker.get_states(), tracker.active
    tracker.set_states(tracker_states)
    tracker.active = active
    try:
        yield
    finally:
        tracker.set_states(after_forward)
        tracker.active = outer


def _contexts():
    tracker = get_rng_tracker()
    region, at_forward, active = CheckpointRegion(), tracker.get_states(), tracker.active

    @contextlib.contextmanager
    def recompute():
        with _replaying(at_forward, active), _in_region(region, "recompute"):
            yield

    return _in_region(region, "forward"), recompute()


def checkpoint(function, *args, **kwargs):
    """Activation recompute: keep only the inputs of `function`; rerun it in backward with the
    same random streams, so dropout masks match and gradients are exact."""
    return torch_checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_contexts, **kwargs,
    )
