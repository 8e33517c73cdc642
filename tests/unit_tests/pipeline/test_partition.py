"""Segment partitions (Seq1F1B section 3.5)."""
import pytest

from megatron.longseq.pipeline.partition import PartitionError, average, partition, segment_flops, uniform_comp

LLAMA_7B = dict(num_params=6_700_000_000, num_layers=32, hidden=4096)


def test_average_is_equal_up_to_granularity():
    assert average(4096, 4) == [1024] * 4
    assert average(96, 5, granularity=8) == [24, 24, 16, 16, 16]
    assert average(64, 1) == [64]


@pytest.mark.parametrize("seq, k, gran", [(32768, 4, 1), (131072, 8, 8), (4096, 3, 4), (128, 4, 8)])
def test_uniform_comp_equalises_eq8_flops(seq, k, gran):
    lengths = uniform_comp(seq, k, granularity=gran, **LLAMA_7B)
    assert sum(lengths) == seq and all(n > 0 and n % gran == 0 for n in lengths)
    assert lengths == sorted(lengths, reverse=True)  # later segments attend to more keys: shorter
    flops = segment_flops(lengths, **LLAMA_7B)
    # Rounding a boundary by at most half a granule moves a segment's cost by about one granule's
    # share: the spread is bounded by that, and far below the average partition's.
    spread = (max(flops) - min(flops)) / (sum(flops) / k)
    avg_flops = segment_flops(average(seq, k, gran), **LLAMA_7B)
    avg_spread = (max(avg_flops) - min(avg_flops)) / (sum(avg_flops) / k)
    assert spread <= max(2.5 * gran * k / seq, 1e-6) + 1e-9 and spread <= avg_spread


def test_long_sequences_shift_tokens_towards_early_segments():
    # At 128K attention dominates, so the first of 4 segments is much longer than the last.
    lengths = uniform_comp(131072, 4, **LLAMA_7B)
    assert lengths[0] > 1.5 * lengths[-1]


@pytest.mark.parametrize("args, message", [
    ((100, 4, "average", 8), "not a multiple of the segment granularity 8"),
    ((64, 9, "average", 8), "--pipe-sp-splits 9 does not fit --seq-length 64: at most 8 segments"),
    ((64, 2, "balanced", 1), "--pipe-sp-strategy must be one of"),
])
def test_bad_partitions(args, message):
    with pytest.raises(PartitionError, match=message):
        partition(*args)
