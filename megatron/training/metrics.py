"""What a run reports: Megatron's iteration line, the memory line, tensorboard scalars."""
from __future__ import annotations

import math
import resource
import sys
from datetime import datetime
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.distributed as dist


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    """Losses live on the last pipeline stage, so Megatron logs them from the last rank."""
    if is_last_rank():
        print(message, flush=True)


def timestamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")  # Megatron's, to the microsecond


@dataclass
class IntervalStats:
    """Accumulates per-iteration numbers between two log lines (Megatron prints interval means)."""

    losses: Dict[str, float] = field(default_factory=dict)
    iterations: int = 0
    skipped: int = 0
    nan: int = 0

    def add(self, loss_dict: Dict[str, float], skipped: bool) -> None:
        self.iterations += 1
        self.skipped += int(skipped)
        # Megatron's count: skipped iterations whose loss was not finite, once each however many keys
        self.nan += int(skipped and not all(math.isfinite(v) for v in loss_dict.values()))
        if not skipped:  # the interval's mean is over the steps that updated the model (Megatron)
            for key, value in loss_dict.items():
                self.losses[key] = self.losses.get(key, 0.0) + value

    def means(self) -> Dict[str, float]:
        n = max(self.iterations - self.skipped, 1)
        return {k: v / n for k, v in self.losses.items()}


def format_iteration_line(*, iteration, train_iters, consumed_samples, elapsed_ms, lr, global_batch_size,
                          losses, grad_norm, num_zeros, params_norm, skipped, nan, loss_scale=1.0, tflops=None,
                          tokens_per_gpu=None, mfu=None) -> str:
    """Megatron's training-log line, with tokens/s/GPU and MFU when throughput is logged."""
    parts = [
        f" [{timestamp()}] iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if tflops is not None:
        # Megatron prints one decimal; tiny CPU runs would always show 0.0, so small values keep six
        # (fixed point, never an exponent: log parsers read digits and dots)
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f}" if tflops >= 1 else
                     f" throughput per GPU (TFLOP/s/GPU): {tflops:.6f}")
        parts.append(f" tokens per second per GPU: {tokens_per_gpu:.1f}")
        if mfu is not None:
            parts.append(f" MFU: {100.0 * mfu:.1f}%")
    parts.append(f" learning rate: {lr:.6E}")
    parts.append(f" global batch size: {global_batch_size:5d}")
    parts.extend(f" {key}: {value:.6E}" for key, value in losses.items())
    parts.append(f" loss scale: {loss_scale:.1f}")  # 1.0: bf16 and fp32 train without loss scaling
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f" num zeros: {float(num_zeros):.1f}")
    if params_norm is not None:
        parts.append(f" params norm: {params_norm:.3f}")
    parts.append(f" number of skipped iterations: {skipped:3d}")
    parts.append(f" number of nan iterations: {nan:3d}")
    return " |".join(parts) + " |"


def memory_stats() -> Dict[str, float]:
    """GPU: the caching allocator's counters. CPU: the process's resident set (current and peak);
    CPU tensors have no allocator statistics, RSS is what they cost."""
    from megatron.longseq.memo import allocator

    if allocator.INSTALLED is not None:  # torch's allocator statistics are the caching allocator's
        a = allocator.INSTALLED.stats()
        return {"allocated": a["allocated_bytes"], "max allocated": a["peak_allocated_bytes"],
                "reserved": a["backend_bytes"], "max reserved": a["peak_backend_bytes"], "alloc retries": a["retries"]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s = torch.cuda.memory_stats()
        return {
            "allocated": s.get("allocated_bytes.all.current", 0),
            "max allocated": s.get("allocated_bytes.all.peak", 0),
            "reserved": s.get("reserved_bytes.all.current", 0),
            "max reserved": s.get("reserved_bytes.all.peak", 0),
            "alloc retries": s.get("num_alloc_retries", 0),
            "alloc count": s.get("allocation.all.current", 0),
        }
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"rss": rss, "max rss": max(peak, rss)}  # ru_maxrss lags the current RSS slightly


def reset_memory_peaks() -> None:
    """The memory lines' maxima (and torch's retry count) start with training: they are the
    training iterations', not set-up's (model building, MEMO's profile and trace iterations)."""
    from megatron.longseq.memo import allocator

    if allocator.INSTALLED is not None:
        allocator.INSTALLED.reset_peak()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()


def memory_line(iteration: int) -> str:
    mb = 1024.0 * 1024.0
    stats = memory_stats()
    counts = ("alloc retries", "alloc count")
    body = " | ".join(f"{k}: {int(v)}" if k in counts else f"{k}: {v / mb:.2f}" for k, v in stats.items())  # Megatron's
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"[Rank {rank}] (after {iteration} iterations) memory (MB) | {body}"


class TensorboardLogger:
    """Scalars with Megatron's names, written from the last rank (where the losses are)."""

    def __init__(self, log_dir: Optional[str], queue_size: int = 1000):
        self.writer = None
        if log_dir and is_last_rank():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, values: Dict[str, float], iteration: int, samples: Optional[int] = None) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is None:
                continue
            self.writer.add_scalar(name, value, iteration)
            if samples is not None:
                self.writer.add_scalar(f"{name} vs samples", value, samples)

    def args(self, args, iteration: int) -> None:
        """Every setting as text, as Megatron's write_args_to_tensorboard (at training's start)."""
        if self.writer is None:
            return
        for name, value in sorted(vars(args).items()):
            if not name.startswith("_"):  # the parser's bookkeeping, no setting
                self.writer.add_text(name, str(value), global_step=iteration)

    def memory(self, iteration: int) -> None:
        if self.writer is None:
            return
        stats = memory_stats()
        names = {"allocated": "mem-allocated-bytes", "max allocated": "mem-max-allocated-bytes",
                 "reserved": "mem-reserved-bytes", "max reserved": "mem-max-reserved-bytes",
                 "rss": "mem-allocated-bytes", "max rss": "mem-max-allocated-bytes",
                 "alloc retries": "mem-alloc-retries", "alloc count": "mem-allocated-count"}
        for key, value in stats.items():
            self.writer.add_scalar(names[key], value, iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
