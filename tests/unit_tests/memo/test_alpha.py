import pytest

from megatron.longseq.memo.alpha import HostMemoryError, LayerProfile, solve_alpha

GB = 2**30
# one layer of a 7B model at 128K tokens on 8-way TP, roughly: input and attention output
# 128 MiB each, the other skeletal tensors 1.5 GiB, 60 ms forward
LAYER = LayerProfile(128 * 2**20, 128 * 2**20, int(1.5 * GB), 0.060)


@pytest.mark.parametrize("bandwidth, seconds", [(0.0, 0.06), (float("nan"), 0.06), (20 * GB, float("nan"))])
def test_a_broken_measurement_is_refused_not_planned(bandwidth, seconds):
    """Zero bandwidth divided by zero; a NaN layer time gave alpha 1 (every token swapped)."""
    layer = LayerProfile(LAYER.input_bytes, LAYER.attention_bytes, LAYER.other_bytes, seconds)
    for forced in (None, 0.0):
        with pytest.raises(ValueError, match="cannot size alpha"):
            solve_alpha(layer, bandwidth, live=30, host_budget=1e15, forced=forced)


def test_bandwidth_bound():
    plan = solve_alpha(LAYER, bandwidth=20 * GB, live=30, host_budget=1e15)
    # 20 GB/s x 60 ms = 1.2 GiB per layer; minus 0.25 GiB fixed leaves 0.95 GiB of the 1.5 GiB
    assert plan.bound_by == "bandwidth" and plan.alpha == pytest.approx((1.2 - 0.25) / 1.5)
    assert plan.overlap == pytest.approx(1.0)  # the LP's point: the offload just fits


def test_host_memory_bound_and_all_tokens():
    plan = solve_alpha(LAYER, bandwidth=100 * GB, live=30, host_budget=30 * GB)
    assert plan.bound_by == "host memory"
    assert plan.host_bytes <= 30 * GB and plan.alpha == pytest.approx((1.0 - 0.25) / 1.5)
    assert solve_alpha(LAYER, bandwidth=1000 * GB, live=30, host_budget=1e15).alpha == 1.0


def test_host_budget_refusals_before_training():
    with pytest.raises(HostMemoryError, match="even at alpha = 0"):
        solve_alpha(LAYER, 20 * GB, live=30, host_budget=5 * GB)
    with pytest.raises(HostMemoryError, match="--memo-swap-fraction 1.0 needs"):
        solve_alpha(LAYER, 20 * GB, live=30, host_budget=30 * GB, forced=1.0)
    # pipeline: two micro-batches in flight hold twice the layers
    one = solve_alpha(LAYER, 1000 * GB, live=30, host_budget=60 * GB)
    two = solve_alpha(LAYER, 1000 * GB, live=60, host_budget=60 * GB)
    assert two.alpha < one.alpha and two.host_bytes <= 60 * GB


def test_forced_alpha_reports_the_overlap_it_gets():
    plan = solve_alpha(LAYER, bandwidth=10 * GB, live=30, host_budget=1e15, forced=1.0)
    assert plan.bound_by == "forced" and plan.overlap == pytest.approx(0.6 / 1.75)
