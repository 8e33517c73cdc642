"""Segment partitions (Seq1F1B section 3.5), and per micro-batch for packed documents."""
import itertools

import pytest
import torch

from megatron.longseq.attention.documents import lognormal_starts
from megatron.longseq.pipeline.partition import (DocumentCost, PartitionError, average, document_partition, partition,
                                                 segment_costs, segment_flops, uniform_comp)

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


@pytest.mark.parametrize("trial", range(12))
def test_uniform_comp_is_the_cheapest_costliest_segment_on_granules(trial):
    """Against every partition on granules (brute force), and on the cases where rounding each
    boundary on its own put a longer segment after a shorter one and lost to `average`."""
    g = torch.Generator().manual_seed(100 + trial)
    gran, k, seq = (1, 2, 4)[trial % 3], 2 + trial % 3, 48
    params, layers, hidden = (int(torch.randint(1, 400, (1,), generator=g)) for _ in range(3))
    lengths = uniform_comp(seq, k, params, layers, hidden, gran)
    assert sum(lengths) == seq and all(n > 0 and n % gran == 0 for n in lengths)
    best = min(max(segment_flops([(b - a) * gran for a, b in zip((0, *cuts), (*cuts, seq // gran))],
                                 params, layers, hidden))
               for cuts in itertools.combinations(range(1, seq // gran), k - 1))
    assert max(segment_flops(lengths, params, layers, hidden)) == pytest.approx(best, rel=1e-9)


def test_uniform_comp_never_loses_to_average():
    gpt = dict(num_params=12 * 32 * 4096**2 + 50257 * 4096, num_layers=32, hidden=4096)
    lengths = uniform_comp(4096, 8, granularity=64, **gpt)
    assert lengths == [512] * 8  # rounding boundaries one by one gave [512, 512, 576, 512, 512, 448, 512, 512]
    assert uniform_comp(16, 3, **LLAMA_7B) == [6, 5, 5]  # was [5, 6, 5]
    assert uniform_comp(131072, 4, 7_000_000_000, 0, 4096) == average(131072, 4)  # no attention term


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


# ---- packed documents: each micro-batch's own partition -------------------------------------------

def _direct_cost(starts, a, b, num_params, num_layers, hidden):
    """Eq. 8 within documents by counting: every query of [a, b) sees its document's keys before b."""
    ids = starts.long().cumsum(-1)
    pairs = sum(int((ids[s, :b] == ids[s, t]).sum()) for s in range(starts.shape[0]) for t in range(a, b))
    return 2.0 * num_params * (b - a) * starts.shape[0] + 2.0 * num_layers * hidden * pairs


def _random_starts(g, b, s, p):
    starts = torch.rand(b, s, generator=g) < p
    starts[:, 0] = True
    return starts


def test_document_cost_is_eq8_within_documents():
    g = torch.Generator().manual_seed(0)
    starts = _random_starts(g, 2, 40, 0.15)
    cost = DocumentCost(starts, 30, 2, 3)
    for a, b in [(0, 40), (5, 17), (10, 11), (0, 1), (39, 40)]:
        assert cost(a, b) == pytest.approx(_direct_cost(starts, a, b, 30, 2, 3), rel=1e-12)
    one = torch.zeros(1, 4096, dtype=torch.bool)
    one[0, 0] = True  # one document: Eq. 8 itself
    lengths = uniform_comp(4096, 4, **LLAMA_7B)
    want = segment_flops(lengths, **LLAMA_7B)
    assert segment_costs(DocumentCost(one, **LLAMA_7B), lengths) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("trial", range(12))
def test_document_partition_is_the_cheapest_costliest_segment(trial):
    """Against every partition on granules (brute force): none has a cheaper costliest segment."""
    g = torch.Generator().manual_seed(trial)
    gran, k, seq = (1, 2, 4)[trial % 3], 2 + trial % 3, 48
    starts = _random_starts(g, 2, seq, 0.15)
    params = int(torch.randint(1, 60, (1,), generator=g))
    cost = DocumentCost(starts, params, 2, 3)
    cap = None if trial % 2 else seq // 2
    lengths = document_partition(starts, k, params, 2, 3, gran, cap)
    assert sum(lengths) == seq and all(n > 0 and n % gran == 0 and (cap is None or n <= cap) for n in lengths)
    best = min(max(segment_costs(cost, [(b - a) * gran for a, b in zip((0, *cuts), (*cuts, seq // gran))]))
               for cuts in itertools.combinations(range(1, seq // gran), k - 1)
               if cap is None or all((b - a) * gran <= cap for a, b in zip((0, *cuts), (*cuts, seq // gran))))
    assert max(segment_costs(cost, lengths)) == pytest.approx(best, rel=1e-8)


def test_one_document_is_uniform_comp():
    one = torch.zeros(1, 131072, dtype=torch.bool)
    one[0, 0] = True
    assert document_partition(one, 4, granularity=8, **LLAMA_7B) == uniform_comp(131072, 4, granularity=8, **LLAMA_7B)


def test_packed_documents_get_segments_of_equal_cost():
    """128K samples of log-normal documents (mean 4K): the static uniform_comp, made for one
    document, puts 1.41x the mean cost in its costliest segment (measured, 2026-11-23); each
    micro-batch's own partition is even to within a granule's cost, and within the static longest."""
    g = torch.Generator().manual_seed(0)
    starts = lognormal_starts(131072, 4096.0, 1.0, g)[None]
    cost = DocumentCost(starts, **LLAMA_7B)
    static = uniform_comp(131072, 4, granularity=8, **LLAMA_7B)
    ours = document_partition(starts, 4, granularity=8, max_length=max(static), **LLAMA_7B)
    spread = [max(c) * len(c) / sum(c) for c in (segment_costs(cost, static), segment_costs(cost, ours))]
    assert round(spread[0], 2) == 1.41 and spread[1] < 1.001  # the figures README.md quotes (seeded)
    assert max(ours) <= max(static)


def test_the_cap_must_leave_room_for_the_sequence():
    starts = torch.ones(1, 64, dtype=torch.bool)
    with pytest.raises(PartitionError, match="2 segments of at most 16 tokens cannot hold 64"):
        document_partition(starts, 2, 1, 1, 1, max_length=16)
