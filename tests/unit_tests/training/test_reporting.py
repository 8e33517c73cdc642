"""The training log as Megatron-LM's training_log writes it: which iterations print a line, what the
interval numbers average over, the timers' units, and what time counts as iteration time."""
from types import SimpleNamespace

import pytest

from megatron.training import reporting
from megatron.training.timers import Timers


def _args(**over):
    args = dict(log_interval=3, tensorboard_log_interval=1, timing_log_level=1, log_timers_to_tensorboard=True,
                log_memory_to_tensorboard=False, log_throughput=False, log_loss_scale_to_tensorboard=False,
                log_world_size_to_tensorboard=True, train_iters=9, global_batch_size=8, world_size=4,
                peak_tflops=1.0, attention_backend="auto", timing_log_option="minmax", log_memory_interval=None,
                seq_length=16)
    return SimpleNamespace(**{**args, **over})


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def reporter(monkeypatch):
    clock, tb = _Clock(), []
    monkeypatch.setattr(reporting, "time", clock)
    monkeypatch.setattr(reporting, "num_floating_point_operations", lambda args, batch: 1.0)
    for name in ("memory_line", "attention_kernel_line", "pipeline_memory_line"):
        monkeypatch.setattr(reporting, name, lambda *a: "")
    scalars = SimpleNamespace(scalars=lambda values, step, samples=None: tb.append((step, dict(values))))
    rep = reporting.Reporter(_args(), SimpleNamespace(index=lambda axis: 0), Timers(1, cuda=False), scalars)
    return rep, clock, tb


def _step(rep, clock, iteration, at, loss, fb_s):
    clock.now = at
    rep.timers("forward-backward", 0).elapsed_s += fb_s
    state = SimpleNamespace(iteration=iteration, consumed_train_samples=8 * iteration, memo=None, model=[],
                            pipeline=None, optimizer=SimpleNamespace(loss_scale=1.0, param_groups=[{"lr": 0.1}],
                                                                     last_params_norm=None))
    rep.iteration(state, {"lm loss": loss}, grad_norm=1.0, num_zeros=None, skipped=False)


def test_first_iteration_is_logged_and_its_interval_goes_on(reporter, capsys):
    """--log-interval 3: iteration 1 prints a line (the start-up, 10 s), without resetting
    anything; iteration 3's line averages iterations 1-3; an evaluation between them (100 s)
    is not iteration time. Timers: per iteration, ms on the last rank's line, s in tensorboard."""
    rep, clock, tb = reporter
    _step(rep, clock, 1, at=10.0, loss=3.0, fb_s=1.0)
    assert rep.logged
    _step(rep, clock, 2, at=12.0, loss=2.0, fb_s=0.5)
    assert not rep.logged
    with rep.paused():
        clock.now = 112.0
    _step(rep, clock, 3, at=115.0, loss=1.0, fb_s=0.5)
    lines = [x for x in capsys.readouterr().out.splitlines() if "iteration " in x or "forward-backward" in x]
    assert "iteration        1/       9" in lines[0] and "(ms): 10000.0 |" in lines[0]
    assert "lm loss: 3.000000E+00 |" in lines[0]
    assert lines[1] == "    forward-backward ...............................: (1000.00, 1000.00)"
    assert "iteration        3/       9" in lines[2] and "(ms): 5000.0 |" in lines[2]  # (115 - 100) / 3
    assert "lm loss: 2.000000E+00 |" in lines[2]  # the mean of 3, 2, 1
    assert lines[3] == "    forward-backward ...............................: (666.67, 666.67)"
    times = [(step, v) for step, values in tb for k, v in values.items() if k.endswith("-time")]
    assert times == [(1, pytest.approx(1.0)), (3, 5.0), (3, pytest.approx(2.0 / 3))]
    assert [k for k in tb[0][1] if k in ("loss-scale", "world-size")] == ["world-size"]


def test_a_resumed_run_logs_its_first_iteration_and_then_every_interval(reporter, capsys):
    rep, clock, _ = reporter
    logged = []
    for it in range(7, 13):
        _step(rep, clock, it, at=float(it), loss=1.0, fb_s=0.0)
        logged += [it] if rep.logged else []
    assert logged == [7, 9, 12]


@pytest.mark.parametrize("dp_rank, printed", [(0, True), (1, False)])
def test_the_memory_report_comes_from_every_first_data_parallel_rank(monkeypatch, capsys, dp_rank, printed):
    """Megatron's report_memory: every rank of data-parallel rank 0 (each pipeline stage, tp and cp
    rank: their memory differs), not global rank 0 alone, which is one stage's."""
    monkeypatch.setattr(reporting, "memory_line", lambda iteration: f"memory after {iteration}")
    monkeypatch.setattr(reporting, "attention_kernel_line", lambda *a: "")
    monkeypatch.setattr(reporting, "print_rank_0", lambda *a: None)  # as a rank other than 0 sees it
    monkeypatch.setattr(reporting, "num_floating_point_operations", lambda args, batch: 1.0)
    pgs = SimpleNamespace(index=lambda axis: dp_rank if axis == "dp" else 1)
    rep = reporting.Reporter(_args(timing_log_level=0), pgs, Timers(0, cuda=False),
                             SimpleNamespace(scalars=lambda *a, **k: None))
    _step(rep, _Clock(), 1, at=1.0, loss=1.0, fb_s=0.1)
    assert ("memory after 1" in capsys.readouterr().out) == printed


@pytest.mark.parametrize("option, shown", [
    ("max", "\n    optimizer ......................................: 4.00"),
    ("minmax", "\n    optimizer ......................................: (1.00, 4.00)"),
    ("all", "\n  optimizer:\n     rank  0: 1.00\n     rank  2: 2.00\n     rank 11: 4.00"),
])
def test_timing_log_option_shows_megatrons_three_views(option, shown):
    """--timing-log-option: each timer's max over the ranks, its (min, max), or every rank's that
    ran it (Megatron's layout), per iteration (here over 2 iterations)."""
    ms = [2.0, 0.0, 4.0] + [0.0] * 8 + [8.0] if option == "all" else [2.0, 8.0]  # per rank, or (min, max)
    assert reporting._timer_lines(option, "optimizer", ms, 2) == shown
    assert reporting.TIMES_HEADER[option].endswith("(ms):")


@pytest.mark.parametrize("start, interval, printed", [(0, None, [1, 3]), (6, None, [7, 9]), (0, 6, [1, 3, 6, 12])])
def test_memory_is_reported_as_megatron_does(monkeypatch, capsys, start, interval, printed):
    """Megatron's report_memory: at each line up to the first one past the run's first iteration
    (the optimizer state has been made by then), then every --log-memory-interval."""
    monkeypatch.setattr(reporting, "memory_line", lambda iteration: f"memory after {iteration}")
    monkeypatch.setattr(reporting, "attention_kernel_line", lambda *a: "")
    monkeypatch.setattr(reporting, "num_floating_point_operations", lambda args, batch: 1.0)
    rep = reporting.Reporter(_args(timing_log_level=0, log_memory_interval=interval, train_iters=13),
                             SimpleNamespace(index=lambda axis: 0), Timers(0, cuda=False),
                             SimpleNamespace(scalars=lambda *a, **k: None), start_iteration=start)
    for it in range(start + 1, 13):
        _step(rep, _Clock(), it, at=float(it), loss=1.0, fb_s=0.1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory after")]
    assert lines == [f"memory after {i}" for i in printed]


def test_tensorboard_times_are_by_iteration_and_throughput_starts_with_the_first_line(monkeypatch):
    """Megatron writes iteration-time (not for the first line) and throughput (for every line) at
    the iteration only: no 'vs samples' twins."""
    monkeypatch.setattr(reporting, "num_floating_point_operations", lambda args, batch: 1e12)
    for name in ("memory_line", "attention_kernel_line"):
        monkeypatch.setattr(reporting, name, lambda *a: "")
    written = []
    tb = SimpleNamespace(scalars=lambda values, step, samples=None: written.append((step, samples, sorted(values))))
    rep = reporting.Reporter(_args(timing_log_level=0, log_throughput=True, tensorboard_log_interval=100),
                             SimpleNamespace(index=lambda axis: 0), Timers(0, cuda=False), tb)
    for it in (1, 2, 3):
        _step(rep, _Clock(), it, at=float(it), loss=1.0, fb_s=0.1)
    lines = [w for w in written if "forward-backward-time" not in w[2]]  # the timers' own scalars aside
    assert lines == [(1, None, ["throughput"]), (3, None, ["iteration-time", "throughput"])]


def test_nan_iterations_are_skipped_ones_with_a_loss_that_is_not_finite():
    """Megatron counts an iteration once however many loss keys are NaN, and only if it was skipped."""
    from megatron.training.metrics import IntervalStats

    stats = IntervalStats()
    stats.add({"lm loss": float("nan")}, skipped=False)  # not skipped: in the mean, not counted
    stats.add({"lm loss": float("nan"), "aux": float("inf")}, skipped=True)
    stats.add({"lm loss": 1.0}, skipped=True)
    assert (stats.iterations, stats.skipped, stats.nan) == (3, 2, 1)


def test_tensorboard_gets_every_setting_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.training.metrics import TensorboardLogger

    tb = TensorboardLogger(str(tmp_path))
    tb.args(SimpleNamespace(lr=0.001, data_path=["a", "b"]), iteration=7)
    tb.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0}).Reload()
    texts = {tag: events.Tensors(tag)[0] for tag in events.Tags()["tensors"]}
    assert {tag.split("/")[0] for tag in texts} == {"lr", "data_path"}
    assert all(event.step == 7 for event in texts.values())


def test_an_evaluation_only_run_writes_no_scalars(monkeypatch):
    """--skip-train: Megatron's final evaluation writes to tensorboard only when it trained."""
    from megatron.training import training

    seen = []
    monkeypatch.setattr(training, "evaluate_and_print", lambda name, f, it, state, args, pgs, tb, periodic:
                        seen.append((name, tb.writer is None if hasattr(tb, "writer") else False)))
    monkeypatch.setattr(training, "print_rank_0", lambda *a: None)
    args = SimpleNamespace(skip_train=True, save=None, eval_iters=1)
    live = SimpleNamespace(scalars=lambda *a, **k: None)  # the run's logger
    training._finish(args, SimpleNamespace(iteration=3), None, None, iter([]), lambda: iter([]), live)
    assert seen == [("validation", True), ("test", True)]
    args.skip_train, seen[:] = False, []
    training._finish(args, SimpleNamespace(iteration=3), None, None, iter([]), lambda: iter([]), live)
    assert seen == [("validation", False), ("test", False)]
