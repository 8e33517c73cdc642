"""Megatron's --profile flags: which iterations are profiled, what is written, what is refused."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.training.bad_input import ArgsError
from megatron.training.profiling import StepProfiler
from tests.unit_tests.dist_utils import init_single_rank_world
from tests.unit_tests.model_utils import tiny_args


def _profiler(tmp_path, extra="", ranks=None):
    """`ranks`: --profile-ranks as a rank of a larger run would see them (validation here knows one rank)."""
    init_single_rank_world()
    args = tiny_args(f"--profile --use-pytorch-profiler --tensorboard-dir {tmp_path} {extra}")
    args.profile_ranks = ranks or args.profile_ranks
    return StepProfiler(args, torch.device("cpu"))


def _steps(profiler, first, last, work):
    """Iterations first..last (1-based) as the training loop runs them."""
    for it in range(first, last + 1):
        profiler.before_step(it - 1)
        work(it)
        profiler.after_step(it, logged=True)


def _named_op(it):
    with torch.profiler.record_function(f"step{it}"):
        torch.ones(8).sum()


def test_megatrons_window_profiles_the_11th_and_12th_iterations(tmp_path, capsys):
    """--profile-step-start 10 --profile-step-end 12 (Megatron's defaults): the iterations after 10
    completed ones up to 12; the table is printed and the trace written under --tensorboard-dir."""
    with _profiler(tmp_path) as profiler:
        _steps(profiler, 1, 14, _named_op)
    out = capsys.readouterr().out
    assert "[rank 0] profile of iterations 11-12" in out
    ops = {line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| ")}
    assert {"step11", "step12"} <= ops and not ops & {"step10", "step13"}, ops
    assert list(Path(tmp_path).glob("rank0.*.pt.trace.json"))


def test_a_run_that_ends_inside_the_window_reports_what_ran(tmp_path, capsys):
    with _profiler(tmp_path, "--profile-step-start 1 --profile-step-end 5") as profiler:
        _steps(profiler, 1, 3, _named_op)  # an exit condition after iteration 3
    assert "profile of iterations 2-3," in capsys.readouterr().out  # not the window it did not reach


def test_a_run_resumed_inside_the_window_profiles_the_rest_of_it(tmp_path, capsys):
    """Saved after 2 iterations, resumed with the window (1, 4]: iterations 3 and 4 (the window
    started only at exactly --profile-step-start completed iterations: nothing, silently)."""
    with _profiler(tmp_path, "--profile-step-start 1 --profile-step-end 4") as profiler:
        _steps(profiler, 3, 6, _named_op)
    out = capsys.readouterr().out
    assert "profile of iterations 3-4," in out
    ops = {line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| ")}
    assert {"step3", "step4"} <= ops and not ops & {"step5", "step6"}, ops


def test_a_run_resumed_past_the_window_says_so(tmp_path, capsys):
    with _profiler(tmp_path, "--profile-step-start 1 --profile-step-end 4") as profiler:
        _steps(profiler, 5, 6, _named_op)
    out = capsys.readouterr().out
    assert "profile of" not in out
    assert out.count("--profile: the run starts after 4 iterations, past the window (1, 4]: nothing is profiled") == 1


def test_a_rank_outside_profile_ranks_profiles_nothing(tmp_path, capsys):
    # this rank (0) in a run of two with --profile-ranks 1
    with _profiler(tmp_path, "--profile-step-start 0 --profile-step-end 1", ranks=[1]) as profiler:
        _steps(profiler, 1, 2, _named_op)
    assert "profile of" not in capsys.readouterr().out and not list(Path(tmp_path).iterdir())


@pytest.mark.parametrize("flags, message", [
    ("--profile", "--profile without --use-pytorch-profiler starts CUDA's profiler (nsys), which needs CUDA"),
    ("--profile --use-pytorch-profiler --profile-step-start 5 --profile-step-end 5",
     "need 0 <= --profile-step-start 5 < --profile-step-end 5"),
    ("--profile --use-pytorch-profiler --profile-ranks 0 1", "--profile-ranks [1] outside the 1 ranks"),
    ("--record-memory-history", "--record-memory-history records the CUDA allocator: needs CUDA"),
])
def test_bad_profile_flags_are_refused_before_any_work(flags, message):
    with pytest.raises(ArgsError) as err:
        tiny_args(flags)
    assert message in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_table_ranks_ops_by_device_time(tmp_path, capsys):
    init_single_rank_world()
    args = tiny_args(f"--profile --use-pytorch-profiler --profile-step-start 0 --profile-step-end 1 "
                     f"--tensorboard-dir {tmp_path}")
    a = torch.randn(2048, 2048, device="cuda")
    with StepProfiler(args, torch.device("cuda")) as profiler:
        _steps(profiler, 1, 2, lambda it: (a @ a).sum().item())
    out = capsys.readouterr().out
    # self device time sits on the kernels (the GEMM's own name), not on the aten ops launching them
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert "(ops by device time)" in out and len(rows) > 2 and float(rows[1][1]) > 0, out


def test_memory_history_starts_before_the_model_and_snapshots_an_out_of_memory(tmp_path, monkeypatch):
    """--record-memory-history: recording starts at the call (before set-up builds the model, as
    pretrain makes it), and the out-of-memory observer writes oom_rank<N>_<name> beside the path."""
    import pickle

    from megatron.training import profiling

    init_single_rank_world()
    events, observers = [], []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **k: events.append(("record", k)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": ["at the peak"]})
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    args = SimpleNamespace(record_memory_history=True, memory_snapshot_path=str(tmp_path / "snap.pickle"))
    profiling.start_memory_history(args)
    assert events == [("record", {"max_entries": 100000})] and len(observers) == 1
    observers[0](0, 2**30, 2**34, 2**20)  # what the allocator calls when it cannot serve 1 GiB
    with open(tmp_path / "oom_rank0_snap.pickle", "rb") as f:
        assert pickle.load(f) == {"segments": ["at the peak"]}
    events.clear()
    profiling.start_memory_history(SimpleNamespace(record_memory_history=False))
    assert not events


def test_pretrain_starts_the_memory_history_before_building_the_model():
    import inspect

    from megatron.training import training

    source = inspect.getsource(training.pretrain)
    assert source.index("start_memory_history(args)") < source.index("setup(args, pgs, model_provider)")
