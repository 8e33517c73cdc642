"""What the training loop logs between iterations: Megatron's iteration line, memory and the
attention kernel once, timers, MEMO's counters and tensorboard scalars."""
from __future__ import annotations

import contextlib
import time
from typing import List

from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.collectives import all_gather_values
from megatron.longseq.pipeline.seq1f1b import Pipeline
from megatron.training.flops import default_peak_tflops, num_floating_point_operations
from megatron.training.metrics import IntervalStats, format_iteration_line, memory_line, print_rank_0, print_rank_last


class Reporter:
    """Everything logged between iterations: the line, memory once, timers, tensorboard."""

    TIMERS = ("forward-backward", "optimizer")

    def __init__(self, args, pgs, timers, tb, start_iteration: int = 0):
        self.args, self.pgs, self.timers, self.tb = args, pgs, timers, tb
        self.stats = IntervalStats()
        self.start_iteration = start_iteration  # the loaded checkpoint's, 0 for a fresh run
        self.report_memory = True  # Megatron's report_memory_flag
        self.kernel_reported = False
        self.flops_per_iter = num_floating_point_operations(args, args.global_batch_size)
        self.peak = args.peak_tflops if args.peak_tflops is not None else default_peak_tflops()
        self.last = time.perf_counter()
        self.first = True  # this process's first iteration: logged whatever --log-interval says
        self.logged = False  # whether the last iteration printed a line

    @contextlib.contextmanager
    def paused(self):
        """Evaluation and checkpoint saves are not iteration time (Megatron stops its interval
        timer around them)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.last += time.perf_counter() - start

    def iteration(self, state, losses, grad_norm, num_zeros, skipped: bool):
        args = self.args
        self.stats.add(losses, skipped=skipped)
        loss_scale = state.optimizer.loss_scale
        lr = state.optimizer.param_groups[0]["lr"]
        params_norm = state.optimizer.last_params_norm  # taken in the step (--log-params-norm)
        if state.iteration % args.tensorboard_log_interval == 0:
            values = {"learning-rate": lr, "batch-size": args.global_batch_size, "grad-norm": grad_norm,
                      "num-zeros": num_zeros, "params-norm": params_norm, **losses}
            if args.log_loss_scale_to_tensorboard:
                values["loss-scale"] = loss_scale
            if args.log_world_size_to_tensorboard:
                values["world-size"] = args.world_size
            self.tb.scalars(values, state.iteration, state.consumed_train_samples)
            if args.log_memory_to_tensorboard:
                self.tb.memory(state.iteration)
        first, self.first = self.first, False
        self.logged = state.iteration % args.log_interval == 0 or first
        if self.logged:
            # Megatron: the first line shows the start-up; its interval goes on into the next line
            self._log_line(state, lr, grad_norm, num_zeros, params_norm, loss_scale, reset=not first)

    def _log_line(self, state, lr, grad_norm, num_zeros, params_norm, loss_scale, reset: bool):
        args, now, n = self.args, time.perf_counter(), self.stats.iterations
        elapsed = (now - self.last) / n
        extra = {}
        if args.log_throughput:
            tflops = self.flops_per_iter / (elapsed * 1e12 * args.world_size)
            extra = {"tflops": tflops, "mfu": tflops / self.peak if self.peak else None,
                     "tokens_per_gpu": args.global_batch_size * args.seq_length / elapsed / args.world_size}
        # Megatron: timings go to tensorboard only when asked, by iteration only, and the iteration
        # time not for the first line (start-up); the throughput is written at every line
        if args.log_timers_to_tensorboard:
            self.tb.scalars({**({"iteration-time": elapsed} if reset else {}),
                             **({"throughput": extra["tflops"]} if extra else {})}, state.iteration)
        print_rank_last(format_iteration_line(
            iteration=state.iteration, train_iters=args.train_iters,
            consumed_samples=state.consumed_train_samples, elapsed_ms=elapsed * 1000.0, lr=lr,
            global_batch_size=args.global_batch_size, losses=self.stats.means(), grad_norm=grad_norm,
            num_zeros=num_zeros, params_norm=params_norm, skipped=self.stats.skipped, nan=self.stats.nan,
            loss_scale=loss_scale, **extra,
        ))
        if reset:
            self.stats, self.last = IntervalStats(), now
        self._memory(state.iteration)
        if not self.kernel_reported:
            print_rank_0(attention_kernel_line(state.model, args.attention_backend))
            self.kernel_reported = True
        if args.timing_log_level >= 1:
            print_rank_0(pipeline_memory_line(state.pipeline, self.pgs))
            if state.memo is not None:
                self._memo(state.memo, n, reset)
        self._timers(state.iteration, n, reset)

    def _memory(self, iteration: int):
        """Megatron's report_memory: at each line up to the first one past the run's first
        iteration (that one includes the optimizer state), then every --log-memory-interval; from
        every rank of data-parallel rank 0 (each stage and tp / cp rank: their memory differs)."""
        interval = self.args.log_memory_interval
        due = self.report_memory or (interval is not None and iteration % interval == 0)
        if iteration > self.start_iteration + 1:
            self.report_memory = False
        if due and self.pgs.index("dp") == 0:
            print(memory_line(iteration), flush=True)

    def _memo(self, memo, n: int, reset: bool):
        mib = 2**20
        s = memo.stats
        print_rank_0(f"MEMO: offloaded {s['offloaded_bytes'] / mib / n:.1f} MiB and recomputed "
                     f"{s['recomputed_tokens'] // n} tokens per iteration; peak host memory "
                     f"{s['peak_host_bytes'] / mib:.1f} MiB")
        if reset:
            memo.reset_stats()
        if memo.allocator is not None:
            a = memo.allocator.stats()
            print_rank_0(f"MEMO planned allocator: {a['planned_allocs']} planned allocations "
                         f"({a['planned_bytes'] / mib:.1f} MiB), {a['marks_matched']} window marks matched, "
                         f"{a['divergences']} divergences ({a['overlap_refusals']} overlap refusals); "
                         f"reserved {a['backend_bytes'] / mib:.1f} MiB, allocated {a['allocated_bytes'] / mib:.1f} MiB, "
                         f"cached {a['cached_free_bytes'] / mib:.1f} MiB, retries {a['retries']}")

    def _timers(self, iteration: int, n: int, reset: bool):
        """Megatron's timer block: per-iteration ms (min, max over ranks) on the last rank, and the
        max in seconds to tensorboard."""
        if self.args.timing_log_level >= 2:
            print_rank_0(LEDGER.format(iterations=n))
        if reset:
            LEDGER.clear()
        option = self.args.timing_log_option
        if option == "all":
            times = self.timers.per_rank(list(self.TIMERS), reset=reset)
        else:
            times = {name: list(ms) for name, ms in self.timers.min_max(list(self.TIMERS), reset=reset).items()}
        if not times:
            return
        print_rank_last(TIMES_HEADER[option] + "".join(_timer_lines(option, name, ms, n) for name, ms in times.items()))
        if self.args.log_timers_to_tensorboard:
            self.tb.scalars({f"{name}-time": max(ms) / 1000.0 / n for name, ms in times.items()}, iteration)


TIMES_HEADER = {"max": "max time across ranks (ms):", "minmax": "(min, max) time across ranks (ms):",
                "all": "times across ranks (ms):"}


def _timer_lines(option: str, name: str, ms: List[float], n: int) -> str:
    """A timer's per-iteration ms in Megatron's layouts: a dotted line with its max or (min, max)
    over the ranks, or (`all`) its name and a line per rank that ran it."""
    if option == "max":
        return f"\n    {(name + ' ').ljust(48, '.')}: {max(ms) / n:.2f}"
    if option == "minmax":
        return f"\n    {(name + ' ').ljust(48, '.')}: ({min(ms) / n:.2f}, {max(ms) / n:.2f})"
    ranks = "".join(f"\n     rank {rank:2d}: {v / n:.2f}" for rank, v in enumerate(ms) if v > 0)
    return f"\n  {name}:{ranks}" if ranks else ""


def attention_kernel_line(chunks, backend: str) -> str:
    """The local attention kernel(s) this rank's layers ran (torch-sdpa: document masks, dropout)."""
    ran = sorted({m.kernel_ran for c in chunks for m in c.modules() if getattr(m, "kernel_ran", None)})
    return f"attention kernel: {', '.join(ran) or 'none ran'} (--attention-backend {backend})"


def pipeline_memory_line(pipeline: Pipeline, pgs) -> str:
    """Measured peak of saved activations, per pipeline stage (gathered over the pp group), and
    with Seq1F1B segments the peak of their cross-segment state (fp32 dK/dV, copied K/V)."""
    stats = pipeline.stats
    peaks = all_gather_values([stats.get("peak_activation_bytes", 0), stats.get("peak_segment_state_bytes", 0)],
                              pgs.pp)
    line = "peak saved activations per pipeline stage (MB): " + " ".join(f"{p[0] / 2**20:.1f}" for p in peaks)
    if any(p[1] for p in peaks):
        line += "; Seq1F1B cross-segment state (MB): " + " ".join(f"{p[1] / 2**20:.1f}" for p in peaks)
    return line
