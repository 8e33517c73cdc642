"""The benchmark drivers on a device command's clock: every run stopped at its time and its output
kept, out-of-memory told apart from failures, and the numbers read from what the trainer prints."""
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.training import metrics
from tools import benchmark_gpt, benchmark_memo


@pytest.mark.parametrize("text, oom", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("megatron-longseq planned allocator: out of device memory (arena 70.1 GiB)", True),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
    ("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)", True),
    ("ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nFailed to CUDA calloc async 24 bytes", True),
    ("RuntimeError: NCCL error: unhandled system error", False),
])
def test_out_of_memory_is_told_from_other_failures(text, oom):
    assert bool(benchmark_gpt.OOM.search(text)) == oom


def _limits(tmp_path, timeout=60.0, budget=float("inf")):
    return SimpleNamespace(timeout=timeout, budget=budget, log_dir=str(tmp_path))


def test_a_run_past_its_time_is_stopped_and_its_output_kept(tmp_path):
    """The whole process group goes: a data-loader worker left behind would hold the GPU."""
    runs = benchmark_gpt.Runs(_limits(tmp_path, timeout=2), "gpt")
    child = "import subprocess, sys, time; " \
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
            "print('started', w.pid, flush=True); time.sleep(120)"
    start = time.monotonic()
    status, text = runs([sys.executable, "-c", child], "slow")
    assert status == "timeout" and "started" in text and time.monotonic() - start < 30
    assert (tmp_path / "gpt_slow.log").read_text() == text
    worker = Path(f"/proc/{text.split()[1]}/status")
    time.sleep(0.5)  # the kill is delivered; an orphan is reaped by init, or left a zombie
    assert not worker.exists() or "State:\tZ" in worker.read_text()


def test_a_stopped_tool_takes_its_runs_with_it(tmp_path):
    """The GPU suite stops a benchmark tool at the budget; the tool's own run (pretrain_gpt.py, in a
    session of its own) must end with it, not hold the GPU into the next command."""
    pid_file = tmp_path / "run.pid"
    run = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    tool = ("import sys; from tools.benchmark_gpt import run_pretrain; "
            f"run_pretrain([sys.executable, '-c', {run!r}], 120)")
    code, _ = benchmark_gpt.run_pretrain([sys.executable, "-c", tool], 4)
    assert code is None and pid_file.exists()  # stopped, after its run had started
    status = Path(f"/proc/{pid_file.read_text()}/status")
    deadline = time.monotonic() + 10
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_no_run_starts_past_the_budget_and_failures_are_named(tmp_path):
    runs = benchmark_gpt.Runs(_limits(tmp_path), "memo")
    assert runs([sys.executable, "-c", "raise SystemExit(3)"], "fails")[0] == "failed"
    oom = "import sys; print('CUDA out of memory', file=sys.stderr); sys.exit(1)"
    assert runs([sys.executable, "-c", oom], "oom")[0] == "out of memory"
    spent = benchmark_gpt.Runs(_limits(tmp_path, budget=0), "memo")
    assert spent([sys.executable, "-c", "print()"], "late") == ("not run (budget)", "")
    # stopped by the budget before its own --timeout: said so, not called a timeout
    short = benchmark_gpt.Runs(_limits(tmp_path, timeout=60, budget=1), "memo")
    assert short([sys.executable, "-c", "import time; time.sleep(30)"], "cut")[0] == "stopped (budget)"


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
    text = _trainer_output(monkeypatch, [(30000, 50000, 60000, 60000), (25000, 51000, 59000, 60000),
                                         (20000, 52000, 58000, 60000)])
    text = "MEMO: alpha 0.250 (bandwidth); per layer: ...\n" + text  # the line memo_setup._report prints
    monkeypatch.setattr(benchmark_memo.Runs, "__call__", lambda self, cmd, name: ("ok", text))
    monkeypatch.setattr(benchmark_memo, "device_name", lambda: "CPU")
    benchmark_memo.main(["--modes", "memo", "--seq-lengths", "1024", "--warmup", "1", "--log-dir", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith("| memo | 1024 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # iteration 3 only (the second line averages the first two); 60000 - 52000
    assert cells[2:8] == ["40.0%", "400.0", "3000", "0.250", "8000", "3"], row
    assert out[out.index("| mode | longest sequence that ran |") - 1] == "Longest sequence per mode:"


def test_the_profiled_iterations_are_left_out_of_the_gpt_means(monkeypatch, capsys):
    """--profile runs two iterations more: one under the profiler, one that pays for writing it;
    the means stop before them, and the profile's table follows the results table."""
    logged = [f"iteration {i} | lm loss: 2.0 | elapsed time per iteration (ms): {ms} | throughput per GPU "
              f"(TFLOP/s/GPU): 1.0 | tokens per second per GPU: 1000" for i, ms in
              enumerate([900, 100, 100, 500, 700], 1)]
    profile = ["[rank 0] profile of iteration 4 (ops by device time):", "| op | self device time (ms) |",
               "| aten::mm | 7.00 |"]
    text = "\n".join(logged[:4] + profile + logged[4:] + ["done"])
    seen = []
    monkeypatch.setattr(benchmark_gpt.Runs, "__call__", lambda self, cmd, name: (seen.append(cmd), ("ok", text))[1])
    monkeypatch.setattr(benchmark_gpt, "device_name", lambda: "CPU")
    benchmark_gpt.main(["--model", "tiny", "--seq-lengths", "128", "--iters", "3", "--warmup", "1", "--profile"])
    cmd = " ".join(seen[0])
    assert "--train-iters 5" in cmd and "--profile-step-start 3 --profile-step-end 4" in cmd
    out = capsys.readouterr().out
    # iteration 3: not 2 (its line averages 1 and 2), 4 (profiled) nor 5 (writing it)
    assert "| 128 | 1000 | 1.0 | n/a | 100 | none |" in out
    # the heading names the length (the GPU suite keeps headings followed by a table)
    assert out.rstrip().endswith("\n".join([f"Profile at 128: {profile[0]}"] + profile[1:])), out


def test_expandable_segments_reach_the_run_and_its_row():
    """--expandable-segments: each pretrain_gpt.py run starts with the allocator setting in its
    environment, and the table's command shows it (the launcher and interpreter left out)."""
    args = SimpleNamespace(shape="tiny", num_layers=2, iters=3, loss_chunk=0, bf16=False, extra=[],
                           expandable_segments=True)
    cmd = benchmark_memo.command(args, "full", 128)
    assert benchmark_gpt.shown(cmd).startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True pretrain_gpt.py ")
    probe = cmd[:2] + [sys.executable, "-c", "import os; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"]
    assert benchmark_gpt.run_pretrain(probe, 60) == (0, "expandable_segments:True\n")


class _QSized(TorchDispatchMode):
    """The operators that make a tensor at least as large as q, views left out."""
    VIEWS = {"permute", "view", "alias", "detach", "expand", "as_strided", "_unsafe_view", "t", "transpose"}

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        big = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.numel() >= self.numel]
        if big and name not in self.VIEWS:
            self.ops[name] += 1
        return out


def test_our_attention_step_adds_no_tensor_of_q_size_to_the_bare_kernels():
    """tools/benchmark_attention.py's "ours" against "kernel": both on megatron-core's [s, b, h, d]
    tensors as training hands them over, so the difference is our code's -- which makes no copy of
    q, k, v, out or dout and accumulates no gradient (views only, GQA's k and v not repeated)."""
    from tools.benchmark_attention import steps

    args = SimpleNamespace(batch=2, heads=4, kv_heads=2, head_dim=16, backend="auto")
    kernel, bare, ours, _ = steps(256, args, torch.device("cpu"), torch.float32)
    counts = []
    for step in (bare, ours, ours):  # the second "ours": no gradient accumulated into the first's
        with _QSized(256 * 2 * 2 * 16) as seen:  # k's size: a repeated k or v would show
            step()
        counts.append(seen.ops)
    assert counts[0] and counts[1] == counts[2] == counts[0], (kernel.name, counts)


@pytest.mark.parametrize("ring", [2, 4])
def test_the_ring_table_times_the_whole_sequences_gradients(ring):
    """--ring's positions, threads joined by loopback groups, do the work of the whole-sequence
    kernel between them: their dq and dK/dV, put together, are its gradients (fp32: the blocks'
    merges and accumulations reorder sums, ~1e-6)."""
    from megatron.longseq.attention.kernel_choice import select_kernel
    from megatron.longseq.attention.kernels import default_scale
    from megatron.longseq.attention.loopback import run_threads
    from megatron.longseq.attention.placement import local_token_indices
    from megatron.longseq.parallel_state import RankGrid
    from tools.benchmark_attention import inputs, kernel_views, position_inputs, ring_position

    args, device = SimpleNamespace(batch=2, heads=4, kv_heads=2, head_dim=16), torch.device("cpu")
    leaves, dout = inputs(64, args, device, torch.float32)
    kernel, scale = select_kernel("auto", device, torch.float32, 16), default_scale(16, None)
    ranks = run_threads(ring_position, RankGrid(world_size=ring, cp=ring), position_inputs(leaves, dout, ring),
                        kernel, scale)
    q, k, v, dout_k = kernel_views(leaves, dout)
    out, lse = kernel.forward(q, k, v, True, scale)
    want = kernel.backward(dout_k, q, k, v, out, lse, True, scale)
    for j, (dq, dkv) in enumerate(ranks):
        idx = local_token_indices(64, 1, ring, 0, j)
        for got, ref in ((dq, want[0]), (dkv[0], want[1]), (dkv[1], want[2])):
            torch.testing.assert_close(got, ref[:, :, idx], atol=1e-5, rtol=1e-5)


def test_a_length_out_of_memory_gets_its_row_and_the_next_one_runs(capsys):
    from tools.benchmark_attention import out_of_memory_row

    def measure(seq, *rest):
        if seq > 300:
            raise RuntimeError("cuDNN Frontend error: CUDNN_STATUS_ALLOC_FAILED")  # not torch's own error type
        if seq > 100:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if seq < 10:
            raise RuntimeError("shapes do not match")
        return seq
    device = torch.device("cpu")
    assert [out_of_memory_row(measure, s, None, device, None) for s in (400, 200, 50)] == [None, None, 50]
    assert capsys.readouterr().out == "| 400 | out of memory |\n| 200 | out of memory |\n"
    with pytest.raises(RuntimeError, match="shapes"):  # any other failure is the caller's
        out_of_memory_row(measure, 5, None, device, None)


def test_gpu_suite_dry_run_on_cpu(tmp_path, capsys, monkeypatch):
    """tools/gpu_suite.py without CUDA: a part that needs it says so in one line; the attention
    part runs its tiny CPU version end to end; suite.md, suite.json and suite.log are written."""
    import json

    from tools import gpu_suite

    monkeypatch.setattr(gpu_suite, "device_name", lambda: "CPU")  # the dry run also on a GPU machine
    assert gpu_suite.main([str(tmp_path), "--parts", "tests", "bandwidth", "attention"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "tests: needs CUDA, skipped" in printed and "bandwidth: needs CUDA, skipped" in printed
    report = json.loads((tmp_path / "suite.json").read_text())
    assert report["parts"]["tests"] == {"status": "skipped (needs CUDA)"}
    assert [r["status"] for r in report["parts"]["attention"]["commands"]] == ["ok"]
    assert report["command"] == "tools/gpu_suite.py " + str(tmp_path) + " --parts tests bandwidth attention"
    md = (tmp_path / "suite.md").read_text()
    assert "load-balanced ring blocks" in md and "| 256 | torch-cpu-flash |" in md
    assert "#### attention/bench: tools/benchmark_attention.py" in (tmp_path / "suite.log").read_text()
    assert not (tmp_path / "running.log").exists()  # moved into suite.log once the command ended


def test_gpu_suite_writes_its_record_after_every_command(tmp_path, monkeypatch):
    """A suite stopped from outside (the device command's time limit) keeps what it ran: the
    record is rewritten after each command, and the running one's output is in running.log."""
    import json

    from tools import gpu_suite

    said = tmp_path / "said"
    steps = [("first", [sys.executable, "-c", "print('| a | 1 |')"], 30),
             ("second", [sys.executable, "-c", f"import pathlib; print('half', flush=True); pathlib.Path("
                                               f"{str(said)!r}).write_text(pathlib.Path({str(tmp_path)!r}, "
                                               f"'running.log').read_text())"], 30)]
    monkeypatch.setitem(gpu_suite.PARTS, "fake", lambda cuda: steps)
    suite = gpu_suite.Suite(tmp_path, 60.0, cuda=False)
    written = []
    monkeypatch.setattr(suite, "save", lambda real=suite.save: (real(), written.append(
        json.loads((tmp_path / "suite.json").read_text())["parts"]["fake"])))
    assert suite.part("fake")
    assert said.read_text() == "half\n"  # what the second command had printed, while it ran
    labels = [[c["label"] for c in w["commands"]] for w in written]
    assert labels == [["first"], ["first", "second"], ["first", "second"]]
    assert written[0]["status"] == "running" and written[-1]["status"] == "ok"
    assert "| a | 1 |" in (tmp_path / "suite.md").read_text()


def test_gpu_suite_budget_and_smoke_table(tmp_path):
    """Past the budget no command starts; each feature's curve is compared with the plain run's,
    except packed documents (they attend within documents: another model)."""
    from tools import gpu_suite

    suite = gpu_suite.Suite(tmp_path, 0.0, cuda=False)
    assert suite.command("x", [sys.executable, "-c", "print()"], 10)[0] == "not run (budget)"
    suite.close()
    line = "lm loss: {} | elapsed time per iteration (ms): 10.0\n"
    runs = {"plain": ("ok", line.format("2.0E+00") * 3), "MEMO": ("ok", line.format("2.5E+00") * 3),
            "packed documents": ("ok", line.format("1.0E+00") * 3)}
    rows = gpu_suite.smoke_table(runs)[2:]
    assert rows == ["| plain | ok | 3 | 2.000000 | 0 | 10.0 |", "| MEMO | ok | 3 | 2.500000 | 0.5 | 10.0 |",
                    "| packed documents | ok | 3 | 1.000000 | n/a | 10.0 |"]
