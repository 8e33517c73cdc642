"""Every context-parallel mode against float64 attention over the whole sequence, on 2/4/8 gloo
ranks: forward output and dq/dk/dv of each rank's tokens, plus the communication ledger against
the papers' formulas. Each rank builds the full problem from one seed and checks its own share."""
import pytest
import torch

from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.core import AttentionInputs, LongSeqCoreAttention
from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.attention.placement import local_token_indices, segmented_token_indices
from megatron.longseq.attention.segments import SegmentSlot, SegmentState
from megatron.longseq.random import checkpoint
from tests.unit_tests.attention.contract_kernel import ContractKernel
from tests.unit_tests.attention.test_core_attention import config, reference
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_ranks

S, B, D = 32, 2, 8


def full_problem(heads, groups, seed=0, s=S, b=B, d=D, with_reference=True):
    """(q, k, v, dout, positions) of the whole sequence and the float64 (out, dq, dk, dv) (None
    without `with_reference`: a rank that checks nothing itself)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups))
    dout = torch.randn(s, b, heads * d, generator=g)
    positions = torch.arange(s).expand(b, s)
    if not with_reference:
        return (q, k, v, dout, positions), None
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, positions)
    ref.backward(dout.double())
    return (q, k, v, dout, positions), (ref.detach(), *(x.grad for x in leaves))


def run_mode(pgs, heads, groups, keep=False):
    """This rank's share through LongSeqCoreAttention, attending through the contract-checked
    kernel (a call a CUDA kernel would misread raises); returns (indices, out, dq, dk, dv)."""
    (q, k, v, dout, positions), _ = full_problem(heads, groups)
    cp = ContextParallel.from_process_groups(pgs)
    idx = local_token_indices(S, cp.hp_size, cp.ring.size, cp.hp_index, cp.ring.ring_index)
    attn = LongSeqCoreAttention(_keep_config(heads, groups) if keep else config(heads, groups, d=D),
                                layer_number=1, attn_mask_type=None, cp=cp)
    attn._kernel = kernel = ContractKernel()
    leaves = [x[idx].clone().requires_grad_() for x in (q, k, v)]
    params = AttentionInputs(position_ids=positions[:, idx])
    if keep:  # inside a full-recompute region, as the layer wrapper does
        out = checkpoint(lambda a, b, c: attn(a, b, c, None, packed_seq_params=params), *leaves)
    else:
        out = attn(*leaves, None, packed_seq_params=params)
    out.backward(dout[idx])
    assert "F" in kernel.calls and "B" in kernel.calls
    return idx, out.detach(), *(x.grad for x in leaves)


def _keep_config(heads, groups):
    cfg = config(heads, groups, d=D)
    cfg.selective_checkpoint_pp = True
    return cfg


# fp32 kernels and fp32 merges on O(1) values; RoPE angles up to 32 rad (~4e-6 rounding). The
# same bounds as the single-rank module test (test_core_attention.py).
ATOL_OUT, ATOL_GRAD = 1e-4, 2e-4


def check(pgs, heads, groups, keep=False):
    _, (ref, dq, dk, dv) = full_problem(heads, groups)
    idx, out, gq, gk, gv = run_mode(pgs, heads, groups, keep)
    torch.testing.assert_close(out.double(), ref[idx], atol=ATOL_OUT, rtol=0)
    for got, want in ((gq, dq), (gk, dk), (gv, dv)):
        torch.testing.assert_close(got.double(), want[idx], atol=ATOL_GRAD, rtol=0)


# (hp, ring, inner ring, placement, heads, kv groups) per world size
MODES = {
    2: [(1, 2, None, "head-first", 4, 4), (2, 1, None, "head-first", 4, 2), (2, 1, None, "head-first", 4, 1)],
    4: [(1, 4, None, "head-first", 4, 2), (1, 4, 2, "context-first", 4, 4), (4, 1, None, "head-first", 4, 1),
        (2, 2, None, "head-first", 4, 4), (2, 2, None, "context-first", 4, 1), (4, 1, None, "head-first", 6, 6),
        (1, 4, 1, "head-first", 2, 2)],
    # 8 ranks on two cores is slow: the three that differ most from 4's (double ring under
    # head parallelism, a deep double ring with KV replication, Ulysses at 8)
    8: [(2, 4, 2, "context-first", 4, 2), (1, 8, 4, "context-first", 2, 1), (8, 1, None, "head-first", 8, 8)],
}


def each_mode(world, check_mode):
    """check_mode(pgs, heads, groups) for every row of MODES[world]; a failure names its row."""
    for hp, ring, inner, placement, heads, groups in MODES[world]:
        pgs = grid_groups(cp=hp * ring, hp=hp, inner_ring=inner, placement=placement)
        try:
            check_mode(pgs, heads, groups)
        except AssertionError as err:
            raise AssertionError(f"hp={hp} ring={ring} inner={inner} {placement} heads={heads} "
                                 f"groups={groups}: {err}") from None


def _all_modes(world):
    each_mode(world, check)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_mode_matches_whole_sequence_attention(world):
    run_ranks(_all_modes, world, world)


def _ledger_formulas():
    elem = 4  # fp32
    s_local = S // 4
    # Ulysses, hp = 4, MHA: four all-to-alls per layer and pass, each the local [s/P, b, H, d].
    LEDGER.clear()
    check(grid_groups(cp=4, hp=4), heads=4, groups=4)
    t = LEDGER.totals(layer=1)
    assert t[("fwd", "all_to_all", "hp")].count == 4 and t[("bwd", "all_to_all", "hp")].count == 4
    assert t[("fwd", "all_to_all", "hp")].bytes == 4 * s_local * B * 4 * D * elem  # 4Nh/P
    assert ("fwd", "p2p", "inner") not in t
    # Ulysses with GQA (2 KV heads, no replication at hp = 2): 2Nh/P + 2Nh(g/H)/P.
    LEDGER.clear()
    check(grid_groups(cp=2, hp=2), heads=4, groups=2)
    t = LEDGER.totals(layer=1)
    assert t[("fwd", "all_to_all", "hp")].bytes == (2 * 4 + 2 * 2) * (S // 2) * B * D * elem
    # Ring, R = 4 = W: R-1 KV transfers forward, each the local KV chunk [2, b, g, S/R, d];
    # backward R-1 KV transfers plus R dK/dV transfers (fp32) that bring gradients home.
    LEDGER.clear()
    check(grid_groups(cp=4, hp=1), heads=4, groups=2)
    t = LEDGER.totals(layer=1)
    kv_chunk = 2 * B * 2 * s_local * D * elem
    assert (t[("fwd", "p2p", "inner")].count, t[("fwd", "p2p", "inner")].bytes) == (3, 3 * kv_chunk)
    assert t[("bwd", "p2p", "inner")].count == 3 + 4
    assert ("fwd", "p2p", "outer") not in t
    # Double ring, R = 4, W = 2 (O = 2): per outer step W-1 inner transfers, plus one outer
    # transfer per outer step except the last (LoongTrain 4.5.3).
    LEDGER.clear()
    check(grid_groups(cp=4, hp=1, inner_ring=2, placement="context-first"), heads=4, groups=2)
    t = LEDGER.totals(layer=1)
    assert t[("fwd", "p2p", "inner")].count == 2 * (2 - 1)
    assert t[("fwd", "p2p", "outer")].count == 2 - 1
    assert t[("fwd", "p2p", "outer")].bytes == kv_chunk
    # 2D, hp = 2 x ring 2 with 1 KV head: replicated to 2 before the all-to-all, so the ring
    # carries one KV head per rank -- never the replicas.
    LEDGER.clear()
    check(grid_groups(cp=4, hp=2), heads=4, groups=1)
    t = LEDGER.totals(layer=1)
    assert t[("fwd", "p2p", "inner")].bytes == 1 * 2 * B * 1 * (S // 2) * D * elem
    assert t[("fwd", "all_to_all", "hp")].count == 4


def test_ledger_matches_the_papers_formulas():
    run_ranks(_ledger_formulas, 4)


def _selective_checkpoint_pp():
    pgs = grid_groups(cp=4, hp=2)
    check(pgs, heads=4, groups=2, keep=True)  # same outputs and gradients as without recompute
    LEDGER.clear()
    run_mode(pgs, heads=4, groups=2, keep=True)
    t = LEDGER.totals(layer=1)
    # The recompute repeats the all-to-alls of q, k, v (their outputs are the attention's saved
    # inputs) but not the ring attention: one forward's ring transfers (R-1 = 1), not two. Nothing
    # after the attention saves tensors here, so torch's checkpoint stops the recompute before
    # the output all-to-all: 4 + 3 all-to-alls.
    assert t[("fwd", "p2p", "inner")].count == 1
    assert t[("fwd", "all_to_all", "hp")].count == 4 + 3


def test_selective_checkpoint_pp_keeps_attention_and_skips_its_recompute():
    run_ranks(_selective_checkpoint_pp, 4)


def _segments_match_whole_sequence(hp, ring, lengths):
    """Seq1F1B segments: forward in order (each its own graph), backward last segment first; the
    outputs and gradients of every token equal whole-sequence attention."""
    pgs = grid_groups(cp=hp * ring, hp=hp)
    heads, groups = 4, 2
    (q, k, v, dout, positions), (ref, dq, dk, dv) = full_problem(heads, groups)
    cp = ContextParallel.from_process_groups(pgs)
    attn = LongSeqCoreAttention(config(heads, groups, d=D), layer_number=1, attn_mask_type=None, cp=cp)
    attn._kernel = kernel = ContractKernel()
    state, runs, offset = SegmentState(len(lengths)), [], 0
    for s, n in enumerate(lengths):
        idx = offset + local_token_indices(n, cp.hp_size, cp.ring.size, cp.hp_index, cp.ring.ring_index)
        offset += n
        leaves = [x[idx].clone().requires_grad_() for x in (q, k, v)]
        params = AttentionInputs(position_ids=positions[:, idx], segment=SegmentSlot(state, s))
        runs.append((idx, leaves, attn(*leaves, None, packed_seq_params=params)))
    kept = lambda: [entry is not None for entry in state.kv[1]]  # noqa: E731
    assert len(lengths) == 1 or kept() == [True] * (len(lengths) - 1)  # no later segment reads the last's
    for s, (idx, leaves, out) in reversed(list(enumerate(runs))):  # LIFO: later segments first
        out.backward(dout[idx])
        assert s == 0 or kept() == [True] * s + [False] * (len(lengths) - 1 - s)  # read by later ones only
    for idx, leaves, out in runs:
        torch.testing.assert_close(out.detach().double(), ref[idx], atol=ATOL_OUT, rtol=0)
        for got, want in zip((x.grad for x in leaves), (dq, dk, dv)):
            torch.testing.assert_close(got.double(), want[idx], atol=ATOL_GRAD, rtol=0)
    assert not state.kv and not state.grads  # released after segment 0's backward
    assert kernel.calls.count("B") >= len(lengths)
    all_idx = torch.cat([r[0] for r in runs])
    assert torch.equal(all_idx, segmented_token_indices(lengths, cp.hp_size, cp.ring.size, cp.hp_index,
                                                        cp.ring.ring_index))


def _all_segment_cases(world):
    for hp, ring in {1: [(1, 1)], 2: [(1, 2)], 4: [(2, 2), (1, 4)]}[world]:
        for lengths in ([32], [16, 16], [16, 8, 8], [8, 8, 8, 8]):
            if all(n % (2 * hp * ring) == 0 for n in lengths):
                _segments_match_whole_sequence(hp, ring, lengths)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_seq1f1b_segments_give_whole_sequence_attention_and_gradients(world):
    run_ranks(_all_segment_cases, world, world)


def test_segment_state_adds_later_gradients_in_place_and_counts_what_it_holds():
    """Later segments' dK/dV go into the first one's tensor (no sum made beside it); the state
    counts them and the keys and values it keeps as its own, and holds nothing after segment 0."""
    state, k = SegmentState(3), torch.randn(1, 2, 8, 4)  # [b, g, s, d]
    first, later = SegmentSlot(state, 0), [SegmentSlot(state, s) for s in (1, 2)]
    first.keep(1, k, k.clone(), own=True)  # as under recompute: nothing else holds them
    dkv = torch.ones(2, *k.shape)  # [2, b, g, s, d] fp32
    later[1].add_grad(1, 0, dkv)
    later[0].add_grad(1, 0, torch.full_like(dkv, 2.0))
    assert state.grads[(1, 0)] is dkv and torch.equal(dkv, torch.full_like(dkv, 3.0))
    assert state.held_bytes() == dkv.numel() * 4 + 2 * k.numel() * 4
    assert first.take_grad(1) is dkv and state.held_bytes() == 0


@pytest.mark.parametrize("mode", ["grad-off", "recompute", "grad-on"])
def test_seq1f1b_cache_keeps_no_fused_projection_alive(mode):
    """Where autograd lets go of the forward's tensors (grad off, as in MEMO's kept attention, or
    inside a recompute region) the cache keeps k and v as tensors of their own -- slices of the
    fused qkv projection would keep all of it to the segment's backward -- laid out as given
    ([s, b, h, d] memory). Grad on, no recompute: views, which the backward keeps anyway."""
    init_single_rank_world()
    heads, groups = 4, 2
    attn = LongSeqCoreAttention(config(heads, groups, d=D, rope=False), layer_number=1, attn_mask_type=None,
                                cp=ContextParallel.from_process_groups(grid_groups()))
    fused = torch.randn(S, B, heads + 2 * groups, D, requires_grad=mode != "grad-off")  # [s, b, hq + 2 hkv, d]
    state = SegmentState(2)
    params = AttentionInputs(position_ids=torch.arange(S).expand(B, S), segment=SegmentSlot(state, 0))

    def forward(x):
        q, k, v = x.split([heads, groups, groups], dim=2)
        return attn(q, k, v, None, packed_seq_params=params)

    with torch.set_grad_enabled(mode != "grad-off"):
        forward(fused) if mode != "recompute" else checkpoint(forward, fused)
    views = mode == "grad-on"
    for kept, given in zip(state.kv[1][0], fused.detach().split([heads, groups, groups], dim=2)[1:]):
        assert (kept.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()) == views
        torch.testing.assert_close(kept, given.permute(1, 2, 0, 3), atol=0, rtol=0)  # [b, h, s, d] views
        assert views or kept.permute(2, 0, 1, 3).is_contiguous()
