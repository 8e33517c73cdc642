"""The benchmark drivers on a device command's clock: every run stopped at its time and its output
kept, out-of-memory told apart from failures, and the numbers read from what the trainer prints."""
import sys
import time
from types import SimpleNamespace

import pytest

from megatron.training import metrics
from tools import benchmark_gpt, benchmark_memo


@pytest.mark.parametrize("text, oom", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("megatron-longseq planned allocator: out of device memory (arena 70.1 GiB)", True),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
    ("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)", True),
    ("RuntimeError: NCCL error: unhandled system error", False),
])
def test_out_of_memory_is_told_from_other_failures(text, oom):
    assert bool(benchmark_gpt.OOM.search(text)) == oom


def _limits(tmp_path, timeout=60.0, budget=float("inf")):
    return SimpleNamespace(timeout=timeout, budget=budget, log_dir=str(tmp_path))


def test_a_run_past_its_time_is_stopped_and_its_output_kept(tmp_path):
    runs = benchmark_gpt.Runs(_limits(tmp_path, timeout=2), "gpt")
    child = "import subprocess, sys, time; print('started', flush=True); " \
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
    start = time.monotonic()
    status, text = runs([sys.executable, "-c", child], "slow")
    assert status == "timeout" and "started" in text and time.monotonic() - start < 30
    assert (tmp_path / "gpt_slow.log").read_text() == text


def test_no_run_starts_past_the_budget_and_failures_are_named(tmp_path):
    runs = benchmark_gpt.Runs(_limits(tmp_path), "memo")
    assert runs([sys.executable, "-c", "raise SystemExit(3)"], "fails")[0] == "failed"
    oom = "import sys; print('CUDA out of memory', file=sys.stderr); sys.exit(1)"
    assert runs([sys.executable, "-c", oom], "oom")[0] == "out of memory"
    spent = benchmark_gpt.Runs(_limits(tmp_path, budget=0), "memo")
    assert spent([sys.executable, "-c", "print()"], "late") == ("not run (budget)", "")


def _trainer_output(monkeypatch, peaks):
    """What pretrain_gpt.py prints: iteration lines and memory lines, made by the trainer's own
    formatters, so the benchmark's patterns are checked against them."""
    lines = []
    for iteration, (allocated, max_allocated, reserved, max_reserved) in enumerate(peaks, 1):
        lines.append(metrics.format_iteration_line(
            iteration=iteration, train_iters=len(peaks), consumed_samples=iteration, elapsed_ms=1000.0 * iteration,
            lr=1e-4, global_batch_size=1, losses={"lm loss": 5.0}, grad_norm=1.0, num_zeros=None, params_norm=None,
            skipped=0, nan=0, tflops=400.0, tokens_per_gpu=1e4, mfu=0.4))
        mib = {"allocated": allocated, "max allocated": max_allocated, "reserved": reserved, "max reserved": max_reserved}
        stats = {**{k: v * 2**20 for k, v in mib.items()}, "alloc retries": iteration, "alloc count": 10}
        monkeypatch.setattr(metrics, "memory_stats", lambda stats=stats: stats)
        lines.append(metrics.memory_line(iteration))
    return "\n".join(lines)


def test_fragmentation_is_read_at_the_peak_of_the_training_iterations(monkeypatch, tmp_path, capsys):
    """max reserved - max allocated of the end line (whose maxima are training's), not the cache
    that reserved - allocated shows once the last iteration has freed its activations."""
    text = _trainer_output(monkeypatch, [(30000, 50000, 60000, 60000), (20000, 52000, 58000, 60000)])
    monkeypatch.setattr(benchmark_memo.Runs, "__call__", lambda self, cmd, name: ("ok", text))
    monkeypatch.setattr(benchmark_memo, "device_name", lambda: "CPU")
    benchmark_memo.main(["--modes", "memo", "--seq-lengths", "1024", "--warmup", "1", "--log-dir", str(tmp_path)])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| memo | 1024 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:7] == ["40.0%", "400.0", "2000", "8000", "2"], row  # iteration 2 only; 60000 - 52000
