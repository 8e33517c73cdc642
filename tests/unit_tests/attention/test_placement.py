"""Pure arithmetic of context parallelism: token placement, head splits, the ring's schedule."""
import pytest
import torch

from megatron.longseq.attention.placement import local_token_indices, ring_chunks, split_heads
from megatron.longseq.attention.ring import CAUSAL, KV_FIRST, Q_SECOND, RingContext, step_plan


@pytest.mark.parametrize("hp, ring", [(1, 1), (1, 4), (4, 1), (2, 2), (2, 4)])
def test_ranks_partition_the_sequence_and_gather_to_zigzag_pairs(hp, ring):
    S = 64
    seen = []
    for j in range(ring):
        shards = [local_token_indices(S, hp, ring, i, j) for i in range(hp)]
        # the all-to-all concatenates the hp shards in rank order: chunks j and 2R-1-j
        assert torch.equal(torch.cat(shards), ring_chunks(S, ring, j))
        seen += [s for shard in shards for s in shard.tolist()]
    assert sorted(seen) == list(range(S))


def test_zigzag_pairs_balance_causal_work():
    S, R = 64, 4
    # every position's two chunks see the same number of (query, key) pairs in total
    work = [sum(int(t) + 1 for t in ring_chunks(S, R, j)) for j in range(R)]
    assert len(set(work)) == 1


def test_sequence_must_split_into_2cp_chunks():
    with pytest.raises(ValueError, match="not divisible by 2 x context parallel size 6 = 12"):
        local_token_indices(30, 2, 3, 0, 0)


def test_head_splits():
    assert split_heads(8, 8, 4).q_counts == [2, 2, 2, 2]
    assert split_heads(6, 6, 4).q_counts == [2, 2, 1, 1]  # uneven, MHA only
    gqa = split_heads(8, 2, 2)
    assert (gqa.kv_counts, gqa.kv_repeat) == ([1, 1], 1)  # split, no replication
    rep = split_heads(8, 2, 8)
    assert (rep.q_counts, rep.kv_counts, rep.kv_repeat) == ([1] * 8, [1] * 8, 4)  # replicate x4
    with pytest.raises(ValueError, match="cannot be split"):
        split_heads(6, 2, 4)
    with pytest.raises(ValueError, match="one must divide the other"):
        split_heads(12, 6, 4)


def test_step_plans_follow_chunk_positions():
    assert step_plan(2, 2) == CAUSAL
    assert step_plan(2, 0) == KV_FIRST  # an earlier position: only its first chunk is visible
    assert step_plan(0, 3) == Q_SECOND  # a later position: only our late chunk sees it


@pytest.mark.parametrize("W, O", [(4, 1), (2, 2), (1, 4)])
def test_double_ring_visits_every_block_once(W, O):
    for j in range(W * O):
        rc = RingContext(None, None, j, W, O)
        sources = [rc.source(o, t) for o in range(O) for t in range(W)]
        assert sorted(sources) == list(range(W * O)) and sources[0] == j
