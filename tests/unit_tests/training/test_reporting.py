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
                peak_tflops=1.0, attention_backend="auto", timing_log_option="minmax")
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


@pytest.mark.parametrize("option, shown", [("max", "4.00"), ("minmax", "(1.00, 4.00)"), ("all", "1.00 | 4.00 | 2.00")])
def test_timing_log_option_shows_megatrons_three_views(option, shown):
    """--timing-log-option: each timer's max over the ranks, its (min, max), or every rank's, per
    iteration (here over 2 iterations)."""
    assert reporting._timer_values(option, [2.0, 8.0, 4.0], 2) == shown
    assert reporting.TIMES_HEADER[option].endswith("(ms):")
