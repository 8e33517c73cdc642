"""The rerun state machine (--rerun-mode) as Megatron defines it: which runs happen, which exit
status and checkpoint follow, for real and injected rejections, fatal and not (pure: one rank, its
`any_rank` the identity; the runs through pretrain_gpt.py are in tests/functional_tests)."""
import math
import pickle

import pytest
import torch

from megatron.training.rerun import (
    EXIT_FAILED_VALIDATION, EXIT_RESUME_ELSEWHERE, GRAD_CHECKS, SPIKY_SAMPLES, Injector, Replay,
    RerunMachine, loss_checks, relative_difference, restore_states)

HERE, ELSEWHERE = ("node-a", 0), ("node-b", 0)


def machine(mode="validate_results", rate=0, kind="transient_error", where=HERE, spiky=False):
    logs = []
    m = RerunMachine(mode, Injector(rate, kind, rank=0, seed=0), lambda flags: list(flags), where,
                     loss_checks(nan=True, spiky=spiky), log=logs.append, say=logs.append)
    m.logs = logs
    return m


def iterate(m, iteration, losses_of_run, data=None):
    """One iteration: run while the machine asks, run r giving losses_of_run(r). Returns
    (runs, outcome)."""
    runs = 0
    while m.should_run(data, iteration):
        m.validate(losses_of_run(runs))
        runs += 1
    return runs, m.outcome()


def clean(m, iterations=1):
    for i in range(1, iterations + 1):
        assert iterate(m, i, lambda r: [2.0, 2.1]) == (1, (False, 0))


def test_a_clean_iteration_runs_once_in_every_mode():
    for mode in ("disabled", "validate_results"):
        clean(machine(mode), 3)
    m = machine("report_stats")  # every iteration twice, nothing else
    assert [iterate(m, i, lambda r: [2.0, 2.1]) for i in (1, 2)] == [(2, (False, 0))] * 2


def test_disabled_and_the_first_iteration_stop_on_a_nan_loss():
    with pytest.raises(FloatingPointError, match="loss is NaN"):
        iterate(machine("disabled"), 1, lambda r: [math.nan])
    m = machine()
    with pytest.raises(FloatingPointError, match="loss is Inf"):  # nothing to checkpoint before a step
        iterate(m, 1, lambda r: [1.0, math.inf])


def test_a_reproducible_nan_checkpoints_and_asks_for_other_hardware_which_calls_it_right():
    m = machine()
    clean(m)
    assert iterate(m, 2, lambda r: [1.0, math.nan]) == (2, (True, EXIT_RESUME_ELSEWHERE))
    saved = m.state_dict()
    call, value, injected = saved["failure"]
    assert saved["iteration"] == 2 and call == ("loss is NaN", 2) and value == "nan" and not injected
    assert pickle.loads(pickle.dumps(saved)) == saved  # equal to its copy: torch_dist compares the ranks' states
    same = machine()  # resumed on the hardware that reproduced it: resume again elsewhere
    same.load_state_dict(saved)
    assert iterate(same, 2, lambda r: [1.0, math.nan]) == (1, (False, EXIT_RESUME_ELSEWHERE))
    other = machine(where=ELSEWHERE)
    other.load_state_dict(saved)
    assert iterate(other, 2, lambda r: [1.0, math.nan]) == (1, (False, EXIT_FAILED_VALIDATION))
    assert any("the result is right" in line for line in other.logs)


def test_a_nan_that_does_not_come_back_in_place_is_a_transient_fault():
    m = machine()
    clean(m)
    assert iterate(m, 2, lambda r: [math.nan] if r == 0 else [1.5]) == (2, (True, EXIT_FAILED_VALIDATION))
    assert any("possible transient error" in line for line in m.logs)


def test_a_nan_that_differs_on_other_hardware_is_the_first_hardwares_persistent_fault():
    m = machine()
    clean(m)
    iterate(m, 2, lambda r: [math.nan])
    other = machine(where=ELSEWHERE)
    other.load_state_dict(m.state_dict())
    assert iterate(other, 2, lambda r: [3.0]) == (1, (False, EXIT_FAILED_VALIDATION))
    assert any("possible persistent error" in line for line in other.logs)


@pytest.mark.parametrize("kind, in_place, elsewhere", [
    ("transient_error", (2, (True, EXIT_FAILED_VALIDATION)), None),
    ("persistent_error", (2, (True, EXIT_RESUME_ELSEWHERE)), "possible persistent error"),
    ("correct_result", (2, (True, EXIT_RESUME_ELSEWHERE)), "the result is right"),
])
def test_injected_errors_take_megatrons_paths(kind, in_place, elsewhere):
    """--error-injection-rate 1: the first check of the second iteration is rejected; the same
    finite losses come back every time, and the injected type alone decides."""
    m = machine(rate=1, kind=kind)
    clean_losses = lambda r: [2.0, 2.1]  # noqa: E731
    assert iterate(m, 1, clean_losses) == (1, (False, 0))  # the first iteration is not validated
    assert iterate(m, 2, clean_losses) == in_place
    if elsewhere is None:
        return
    other = machine(rate=1, kind=kind, where=ELSEWHERE)
    other.load_state_dict(m.state_dict())
    assert iterate(other, 2, clean_losses) == (1, (False, EXIT_FAILED_VALIDATION))
    assert any(elsewhere in line for line in other.logs)


def _injections(iterations) -> list:
    injector, hits = Injector(10, "transient_error", rank=3, seed=0), []
    for i in iterations:
        hits.append(injector.inject(i, ("loss", 1)))
        injector.pending = None  # judged
    return hits


def test_injection_rate_n_rejects_about_one_check_in_n():
    hits = _injections(range(2000))
    assert 150 < sum(hits) < 250
    # a function of (seed, iteration, call): a resumed run, starting at iteration 1000 with nothing
    # drawn yet, injects where the uninterrupted run did
    assert _injections(range(1000, 2000)) == hits[1000:]


def test_a_spiky_loss_reruns_and_goes_on_with_the_rerun():
    m = machine(spiky=True)
    assert iterate(m, 1, lambda r: [30.0]) == (1, (False, 0))  # the start-up's loss is no yardstick
    for i in range(2, SPIKY_SAMPLES + 2):  # the yardstick: the largest of the next 100 losses
        assert iterate(m, i, lambda r: [2.0]) == (1, (False, 0))
    assert iterate(m, 102, lambda r: [19.9]) == (1, (False, 0))
    assert iterate(m, 103, lambda r: [20.0]) == (2, (False, 0))  # >= 10 x 2.0: not fatal
    assert iterate(m, 104, lambda r: [20.0] if r == 0 else [2.0]) == (2, (False, 0))


def test_without_reruns_a_spiky_loss_is_logged_and_training_goes_on():
    m = machine("disabled", spiky=True)
    for i in range(1, SPIKY_SAMPLES + 1):  # Megatron's disabled mode samples from the first iteration
        iterate(m, i, lambda r: [2.0])
    assert iterate(m, 101, lambda r: [25.0]) == (1, (False, 0))
    assert m.logs == ["rerun: Spiky loss (25.0) at iteration 101: not rerun (--rerun-mode disabled)"]


def grads(m, iteration, norm_of_run):
    """One iteration whose losses are fine and whose gradient norm is norm_of_run(run)."""
    runs = 0
    while m.should_run(None, iteration):
        m.validate([2.0])
        m.validate([norm_of_run(runs)], checks=GRAD_CHECKS)
        runs += 1
    return runs, m.outcome()


def test_a_nan_gradient_takes_the_rerun_path_of_a_nan_loss():
    """megatron-core's checks on the gradient norm, fatal as the loss's NaN and Inf."""
    m = machine()
    assert grads(m, 1, lambda r: 1.0) == (1, (False, 0))
    assert grads(m, 2, lambda r: math.nan) == (2, (True, EXIT_RESUME_ELSEWHERE))
    assert m.state_dict()["failure"][0] == ("grad norm is NaN", 1)
    m = machine()
    grads(m, 1, lambda r: 1.0)
    assert grads(m, 2, lambda r: [math.inf, 1.0][r]) == (2, (True, EXIT_FAILED_VALIDATION))  # transient
    with pytest.raises(FloatingPointError, match="grad norm is Inf"):
        grads(machine("disabled"), 1, lambda r: math.inf)


def test_a_rerun_sees_the_same_micro_batches_and_random_streams():
    m, data = machine(), Replay(iter(range(100)))
    seen = []

    def run(r):
        seen.append(([next(data), next(data)], torch.rand(3)))
        return [math.nan]

    clean(m)
    assert iterate(m, 2, run, data) == (2, (True, EXIT_RESUME_ELSEWHERE))
    (batch0, rand0), (batch1, rand1) = seen
    assert batch0 == batch1 == [0, 1]
    assert torch.equal(rand0, rand1)
    data.advance()
    assert next(data) == 2


def test_report_stats_runs_every_iteration_twice_and_measures_the_difference():
    m = machine("report_stats")
    assert iterate(m, 1, lambda r: [2.0, 4.0]) == (2, (False, 0))
    assert iterate(m, 2, lambda r: [2.0, 4.0 * (1 + 1e-3 * r)]) == (2, (False, 0))
    compared, largest = m.stats()
    assert compared == 4 and largest == pytest.approx(1e-3, rel=1e-3)
    assert m.stats() == (0, 0.0)
    assert grads(m, 3, lambda r: 5.0 * (1 + 1e-2 * r)) == (2, (False, 0))  # a gradient norm is its own value
    compared, largest = m.stats()
    assert compared == 2 and largest == pytest.approx(1e-2, rel=1e-2)


def test_relative_difference():
    assert relative_difference(1.0, 1.0) == 0.0
    assert relative_difference(math.nan, math.nan) == 0.0
    assert relative_difference(math.nan, 1.0) == math.inf
    assert relative_difference(math.inf, 1.0) == math.inf
    assert relative_difference(1.0, 3.0) == 1.0


def test_nothing_to_checkpoint_unless_a_rerun_elsewhere_is_pending():
    m = machine()
    clean(m, 2)
    assert m.state_dict() is None


@pytest.mark.parametrize("mode", ["disabled", "report_stats"])
def test_a_pending_rerun_is_ignored_by_runs_that_do_not_validate(mode):
    """Only validate_results judges a repeated iteration; another mode trains on (a report_stats
    run that took the state would end in exit 17 with no verdict)."""
    first = machine()
    clean(first)
    iterate(first, 2, lambda r: [math.nan])
    other = machine(mode, where=ELSEWHERE)
    restore_states(other, [first.state_dict()], log=other.logs.append)
    assert other.logs == [f"rerun: the checkpoint asks to rerun iteration 2 on 1 ranks; ignored (--rerun-mode {mode})"]
    assert iterate(other, 2, lambda r: [2.0]) == (2 if mode == "report_stats" else 1, (False, 0))


def test_the_checked_values_are_the_local_losses_and_the_gradient_norm():
    """One transfer: each micro-batch's loss sum and, under --check-for-nan-in-loss-and-grad, the
    norm of this rank's gradient buffer; a NaN gradient shows in it."""
    from types import SimpleNamespace

    from megatron.training.training import _checked_values

    reports = [{"lm loss": torch.tensor([3.0, 4.0])}, {"lm loss": torch.tensor([1.0, 4.0])}]
    grad_data = torch.tensor([3.0, 4.0, 0.0])
    state = SimpleNamespace(optimizer=SimpleNamespace(buffer=SimpleNamespace(grad_data=grad_data)))
    args = SimpleNamespace(check_for_nan_in_loss_and_grad=True)
    assert _checked_values(reports, state, args) == ([3.0, 1.0], 5.0)
    grad_data[2] = math.nan
    assert math.isnan(_checked_values([], state, args)[1])  # a stage without losses checks its gradients too
    args.check_for_nan_in_loss_and_grad = False  # as fp16's dynamic scaling sets it
    assert _checked_values(reports, state, args) == ([3.0, 1.0], None)
    assert _checked_values([], state, args) == ([], None)


def test_a_report_of_one_value_is_averaged_over_micro_batches_as_megatron_does():
    """Megatron's older loss functions report {'lm loss': mean} (averaged over data parallel by the
    function itself): train_step takes the micro-batches' mean, and the loss checks see each value."""
    from megatron.training.training import _local_losses, reduce_reports
    from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world

    init_single_rank_world()
    pgs = grid_groups()
    means = [{"lm loss": torch.tensor(2.0)}, {"lm loss": torch.tensor(4.0)}]
    assert reduce_reports(means, pgs, torch.device("cpu")) == {"lm loss": 3.0}
    assert [v.item() for v in _local_losses(means)] == [2.0, 4.0]
    pairs = [{"lm loss": torch.tensor([3.0, 4.0])}, {"lm loss": torch.tensor([1.0, 4.0])}]
    assert reduce_reports(pairs, pgs, torch.device("cpu")) == {"lm loss": 0.5}
    with pytest.raises(ValueError, match=r"reports 'lm loss' as 3 values: report \[sum, count\] or one value"):
        reduce_reports([{"lm loss": torch.ones(3)}], pgs, torch.device("cpu"))


def test_a_nan_evaluation_loss_stops_the_run():
    from megatron.training.training import _check_evaluation

    _check_evaluation([{"lm loss": torch.tensor([2.0, 4.0])}], 5)
    with pytest.raises(FloatingPointError, match=r"evaluation loss is NaN \(nan\) at iteration 5"):
        _check_evaluation([{"lm loss": torch.tensor([2.0, 4.0])}, {"lm loss": torch.tensor([math.nan, 4.0])}], 5)
