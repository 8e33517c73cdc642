"""MEMO in the trainer: wrap the layers, profile, choose alpha, plan memory -- all before training.

The profile iterations run on a synthetic micro-batch stream (random tokens, the run's shapes and
placement), so the data position stays untouched; every RNG stream they draw from is put back
after them (setup_memo), and the gradients they leave are zeroed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.longseq.collectives import all_reduce_values
from megatron.longseq.memo import allocator
from megatron.longseq.memo.alpha import HostMemoryError, block_bytes, check_fixed, solve_alpha
from megatron.longseq.memo.planner import bilevel_plan, load_plan_summary, saved_replay, stage_plan_path
from megatron.longseq.memo.profiler import (
    bandwidth, collector_off, mark_layer_windows, profile_sizes, trace_iteration)
from megatron.longseq.memo.runtime import Memo
from megatron.longseq.pipeline.seq1f1b import forward_backward_seq1f1b
from megatron.longseq.random import load_rng_state_dict, rng_state_dict
from megatron.training.data import random_batches
from megatron.training.metrics import print_rank_0
from megatron.training.model import unwrap
from megatron.training.validate_memo import KEPT_LAYERS, planned_for


def _agree(value: float, op, group) -> float:
    return all_reduce_values([value], op, group)[0]


def _refuse_together(step, refusal=HostMemoryError,
                     elsewhere="MEMO: another rank's plan exceeds its host memory budget"):
    """Run `step` (which may raise `refusal`) on every rank; if it raised on any, raise on all: a
    refusal must stop every rank before training, not leave the others waiting."""
    result, error = None, ""
    try:
        result = step()
    except refusal as err:
        error = str(err)
    if _agree(1.0 if error else 0.0, dist.ReduceOp.MAX, None):
        raise refusal(error or elsewhere)
    return result


def _window_labels(layers) -> set:
    return {f"{edge} {kind} L{layer.layer_number}" for layer in layers
            for edge in ("begin", "end") for kind in ("fwd", "bwd")}


def _saved_plan(path: str, layers) -> dict:
    """A saved plan for this stage's managed layers, or one line saying whose it is."""
    summary = load_plan_summary(path)
    foreign = sorted({label for label, _ in summary["replay"]["marks"]} - _window_labels(layers))
    if foreign:
        raise ValueError(f"--memo-plan: {path} was planned for other layers ({', '.join(foreign[:4])}"
                         f"{', ...' if len(foreign) > 4 else ''}): another model or pipeline stage; plan again")
    return summary


def wrap_model(state, alpha: float, device) -> tuple:
    """Memo over every model chunk's layers; the model's last two layers keep their activations
    (resident in the rounding buffers). Returns the runtime and the layers it manages."""
    buffer = state.optimizer.buffer
    memo = Memo(alpha, device, {buffer.param_data.untyped_storage().data_ptr()})
    layers = []
    for chunk in unwrap(state.model):
        keep = KEPT_LAYERS if chunk.post_process else 0
        memo.wrap(chunk.decoder.layers, keep_last=keep)
        layers += list(chunk.decoder.layers)[: max(len(chunk.decoder.layers) - keep, 0)]
    state.pipeline.unit_hooks = memo  # a stage without kept layers prefetches as a unit's backward begins
    return memo, layers


def profile_iteration(args, pgs, state, forward_step_func):
    """One iteration as the trainer runs it (every micro-batch, in Seq1F1B's segments), on the
    synthetic stream: what MEMO profiles and plans, here and in tools/plan_memory.py alike."""
    data = random_batches(args, pgs, seed=12345)

    def one_iteration():
        forward_backward_seq1f1b(forward_step_func=forward_step_func, data_iterator=data, model=state.model,
                                 num_microbatches=args.num_microbatches, micro_batch_size=args.micro_batch_size,
                                 p2p_communicator=state.pipeline)
    return one_iteration


def setup_memo(args, pgs, state, forward_step_func, device) -> Memo:
    """MEMO set up for the run: every RNG stream as it was before (the profile iterations draw
    attention dropout and the profiler's own inputs), so that the run is the one without --memo."""
    streams = rng_state_dict()
    try:
        return _setup_memo(args, pgs, state, forward_step_func, device)
    finally:
        load_rng_state_dict(streams)


def _setup_memo(args, pgs, state, forward_step_func, device) -> Memo:
    memo, layers = wrap_model(state, 1.0, device)
    one_iteration = profile_iteration(args, pgs, state, forward_step_func)
    path, saved = _reused_plan(args, pgs, layers)
    fixed = saved["planned_for"]["memo_swap_fraction"] if saved else None  # the alpha it was made for
    profile, choice, budget = choose_alpha(args, memo, one_iteration, layers, device, fixed)
    planned = allocator.INSTALLED
    memo.allocator = planned
    if planned is not None:  # from now on every managed layer's forward and backward is a window
        memo.window_handles = mark_layer_windows(layers, planned)
    if saved:
        print_rank_0(f"MEMO memory plan: reused {path} (peak {saved['peak_bytes'] / 2**20:.2f} MiB)")
        if planned is not None:
            planned.load(saved_replay(saved))
    elif planned is None and not args.memo_save_plan:
        # the caching allocator places tensors itself: a plan would cost an iteration under trace
        # and the solver's time (up to a minute) for a log line
        print_rank_0("MEMO memory plan: none made (--memo-allocator planned follows one, --memo-save-plan "
                     "writes one, tools/plan_memory.py draws one)")
    else:
        _plan_memory(args, pgs, memo, planned, _trace(one_iteration, layers, device, planned))
    if planned is not None:
        planned.settle()
    state.optimizer.zero_grad()
    memo.reset_stats()
    _report(memo, choice, profile, budget)
    return memo


def _reused_plan(args, pgs, layers) -> tuple:
    """(path, summary) of this stage's --memo-plan, or (None, None) without one."""
    if not args.memo_plan:
        return None, None
    path = stage_plan_path(args.memo_plan, pgs.index("pp"), pgs.size("pp"))
    return path, _refuse_together(lambda: _saved_plan(path, layers), ValueError,
                                  "--memo-plan: another pipeline stage's plan is not its own")


def _plan_memory(args, pgs, memo, planned, trace) -> None:
    """Plan `trace` (one iteration's); save the plan (--memo-save-plan), have the planned
    allocator follow it."""
    plan = bilevel_plan(trace, args.memo_planner, time_limit=30.0)
    if args.memo_save_plan and pgs.index("tp") == pgs.index("dp_cp") == 0:  # one writer per stage
        path = stage_plan_path(args.memo_save_plan, pgs.index("pp"), pgs.size("pp"))
        plan.save(path, planned_for(args, memo.alpha))
    print_rank_0(_plan_line(plan.summary()))
    if planned is not None:
        size = planned.load(plan.replay)
        print_rank_0(f"MEMO planned allocator: arena {size / 2**20:.2f} MiB, {len(plan.replay.sizes)} requests "
                     f"and {len(plan.replay.marks)} window marks an iteration")


def choose_alpha(args, memo, run, layers, device, fixed=None):
    """Profile an iteration (`run`), then the swap fraction: `fixed`, else --memo-swap-fraction's,
    else the LP's (section 4.1); agreed across ranks, with the rounding buffers and host pool
    allocated for it. Returns (profile, the LP's choice, the host budget in bytes)."""
    # Every rank runs the profile iteration, also a stage that manages no layer (the last stage
    # keeps its last two layers on the device): the iteration passes activations along.
    profile, sizes = profile_sizes(memo, run, layers, device)
    budget = args.memo_host_memory_gb * 2**30
    if fixed is None and args.memo_swap_fraction != "auto":
        fixed = float(args.memo_swap_fraction)
    # refused on every rank before any host memory is taken
    _refuse_together(lambda: profile and check_fixed(profile, memo.peak_live, budget))
    choice = _refuse_together(lambda: profile and solve_alpha(
        profile, bandwidth(device, limit=budget), memo.peak_live, budget, fixed))
    # tp ranks must recompute the same token rows; stages agree too, so the log tells one alpha
    memo.alpha = _agree(choice.alpha if choice else 1.0, dist.ReduceOp.MIN, None)
    if profile is not None:  # the block holds the agreed alpha's bytes: no more than the choice's
        memo.allocate(max(s.buffer_bytes for s in sizes), memo.peak_live, block_bytes(profile, memo.alpha))
    return profile, choice, budget


def _trace(one_iteration, layers, device, planned):
    """One iteration's allocation trace with the layer windows marked: recorded by the planned
    allocator when it is installed (it sees every request and every window), else by the
    profiler (CPU tracer; on GPU torch's history, without windows)."""
    if planned is None:
        return trace_iteration(one_iteration, layers, device)
    with collector_off():  # as the profiler's trace: no frees at moments a later replay will not repeat
        planned.record(True)
        try:
            one_iteration()
            torch.cuda.synchronize(device)
        finally:
            planned.record(False)
    return planned.recorded_trace()


def _plan_line(s: dict) -> str:
    level1 = ", ".join(sorted({v["solver"] for v in s["level1"].values()})) or "-"
    return (f"MEMO memory plan: level 1 {level1}, level 2 {s['level2']['solver']}; peak "
            f"{s['peak_bytes'] / 2**20:.2f} MiB, lower bound {s['lower_bound_bytes'] / 2**20:.2f} MiB "
            f"(+{100 * s['gap']:.1f}%)")


def _report(memo, choice, profile, budget):
    mib, gib = 2**20, 2**30
    if choice is not None:
        print_rank_0(
            f"MEMO: alpha {memo.alpha:.3f} ({choice.bound_by if choice.alpha == memo.alpha else 'agreed across ranks'}); "
            f"per layer: input {profile.input_bytes / mib:.1f} MiB, attention {profile.attention_bytes / mib:.1f} MiB, "
            f"other {profile.other_bytes / mib:.1f} MiB, forward {profile.forward_seconds * 1e3:.2f} ms; predicted "
            f"offload {choice.offload_seconds * 1e3:.2f} ms/layer, overlap {100 * choice.overlap:.0f}%; host memory "
            f"{choice.host_bytes / mib:.1f} MiB of {budget / gib:.2f} GiB")
