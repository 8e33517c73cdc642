"""Megatron's profiling flags: where a step's time and memory go.

--profile covers the iterations after --profile-step-start completed ones up to --profile-step-end
completed ones (Megatron's defaults 10 and 12: the 11th and 12th), on the ranks in
--profile-ranks:
- with --use-pytorch-profiler, under torch's profiler: the trace goes under --tensorboard-dir
  (tensorboard's profile plugin or Perfetto read it) and the ops that took the most time, device
  time on a GPU, are printed as a table -- what the step spends without opening a trace viewer;
- without it, between cudaProfilerStart and cudaProfilerStop, with NVTX ranges per op, for
  `nsys profile --capture-range=cudaProfilerApi` (CUDA only).
--record-memory-history records the CUDA caching allocator's events from before the model is built;
the last rank writes a snapshot to --memory-snapshot-path after every logged iteration (open it at
https://pytorch.org/memory_viz: which tensors were live at the peak, and where the free gaps were),
and a rank that runs out of memory writes oom_rank<N>_<name> beside it, as Megatron does.
"""
from __future__ import annotations

import contextlib
import os
import pickle
from functools import partial

import torch
import torch.distributed as dist

TABLE_ROWS = 25


def _activities(cuda: bool) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    return acts + [torch.profiler.ProfilerActivity.CUDA] if cuda else acts


def profile_table(prof, cuda: bool, rows: int = TABLE_ROWS) -> str:
    """The ops of a finished profile by their own time (device time on a GPU, host time on CPU),
    as a markdown table: what a step spends, readable in a log and pasteable into the docs."""
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1.0
    lines = [f"| op | self {'device' if cuda else 'host'} time (ms) | share | calls |", "| --- | --- | --- | --- |"]
    lines += [f"| {e.key[:80].replace('|', '/')} | {getattr(e, attr) / 1e3:.2f} | {getattr(e, attr) / total:.1%} | "
              f"{e.count} |" for e in events[:rows]]
    return "\n".join(lines + [f"| (all {len(events)} ops) | {total / 1e3:.2f} | 100% | |"])


def start_memory_history(args) -> None:
    """--record-memory-history from before the model is built (its weights, gradient buffer and
    optimizer state are most of the memory, and their stacks are what a reader looks for), and a
    snapshot when the allocator runs out of memory: a crash in the first iteration leaves one too."""
    if not args.record_memory_history:
        return
    torch.cuda.memory._record_memory_history(max_entries=100000)
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)  # CUDA builds have it
    if attach is not None:
        attach(partial(_write_oom_snapshot, oom_snapshot_path(args.memory_snapshot_path, dist.get_rank())))


def oom_snapshot_path(path: str, rank: int) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f"oom_rank{rank}_{tail}")


def _write_oom_snapshot(path: str, device, alloc, device_alloc, device_free) -> None:
    print(f"out of memory on device {device} ({alloc} bytes asked, {device_free} free): "
          f"allocator snapshot in {path}", flush=True)
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)


class StepProfiler(contextlib.AbstractContextManager):
    """Start and stop around the training loop's steps; closing stops a profile the run did not
    reach the end of (an exit condition, fewer iterations than --profile-step-end), so that what
    was recorded is still written."""

    def __init__(self, args, device: torch.device):
        self.args, self.cuda = args, device.type == "cuda"
        self.rank = dist.get_rank()
        self.on = args.profile and self.rank in args.profile_ranks
        self.torch_prof = None
        self.nvtx = None
        self.window = None  # [first, last] iterations recorded, while and after the profile runs
        self.checked = False

    def before_step(self, done: int) -> None:
        """`done`: the iterations completed before this step. A run resumed inside the window
        profiles what is left of it; one resumed past it says so once."""
        start, end = self.args.profile_step_start, self.args.profile_step_end
        if self.on and not self.checked and done >= end:
            print(f"[rank {self.rank}] --profile: the run starts after {done} iterations, past the window "
                  f"({start}, {end}]: nothing is profiled", flush=True)
        self.checked = True
        if self.on and self.window is None and start <= done < end:
            self._start()
            self.window = [done + 1, done + 1]

    def after_step(self, done: int, logged: bool) -> None:
        if self.recording():
            self.window[1] = done
        if self.on and done == self.args.profile_step_end:
            self._stop()
        if self.args.record_memory_history and logged and self.rank == dist.get_world_size() - 1:
            with open(self.args.memory_snapshot_path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    def __exit__(self, *exc) -> None:
        self._stop()

    def recording(self) -> bool:
        return self.torch_prof is not None or self.nvtx is not None

    def _start(self) -> None:
        if self.args.use_pytorch_profiler:
            self.torch_prof = torch.profiler.profile(activities=_activities(self.cuda),
                                                     record_shapes=self.args.pytorch_profiler_collect_shapes,
                                                     with_stack=self.args.pytorch_profiler_collect_callstack)
            self.torch_prof.start()
        else:
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def _stop(self) -> None:
        if self.torch_prof is not None:
            prof, self.torch_prof = self.torch_prof, None
            prof.stop()
            self._report(prof)
        if self.nvtx is not None:
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
            torch.cuda.cudart().cudaProfilerStop()

    def _report(self, prof) -> None:
        first, last = self.window  # what ran: an exit can come before --profile-step-end
        where = f"iterations {first}-{last}" if last > first else f"iteration {first}"
        if self.args.tensorboard_dir:
            torch.profiler.tensorboard_trace_handler(self.args.tensorboard_dir, worker_name=f"rank{self.rank}")(prof)
            where += f", trace under {self.args.tensorboard_dir}"
        print(f"[rank {self.rank}] profile of {where} (ops by {'device' if self.cuda else 'host'} time):\n"
              f"{profile_table(prof, self.cuda)}", flush=True)
