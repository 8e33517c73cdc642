"""Megatron's pretrain(): set-up, the training loop, evaluation, checkpoints, logging."""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config
from megatron.longseq.attention.kernel_choice import KernelEnv, choose_kernel
from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.pipeline.p2p import connect_links
from megatron.longseq.pipeline.seq1f1b import Pipeline, forward_backward_seq1f1b
from megatron.training.arguments import ArgsError, parse
from megatron.training import dist_ckpt
from megatron.training.checkpoint_args import checkpoint_settings
from megatron.training.checkpointing import (
    SCHEDULE, TRACKER, CheckpointError, carry_model_card, check_args, check_schedule, checkpoint_format,
    load_checkpoint, loaded_checkpoint, loads_schedule, recorded_args, same_tracker_everywhere, save_checkpoint,
    schedule_of)
from megatron.training.data import build_loader, train_valid_test_num_samples
from megatron.training.exits import ExitWatch
from megatron.training.distributed import GradBuffer
from megatron.training.initialize import device_of, initialize_distributed
from megatron.training.metrics import TensorboardLogger, memory_line, print_rank_0, print_rank_last, reset_memory_peaks
from megatron.training.memo_setup import setup_memo
from megatron.training.loss_scaler import loss_scaler
from megatron.training.model import fusions, logits_line, params_dtype, unwrap
from megatron.training.optimizer import DistributedAdam
from megatron.training.profiling import StepProfiler, start_memory_history
from megatron.training.reporting import Reporter
from megatron.training.rerun import GRAD_CHECKS, Injector, Replay, RerunMachine, loss_checks, this_device
from megatron.training.timers import Timers
from megatron.training.tokenizer import build_tokenizer
from megatron.training.validate import convert_target, validate_args, world_size_from_env


@dataclass
class TrainState:
    model: List[torch.nn.Module]  # this rank's chunks, as called (bf16 wrappers included)
    optimizer: DistributedAdam
    scheduler: OptimizerParamScheduler
    pipeline: Pipeline
    memo: object = None
    saver: Optional[dist_ckpt.CheckpointSaver] = None  # torch_dist saves (one may be in flight)
    rerun: Optional[RerunMachine] = None
    exits: Optional[ExitWatch] = None
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    flops_so_far: float = 0.0


def parse_and_validate(argv=None, extra_args_provider=None):
    """Every bad flag of the command line, from parsing and from validation, in one ArgsError line."""
    args, errors = parse(argv, extra_args_provider)
    errors += checkpoint_settings(args)  # before validation: it fills what the command line left unset
    return validate_args(args, world_size_from_env(), errors)


def _print_args(args) -> None:
    print_rank_0("------------------------ arguments ------------------------")
    for key in sorted(vars(args)):
        if not key.startswith("_"):
            print_rank_0(f"  {key} {'.' * (48 - len(key))} {getattr(args, key)}")
    if getattr(args, "_from_checkpoint", None):
        print_rank_0(f"  (from the checkpoint, --use-checkpoint-args: {', '.join(args._from_checkpoint)})")
    # What some flags above become on this machine (fusions are off on CPU, ...).
    print_rank_0("------------------ in force on this machine ------------------")
    in_force = {**fusions(args),
                "ckpt_fully_parallel_load": args.ckpt_fully_parallel_load and args.device_type == "cuda"}
    for key, value in sorted(in_force.items()):
        print_rank_0(f"  {key} {'.' * max(1, 48 - len(key))} {value}")
    print_rank_0("-------------------- end of arguments ---------------------")


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """Megatron counts schedule steps in samples (validate.py derives them from either spelling)."""
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, **schedule_of(args),
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def finalize_model_grads(buffer: GradBuffer, pgs, model_chunks, num_tokens: Optional[torch.Tensor]) -> None:
    """After the last backward of an iteration (megatron-core's finalize_model_grads contract)."""
    buffer.finish_grad_sync()
    if pgs.size("pp") > 1:
        # Tied embeddings: the first stage's word embedding and the last stage's output layer are
        # one parameter. Their gradients, reduced over data parallel (a sum: order-free), are summed
        # over the two stages where this rank holds them reduced, so both copies take the same step.
        for p in buffer.tied:
            dist.all_reduce(buffer.reduced_grad(p), group=pgs.embd)
    if pgs.size("tp") > 1:
        sum_sequence_parallel_grads(buffer.offsets, pgs.tp)
    if num_tokens is not None:  # --calculate-per-token-loss: divide by the global token count
        num_tokens = num_tokens.to(buffer.grad_data.device)
        if pgs.size("pp") > 1:  # only the last stage computed losses
            dist.broadcast(num_tokens, src=pgs.members["pp"][-1], group=pgs.pp)
        dist.all_reduce(num_tokens, group=pgs.dp_cp)
        buffer.grad_data.div_(num_tokens.clamp(min=1))


def sum_sequence_parallel_grads(params, tp_group) -> None:
    """Sequence parallel: norm weights saw only this rank's sequence shard, so their gradients are
    summed over tp -- in one all-reduce of them all flattened (two per layer would each pay a
    collective's latency for a vector of hidden-size elements)."""
    grads = [p.main_grad for p in params if getattr(p, "sequence_parallel", False)]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def build_pipeline(args, pgs) -> Pipeline:
    # a rank's tokens of each segment of a micro-batch: the context-parallel share; under sequence
    # parallelism the activations between stages hold a tp shard of them
    cp, sp = pgs.size("cp"), args.tensor_model_parallel_size if args.sequence_parallel else 1
    pipeline = Pipeline(size=pgs.size("pp"), rank=pgs.index("pp"), chunks=args.virtual_pipeline_chunks,
                        segment_tokens=[n // cp for n in args.segment_lengths], hidden=args.hidden_size,
                        links=pgs.links, members=pgs.members["pp"], group=args.pipeline_group_units,
                        measure_activations=args.timing_log_level >= 1, token_divisor=cp, sequence_parallel=sp)
    connect_links(pgs.links, dist.get_rank(), device_of(args))
    return pipeline


def setup(args, pgs, model_provider):
    device = device_of(args)
    chunks = model_provider(args, pgs, device)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    params = [p for m in chunks for p in m.parameters() if p.requires_grad]
    tied = [p for p in params if getattr(p, "shared_embedding", False)] if pgs.size("pp") > 1 else []
    # One distributed-optimizer instance (the default): dp_cp_intra is dp_cp, dp_cp_inter is one rank.
    buffer = GradBuffer(params, pgs.dp_cp_intra, shard=args.use_distributed_optimizer, overlap=args.overlap_grad_reduce,
                        bucket_elements=args.ddp_bucket_size, average=not args.calculate_per_token_loss,
                        tied=tied, average_in_collective=args.ddp_average_in_collective, across=pgs.dp_cp_inter)
    if args.overlap_param_gather:
        buffer.wait_params_before_forward(chunks)
    named = [item for m in unwrap(chunks) for item in m.named_parameters()]
    optimizer = DistributedAdam(named, buffer, pgs, args, loss_scaler(args))
    config = get_model_config(chunks[0])
    if optimizer.scaler is not None:  # megatron-core's hook: the schedule scales each loss it backprops
        config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = buffer.no_sync
    config.finalize_model_grads_func = partial(finalize_model_grads, buffer, pgs)
    return TrainState(chunks, optimizer, build_scheduler(args, optimizer), build_pipeline(args, pgs),
                      rerun=build_rerun(args, pgs))


def reduce_reports(reports, pgs, device) -> Dict[str, float]:
    """Per-micro-batch {'name': [sum, count]} -> global means over micro-batches and dp x cp. A
    report of one value (Megatron's older loss functions, which average over data parallel
    themselves) is the mean over micro-batches, as Megatron's train_step takes it."""
    out = {}
    for key in (reports[0] if reports else ()):
        values = torch.stack([_report_values(r, key) for r in reports])  # [micro-batches, 1 or 2]
        if values.shape[1] == 1:
            out[key] = values.mean().item()
            continue
        total = values.sum(dim=0).to(device)
        dist.all_reduce(total, group=pgs.dp_cp)
        out[key] = (total[0] / total[1].clamp(min=1)).item()
    return out


def _report_values(report: dict, key: str) -> torch.Tensor:
    values = report[key].detach().float().view(-1)
    if values.numel() not in (1, 2):
        raise ValueError(f"the loss function reports {key!r} as {values.numel()} values: "
                         "report [sum, count] or one value")
    return values


def _replaying(memo):
    """The planned allocator replays its memory plan over the forward and backward passes."""
    if memo is None or memo.allocator is None:
        return contextlib.nullcontext()
    return memo.allocator.iteration()


def train_step(forward_step_func, data_iterator, state: TrainState, args, pgs, timers):
    rerun, replay = state.rerun, data_iterator if isinstance(data_iterator, Replay) else None
    while rerun.should_run(replay, state.iteration + 1):
        reports = _forward_backward(forward_step_func, data_iterator, state, args, timers)
        losses, grad_norm = _checked_values(reports, state, args)
        rerun.validate(losses)
        if grad_norm is not None:
            rerun.validate([grad_norm], checks=GRAD_CHECKS)
    save, exit_code = rerun.outcome()
    if exit_code:
        _rerun_exit(args, state, pgs, save, exit_code)
    # before the step: after it, this all-reduce would queue behind the step's parameter gathers on
    # the same communicator, and its .item() would wait for them all (--overlap-param-gather)
    losses = reduce_reports(reports, pgs, state.optimizer.device)
    timers("optimizer", 1).start()
    updated, grad_norm, num_zeros = state.optimizer.step(count_zeros=args.log_num_zeros_in_grad)
    timers("optimizer").stop()
    _settle(state.memo)
    if updated:  # an fp16 step skipped on overflow leaves the schedule where it was (Megatron)
        state.scheduler.step(increment=args.global_batch_size)
    return losses, grad_norm, num_zeros, not updated


def _forward_backward(forward_step_func, data_iterator, state: TrainState, args, timers):
    state.optimizer.zero_grad()
    _settle(state.memo)  # a rerun's frees from the run before it
    timers("forward-backward", 1).start()
    with _replaying(state.memo):
        reports = forward_backward_seq1f1b(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=state.model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False, p2p_communicator=state.pipeline,
        )
    timers("forward-backward").stop()
    return reports


def _settle(memo) -> None:
    if memo is not None and memo.allocator is not None:
        memo.allocator.settle()  # the iteration's frees are safe to reuse from here


def _local_losses(reports) -> List[torch.Tensor]:
    """This rank's reported loss sums, micro-batch by micro-batch: what Megatron's loss checks
    see, before any reduction."""
    return [_report_values(r, key)[0] for r in reports for key in r]


def _checked_values(reports, state: TrainState, args) -> Tuple[List[float], Optional[float]]:
    """The local losses and, under --check-for-nan-in-loss-and-grad (off with fp16's dynamic
    scaling, whose overflows skip the step), the norm of this rank's gradient buffer, in one
    transfer."""
    values = _local_losses(reports)
    grads = args.check_for_nan_in_loss_and_grad
    if grads:
        values.append(state.optimizer.buffer.grad_data.float().norm())
    if not values:
        return [], None
    out = torch.stack([v.to(values[0].device) for v in values]).tolist()
    return (out[:-1], out[-1]) if grads else (out, None)


def build_rerun(args, pgs) -> RerunMachine:
    device, rank = device_of(args), dist.get_rank()

    def any_rank(flags):
        flags = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(flags)
        return [bool(f) for f in flags.tolist()]

    injector = Injector(args.error_injection_rate, args.error_injection_type, rank, args.seed)
    checks = loss_checks(nan=args.check_for_nan_in_loss_and_grad, spiky=args.check_for_spiky_loss)
    return RerunMachine(args.rerun_mode, injector, any_rank, this_device(device), checks,
                        log=lambda m: print(f"[rank {rank}] {m}", flush=True), say=print_rank_0)


def _rerun_exit(args, state: TrainState, pgs, save: bool, exit_code: int) -> None:
    """The rerun state machine ends the run: the state before this iteration is saved where it
    asks (its own state included, so that a resumed run repeats the iteration), then exit."""
    if save and args.save:
        save_and_report(args, state, pgs)
    elif save:
        print_rank_0("rerun: no --save, so no checkpoint to resume the iteration from")
    if state.saver is not None:
        state.saver.finish(blocking=True)
    print_rank_0(f"rerun: exiting with status {exit_code} at iteration {state.iteration + 1}")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(exit_code)


def report_determinism(rerun: RerunMachine, iteration: int) -> None:
    """--rerun-mode report_stats: how far every checked value (each micro-batch's loss, each rank's
    gradient norm) of the last iterations' reruns moved, over all ranks (collective)."""
    stats = [None] * dist.get_world_size()
    dist.all_gather_object(stats, rerun.stats())
    compared, largest = sum(n for n, _ in stats), max(d for _, d in stats)
    print_rank_0(f"rerun: determinism up to iteration {iteration}: {compared} checked values run twice, largest "
                 f"relative difference {largest:.3e}")


def _train_mode(chunks, training: bool) -> None:
    for m in chunks:
        m.train(training)


def evaluate(forward_step_func, data_iterator, state: TrainState, args, pgs, num_iters: int):
    """The mean losses of `num_iters` forward-only iterations, or None when an exit condition came
    (checked after each, as Megatron does): the run stops, it does not finish the evaluation."""
    _train_mode(state.model, False)
    LEDGER.enabled = False  # the ledger reports training iterations
    totals, stop = [], None
    with torch.no_grad():
        for _ in range(num_iters):
            totals.extend(forward_backward_seq1f1b(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=state.model,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True, p2p_communicator=state.pipeline,
            ))
            stop = state.exits.urgent() if state.exits is not None else None
            if stop:
                print_rank_0(f"exiting during evaluation {stop}")
                break
    _train_mode(state.model, True)
    LEDGER.enabled = True
    if args.check_for_nan_in_loss_and_grad:
        _check_evaluation(totals, state.iteration)
    return None if stop else reduce_reports(totals, pgs, state.optimizer.device)


def _check_evaluation(reports, iteration: int) -> None:
    """A NaN or Inf evaluation loss stops the run (Megatron's loss checks, which no rerun judges
    in evaluation): a model that gives one has nothing left to train."""
    losses = torch.stack(_local_losses(reports)).tolist() if reports else []
    for check in loss_checks(nan=True, spiky=False):
        bad = [value for value in losses if check.reject(value)]
        if bad:
            raise FloatingPointError(f"evaluation {check.name} ({bad[0]}) at iteration {iteration}")


def evaluate_and_print(name, forward_step_func, data_iterator, state, args, pgs, tb, count_samples):
    if args.manual_gc and args.manual_gc_eval:
        gc.collect()  # what training left, before evaluation allocates
    losses = evaluate(forward_step_func, data_iterator, state, args, pgs, args.eval_iters)
    if args.manual_gc and args.manual_gc_eval:
        gc.collect(generation=0)  # what evaluation made
    if losses is None:  # stopped part-way: no loss to print, no samples counted (Megatron's)
        return
    if count_samples:
        state.consumed_valid_samples += args.eval_iters * args.global_batch_size
    # Megatron's wording and names: after training "... on validation set" / "... on test set", and
    # tensorboard's "lm loss validation" for both
    where = f"iteration {state.iteration}" + ("" if count_samples else f" on {name} set")
    line = f" validation loss at {where} | "
    for key, value in losses.items():
        ppl = math.exp(min(20.0, value))
        line += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
        tb.scalars({f"{key} validation": value}, state.iteration, state.consumed_train_samples)
        if args.log_validation_ppl_to_tensorboard:
            tb.scalars({f"{key} validation ppl": ppl}, state.iteration, state.consumed_train_samples)
    rule = "-" * (len(line) + 1)  # Megatron's rule is one longer than its line
    print_rank_last(f"{rule}\n{line}\n{rule}")


def check_attention_kernel(args) -> None:
    """One line now, not at the first forward, when --attention-backend names a kernel that cannot
    run here (flash-attn of another interface, cuDNN attention under --deterministic-mode, ...)."""
    try:
        choose_kernel(args.attention_backend, KernelEnv.probe(device_of(args), params_dtype(args), args.kv_channels))
    except ValueError as err:
        raise ArgsError(f"--attention-backend {args.attention_backend}: {err}") from None


def _collect_garbage(args, iteration: int) -> None:
    """--manual-gc: the automatic collector is off; collect every --manual-gc-interval iterations."""
    if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()


def train(forward_step_func, train_iter, valid_iter, state: TrainState, args, pgs, timers, tb) -> bool:
    """The loop, under --profile's profiler. Returns True when an exit condition (exits.py) stopped it."""
    with StepProfiler(args, device_of(args)) as profiler:
        return _train_loop(forward_step_func, train_iter, valid_iter, state, args, pgs, timers, tb, profiler)


def _train_loop(forward_step_func, train_iter, valid_iter, state, args, pgs, timers, tb, profiler) -> bool:
    if args.manual_gc:  # every rank collects at the same iterations, not when its own counts say
        gc.disable()
        gc.collect()
    reporter = Reporter(args, pgs, timers, tb, state.iteration)
    tb.args(args, state.iteration)
    _train_mode(state.model, True)
    reset_memory_peaks()
    while state.iteration < args.train_iters:
        record = bool(args.pipeline_timeline) and state.iteration + 1 == args.train_iters
        state.pipeline.record_timeline = record
        profiler.before_step(state.iteration)
        losses, grad_norm, num_zeros, skipped = train_step(forward_step_func, train_iter, state, args, pgs, timers)
        if record:
            write_timeline(args.pipeline_timeline, state.pipeline, pgs)
        state.iteration += 1
        state.consumed_train_samples += args.global_batch_size
        state.flops_so_far += reporter.flops_per_iter
        reporter.iteration(state, losses, grad_norm, num_zeros, skipped)
        profiler.after_step(state.iteration, logged=reporter.logged)
        if args.rerun_mode == "report_stats" and state.iteration % args.log_interval == 0:
            report_determinism(state.rerun, state.iteration)
        if state.saver is not None:
            state.saver.finish(blocking=False)  # publish a background save once every rank has written it
        interval = args.check_weight_hash_across_dp_replicas_interval
        if interval and state.iteration % interval == 0:
            state.optimizer.buffer.check_replicas(state.iteration)
        _collect_garbage(args, state.iteration)
        if valid_iter is not None and args.eval_iters > 0 and args.eval_interval and state.iteration % args.eval_interval == 0:
            with reporter.paused():
                evaluate_and_print("validation", forward_step_func, valid_iter, state, args, pgs, tb, True)
        saved = False
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            with reporter.paused():
                save_and_report(args, state, pgs)
            saved = True
        stop = state.exits.reason(state.iteration)
        if stop:
            if args.save and not saved:
                save_and_report(args, state, pgs)
            print_rank_0(f"exiting program {stop}")
            return True
    print_rank_0(memory_line(state.iteration))  # the end state: fragmentation has had time to build up
    return False


def write_timeline(directory: str, pipeline: Pipeline, pgs) -> None:
    """One file per pipeline stage (from the first rank of its dp x cp x tp replicas), each naming
    the stage count: a reader tells files of an earlier run with more stages from this run's."""
    if pgs.index("dp_cp") or pgs.index("tp"):
        return
    os.makedirs(directory, exist_ok=True)
    blob = {"stage": pipeline.rank, "stages": pgs.size("pp"), "events": pipeline.stats["timeline"]}
    with open(os.path.join(directory, f"rank_{pipeline.rank}.json"), "w") as f:
        json.dump(blob, f)


def save_and_report(args, state, pgs):
    start = time.perf_counter()
    state.optimizer.buffer.wait_params()  # --overlap-param-gather: the weights saved are whole
    if dist.get_rank() == 0:
        carry_model_card(args.load, args.save)
    if state.saver is None:  # --ckpt-format torch
        _report_saved(start, state.iteration, save_checkpoint(args, state, pgs))
        return
    path = state.saver.save(state, on_done=partial(_report_saved, start))
    if args.async_save:
        print_rank_0(f"  scheduled an async checkpoint save at iteration {state.iteration:7d} to {path}")


def _report_saved(start: float, iteration: int, path: str) -> None:
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {path} "
                 f"[ t {time.perf_counter() - start:.2f}s ]")


def check_load(args, pgs) -> None:
    """Collective: --load's recorded model against this run's flags, before anything is built: a
    format or a model that contradicts them (hidden size, heads, vocabulary, ...) is one line at
    start-up. Every rank reads its own files (a torch-format checkpoint's mp_rank_* of its own), so
    the ranks agree: one rank's problem stops all of them, and rank 0 prints it."""
    error = ""
    try:
        same_tracker_everywhere(args.load)
        path = loaded_checkpoint(args)
        if path is None and (args.exit_on_missing_checkpoint or args.ckpt_convert_format):
            # converting nothing would write a random initialisation as "the converted checkpoint"
            raise ValueError(f"no checkpoint ({TRACKER} names none): is --load the run's directory?")
        if path is not None:
            sharded = checkpoint_format(path, args) == "torch_dist"
            saved = dist_ckpt.recorded_args(path) if sharded else recorded_args(path, pgs)
            check_args(saved, args)
            if loads_schedule(args, path):
                check_schedule(saved.get(SCHEDULE), args)
    except ValueError as err:
        error = f"--load {args.load}: {err}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    rank, first = next(((r, e) for r, e in enumerate(errors) if e), (0, ""))
    if first:
        raise ArgsError(first if rank == 0 else f"rank {rank}: {first}")


def load_and_report(args, state, pgs) -> None:
    """Resume from the checkpoint the tracker under --load points at, in whichever format it is
    allowed to be (see checkpoint_format)."""
    path = loaded_checkpoint(args)
    if path is None:
        print_rank_0(f"WARNING: no checkpoint under {args.load}; starting from random initialisation")
        return
    try:
        if checkpoint_format(path, args) == "torch_dist":
            dist_ckpt.load_checkpoint(args, state, pgs, path)
        else:
            load_checkpoint(args, state, pgs)
    except CheckpointError as err:  # every rank reads the same answer from its own files
        raise ArgsError(f"--load {args.load}: {err}") from None
    print_rank_0(f"  successfully loaded checkpoint from {args.load} at iteration {state.iteration}")


def convert_and_exit(args, state, pgs) -> None:
    """Megatron's --ckpt-convert-format: the loaded checkpoint saved again, in that format, under
    --ckpt-convert-save; the run ends there (no data, no training)."""
    args.ckpt_format, args.save, args.async_save = args.ckpt_convert_format, convert_target(args), False
    if args.ckpt_format == "torch_dist":
        state.saver = dist_ckpt.CheckpointSaver(args, pgs, device_of(args))
    save_and_report(args, state, pgs)
    if state.saver is not None:
        state.saver.finish(blocking=True)
    print_rank_0(f"> converted the checkpoint of {args.load} to {args.ckpt_format} under {args.save}; exiting")
    dist.barrier()
    dist.destroy_process_group()


def _say(message: str) -> None:
    """Before process groups exist: rank 0 of the launch (RANK from torchrun or Slurm) speaks."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(message, flush=True)


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step_func, argv=None,
             extra_args_provider=None):
    """Megatron's entry point, with explicit arguments instead of globals."""
    start = time.perf_counter()
    args = parse_and_validate(argv, extra_args_provider)
    _say(f"> initializing torch distributed ({args.distributed_backend}) ...")
    pgs = initialize_distributed(args)
    exits = ExitWatch(args, start)
    exits.install()  # a signal during the set-up stops the run after its first iteration
    check_attention_kernel(args)
    tokenizer = build_tokenizer(args)  # the one validation loaded (and sized the vocabulary by)
    print_rank_0(f"> {pgs.grid.describe()}")
    print_rank_0(f"> padded vocab (size: {args.true_vocab_size}) with {args.padded_vocab_size - args.true_vocab_size} "
                 f"dummy tokens (new size: {args.padded_vocab_size})")
    print_rank_0(logits_line(args, pgs.size("cp")))
    if args.load:
        check_load(args, pgs)
    _print_args(args)
    start_memory_history(args)
    print_rank_0("> building GPT model, gradient buffer, optimizer and LR schedule ...")
    state = setup(args, pgs, model_provider)
    state.exits = exits
    if args.memo:
        state.memo = setup_memo(args, pgs, state, forward_step_func, device_of(args))
    if args.load:
        load_and_report(args, state, pgs)
    if args.ckpt_convert_format:
        return convert_and_exit(args, state, pgs)
    if args.save and args.ckpt_format == "torch_dist":
        state.saver = dist_ckpt.CheckpointSaver(args, pgs, device_of(args))
    print_rank_0("> building train, validation, and test datasets ...")
    train_ds, valid_ds, test_ds = train_valid_test_datasets_provider(args, tokenizer, train_valid_test_num_samples(args))
    train_iter = build_loader(train_ds, state.consumed_train_samples, args, pgs, tokenizer.eod)
    # --skip-train evaluates from the first validation samples, whatever the training run had read (Megatron's)
    valid_iter = build_loader(valid_ds, 0 if args.skip_train else state.consumed_valid_samples, args, pgs,
                              tokenizer.eod)
    if args.rerun_mode != "disabled" and train_iter is not None:
        train_iter = Replay(train_iter)  # an iteration may run again on the same micro-batches
    print_rank_0(f"> setup done in {time.perf_counter() - start:.1f} s; training ...")
    timers = Timers(args.timing_log_level, args.device_type == "cuda")
    tb = TensorboardLogger(args.tensorboard_dir, args.tensorboard_queue_size)
    try:
        exited = False if args.skip_train else train(forward_step_func, train_iter, valid_iter, state, args, pgs,
                                                     timers, tb)
        if not exited:
            _finish(args, state, pgs, forward_step_func, valid_iter,
                    lambda: build_loader(test_ds, 0, args, pgs, tokenizer.eod), tb)
        if state.saver is not None:
            state.saver.finish(blocking=True)  # the run ends when its last checkpoint is complete
    finally:
        tb.close()
        exits.uninstall()
    dist.barrier()
    dist.destroy_process_group()


def _finish(args, state, pgs, forward_step_func, valid_iter, test_loader, tb):
    if args.skip_train:
        tb = TensorboardLogger(None)  # as Megatron: an evaluation-only run writes no scalars
        print_rank_0(f"skipping training (--skip-train): evaluating the model of iteration {state.iteration}")
    elif args.save and (not args.save_interval or state.iteration % args.save_interval != 0):
        save_and_report(args, state, pgs)
    if args.eval_iters > 0 and valid_iter is not None:  # always, as Megatron's (its sample count allows it)
        evaluate_and_print("validation", forward_step_func, valid_iter, state, args, pgs, tb, False)
    test_iter = test_loader()
    if args.eval_iters > 0 and test_iter is not None:
        evaluate_and_print("test", forward_step_func, test_iter, state, args, pgs, tb, False)
