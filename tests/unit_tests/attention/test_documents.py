"""Packed documents (--reset-attention-mask) under every context-parallel mode.

Pure parts first: the balanced placement (equal counts, every token once, causal work even per
document) and the pieces of a block against the dense block-diagonal causal mask, for every
placement and arbitrary token sets. Then every mode on 2/4/8 gloo ranks against float64 attention
with the block-diagonal causal mask: forward and dq/dk/dv of every rank's tokens, MHA and GQA,
and Seq1F1B segments whose keys cross segments only within a document."""
import random

import pytest
import torch
import torch.distributed as dist

from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.core import AttentionInputs, LongSeqCoreAttention, dense_document_mask
from megatron.longseq.attention.documents import (balanced_ring_tokens, block_pieces, document_ids,
                                                   document_starts)
from megatron.longseq.attention.ledger import LEDGER
from megatron.longseq.attention.placement import (DocumentLayout, local_token_indices, ring_chunks,
                                                   segmented_token_indices)
from megatron.longseq.attention.segments import SegmentSlot, SegmentState
from tests.unit_tests.attention.contract_kernel import ContractKernel, install_flash_varlen_stand_ins
from tests.unit_tests.attention.test_context_parallel import ATOL_GRAD, ATOL_OUT, each_mode
from tests.unit_tests.attention.test_core_attention import config, module, reference
from tests.unit_tests.dist_utils import grid_groups, run_ranks

S, B, D = 32, 2, 8


def starts_of(lengths, seq=S):
    """Document lengths (the last may run past the sample's end: a sample ending mid-document)
    -> [seq] starts."""
    starts, at = torch.zeros(seq, dtype=torch.bool), 0
    for n in lengths:
        if at < seq:
            starts[at] = True
        at += n
    return starts


# Two samples per case (they differ: a micro-batch's samples have their own documents).
CASES = {
    "random": ([5, 1, 9, 3, 7, 4, 3], [2, 11, 6, 13]),
    "shorter than a chunk": ([1, 2, 1, 3, 1, 2, 2, 1, 3, 2, 1, 2, 3, 1, 2, 5], [3] * 10 + [2]),
    "longer than a rank's share": ([3, 21, 8], [1, 1, 25, 5]),
    "spanning every rank": ([1, 30, 1], [31, 1]),
    "single document": ([32], [32]),
    "ending mid-document": ([6, 10, 40], [12, 30]),
}


def case_starts(name):
    return torch.stack([starts_of(lengths) for lengths in CASES[name]])  # [B, S]


def random_starts(seq, g):
    starts = torch.rand(seq, generator=g) < torch.rand(1, generator=g).item() * 0.5
    starts[0] = True
    return starts


# ---- pure arithmetic ------------------------------------------------------------------------------

def test_document_starts_follow_megatrons_eod_rule():
    """A document ends with its EOD; the next token starts the next one (Megatron's masks)."""
    tokens = torch.tensor([[5, 0, 7, 7, 0, 0, 3], [1, 2, 3, 4, 5, 6, 0]])
    starts = document_starts(tokens, eod=0)
    assert starts.tolist() == [[True, False, True, False, False, True, True], [True] + [False] * 6]
    assert document_ids(starts)[0].tolist() == [0, 0, 1, 1, 1, 2, 3]


@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8, 16])
def test_balanced_placement_holds_every_token_once_in_equal_shares(ring):
    g = torch.Generator().manual_seed(ring)
    for _ in range(40):
        seq = 2 * ring * int(torch.randint(1, 20, (1,), generator=g))
        tokens = balanced_ring_tokens(random_starts(seq, g), ring)
        assert [len(t) for t in tokens] == [seq // ring] * ring
        assert torch.equal(torch.sort(torch.cat(tokens)).values, torch.arange(seq))
        assert all(torch.equal(t, torch.sort(t).values) for t in tokens)


def test_balanced_placement_evens_each_documents_causal_work():
    """A document of L = 2R*k tokens: every position's queries see the same number of keys."""
    ring, lengths = 4, [16, 24, 8, 16]
    starts = starts_of(lengths, 64)
    doc = document_ids(starts)
    offset = torch.arange(64) - torch.tensor([sum(lengths[:d]) for d in doc.tolist()])
    work = [int((offset[t] + 1).sum()) for t in balanced_ring_tokens(starts, ring)]
    assert len(set(work)) == 1, work


def dense_block(q_tokens, k_tokens, doc):
    return (doc[q_tokens][:, None] == doc[k_tokens][None, :]) & (q_tokens[:, None] >= k_tokens[None, :])


def pieces_mask(pieces, nq, nk):
    covered = torch.zeros(nq, nk, dtype=torch.int)
    for p in pieces:
        part = torch.ones(p.q1 - p.q0, p.k1 - p.k0, dtype=torch.int)
        if p.causal:
            assert p.q1 - p.q0 == p.k1 - p.k0
            part = part.tril()
        covered[p.q0 : p.q1, p.k0 : p.k1] += part
    return covered


def placements(seq, ring, starts):
    yield "balanced", balanced_ring_tokens(starts, ring)
    yield "megatron chunks", [ring_chunks(seq, ring, j) for j in range(ring)]


def test_block_pieces_are_the_block_diagonal_causal_mask_exactly_once():
    """Every (query, key) pair the mask allows is in exactly one piece, and no other pair is:
    for both placements, every block, and arbitrary sorted token sets (Seq1F1B prefixes)."""
    g = torch.Generator().manual_seed(0)
    for ring in (1, 2, 4, 8):
        for _ in range(12):
            seq = 2 * ring * int(torch.randint(1, 8, (1,), generator=g))
            starts = random_starts(seq, g)
            doc = document_ids(starts)
            for name, tokens in placements(seq, ring, starts):
                for j in range(ring):
                    for src in range(ring):
                        got = pieces_mask(block_pieces(tokens[j], tokens[src], doc), seq // ring, seq // ring)
                        assert torch.equal(got, dense_block(tokens[j], tokens[src], doc).int()), (name, j, src)
    rng = random.Random(1)
    for _ in range(200):
        starts = random_starts(24, g)
        q = torch.tensor(sorted(rng.sample(range(24), rng.randint(1, 24))))
        k = torch.tensor(sorted(rng.sample(range(24), rng.randint(1, 24))))
        doc = document_ids(starts)
        assert torch.equal(pieces_mask(block_pieces(q, k, doc), len(q), len(k)), dense_block(q, k, doc).int())


def test_balanced_blocks_take_one_kernel_call_per_document():
    ring, lengths = 4, [16, 24, 8, 16]
    starts = starts_of(lengths, 64)
    tokens, doc = balanced_ring_tokens(starts, ring), document_ids(starts)
    for j in range(ring):
        for src in range(ring):
            assert len(block_pieces(tokens[j], tokens[src], doc)) == len(lengths)


def test_blocks_without_a_common_document_have_no_pieces():
    # Megatron's chunks of 4 tokens at R = 2: positions (0, 3) and (1, 2); documents of 4 tokens
    # each lie within one chunk, so the positions share none.
    starts = starts_of([4, 4, 4, 4], 16)
    tokens, doc = [ring_chunks(16, 2, j) for j in range(2)], document_ids(starts)
    assert block_pieces(tokens[0], tokens[1], doc) == [] and block_pieces(tokens[1], tokens[0], doc) == []


def test_document_pieces_at_one_rank_match_the_dense_mask_path():
    """cp = 1: document starts attend piece by piece, exactly as SDPA with the dense mask."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, B, n, 16, generator=gen) for n in (4, 2, 2))
    starts = case_starts("random")
    positions = torch.arange(S).expand(B, S)
    mask = dense_document_mask(starts)
    attn = module(config())
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attn(*leaves, None, packed_seq_params=AttentionInputs(position_ids=positions, document_starts=starts))
    want = reference(*(x.double().requires_grad_() for x in (q, k, v)), positions, mask)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=0)
    dense = attn(q, k, v, mask, packed_seq_params=AttentionInputs(position_ids=positions))
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=0)


# ---- every mode on gloo ranks ---------------------------------------------------------------------

def document_problem(heads, groups, starts, seed=0, d=D, with_reference=True):
    """q, k, v, dout of the whole samples (starts [b, s]); positions restart at every document
    (--reset-position-ids); float64 reference output and gradients under the document mask (None
    without `with_reference`)."""
    b, s = starts.shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups))
    dout = torch.randn(s, b, heads * d, generator=g)
    doc = document_ids(starts)
    first = torch.stack([torch.searchsorted(doc[i], doc[i]) for i in range(b)])  # each token's doc start
    positions = torch.arange(s).expand(b, s) - first
    if not with_reference:
        return (q, k, v, dout, positions), None
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, positions, dense_document_mask(starts))
    ref.backward(dout.double())
    return (q, k, v, dout, positions), (ref.detach(), *(x.grad for x in leaves))


def per_sample(x, idx, dim):
    """x [..., S (at dim), B, ...] -> each sample's own tokens: [..., s_local, B, ...]."""
    return torch.stack([x.select(dim + 1, b).index_select(dim, idx[b]) for b in range(len(idx))], dim=dim + 1)


def check_documents(pgs, heads, groups, starts, lengths=None, varlen=False):
    """This rank's share (every segment of `lengths` in order, forward first to last, backward
    last to first) against the reference, attending per piece or (varlen) through torch's flash
    varlen entry, stood in for on CPU; returns the kernel's call log."""
    (q, k, v, dout, positions), (ref, dq, dk, dv) = document_problem(heads, groups, starts)
    lengths = lengths or [S]
    cp = ContextParallel.from_process_groups(pgs, lengths)
    attn = LongSeqCoreAttention(config(heads, groups, d=D), layer_number=1, attn_mask_type=None, cp=cp)
    attn._kernel = kernel = ContractKernel(varlen=varlen)
    if varlen:  # this rank's own process: nothing to restore
        install_flash_varlen_stand_ins(setattr)
    state, runs, offset = SegmentState(), [], 0
    for s, n in enumerate(lengths):
        idx = [offset + local_token_indices(n, cp.hp_size, cp.ring.size, cp.hp_index, cp.ring.ring_index,
                                            starts[b, offset : offset + n]) for b in range(B)]
        offset += n
        leaves = [per_sample(x, idx, 0).clone().requires_grad_() for x in (q, k, v)]
        segment = SegmentSlot(state, s) if len(lengths) > 1 else None
        params = AttentionInputs(position_ids=per_sample(positions.t(), idx, 0).t(), segment=segment,
                                 document_starts=starts)
        runs.append((idx, leaves, attn(*leaves, None, packed_seq_params=params)))
    for idx, leaves, out in reversed(runs):
        out.backward(per_sample(dout, idx, 0))
    for idx, leaves, out in runs:
        torch.testing.assert_close(out.detach().double(), per_sample(ref, idx, 0), atol=ATOL_OUT, rtol=0)
        for got, want in zip((x.grad for x in leaves), (dq, dk, dv)):
            torch.testing.assert_close(got.double(), per_sample(want, idx, 0), atol=ATOL_GRAD, rtol=0)
    whole = [torch.cat([r[0][b] for r in runs]) for b in range(B)]
    for b in range(B):  # the segments' shares are the data loader's placement
        assert torch.equal(whole[b], segmented_token_indices(lengths, cp.hp_size, cp.ring.size, cp.hp_index,
                                                             cp.ring.ring_index, starts[b]))
    return kernel.calls


# At 8 ranks the cases whose placement differs most from 4 ranks' (tiny documents, one spanning
# every rank, a random mix); the rest run at 2 and 4 ranks, and one document is the causal test's.
AT_EIGHT = ("random", "shorter than a chunk", "spanning every rank")


def _all_modes_all_cases(world, varlen):
    def every_case(pgs, heads, groups):
        for name in CASES if world < 8 else AT_EIGHT:
            try:
                calls = check_documents(pgs, heads, groups, case_starts(name), varlen=varlen)
            except AssertionError as err:
                raise AssertionError(f"documents {name!r}: {err}") from None
            assert varlen == ("FV" in calls and "BV" in calls) or name == "single document", (name, calls)

    each_mode(world, every_case)


@pytest.mark.parametrize("varlen", [False, True], ids=["per-piece", "varlen"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_mode_matches_block_diagonal_attention(world, varlen):
    run_ranks(_all_modes_all_cases, world, world, varlen)


def _segments_with_documents(world):
    for hp, ring in {2: [(1, 2), (2, 1)], 4: [(2, 2), (1, 4)]}[world]:
        pgs = grid_groups(cp=hp * ring, hp=hp)
        for lengths in ([16, 16], [16, 8, 8]):
            if any(n % (2 * hp * ring) for n in lengths):
                continue
            for name in ("random", "longer than a rank's share", "ending mid-document"):
                check_documents(pgs, 4, 2, case_starts(name), lengths)
                check_documents(pgs, 4, 2, case_starts(name), lengths, varlen=True)


@pytest.mark.parametrize("world", [2, 4])
def test_seq1f1b_segments_attend_earlier_segments_within_documents(world):
    run_ranks(_segments_with_documents, world, world)


def _skipped_blocks_in_the_ledger():
    pgs = grid_groups(cp=4, hp=1)
    LEDGER.clear()
    check_documents(pgs, 4, 2, case_starts("single document"), [16, 16])
    totals = LEDGER.totals(layer=1)
    assert ("fwd", "skip", "block") not in totals
    # two segments, one document: each segment's own ring (R-1 = 3 hops each), and segment 1's
    # pass over segment 0's keys (3)
    assert totals[("fwd", "p2p", "inner")].count == 9
    # Documents that end where the segment ends: segment 1 meets nothing of segment 0, so its pass
    # over segment 0's keys is skipped whole -- R blocks, no kernel call, no transfer
    LEDGER.clear()
    starts = torch.stack([starts_of([10, 6, 16]), starts_of([16, 3, 13])])
    check_documents(pgs, 4, 2, starts, [16, 16])
    totals = LEDGER.totals(layer=1)
    assert totals[("fwd", "skip", "block")].count == totals[("bwd", "skip", "block")].count == 4
    assert totals[("fwd", "p2p", "inner")].count == 6


def test_skipped_blocks_are_counted_in_the_ledger():
    run_ranks(_skipped_blocks_in_the_ledger, 4)


def _transfers(pgs, name):
    """Ring messages of one layer's forward and backward, summed over the ranks, exactness checked."""
    LEDGER.clear()
    check_documents(pgs, 4, 2, case_starts(name))
    totals = LEDGER.totals(layer=1)
    keys = [(phase, "p2p", axis) for phase in ("fwd", "bwd") for axis in ("inner", "outer")]
    counts = torch.tensor([totals[key].count if key in totals else 0 for key in keys])
    dist.all_reduce(counts)
    return dict(zip([f"{phase} {axis}" for phase, _, axis in keys], counts.tolist()))


def _blocks_travel_only_as_far_as_needed():
    # Every member takes part in one collective before a ring's first batch (which may now leave
    # members out: NCCL would hang on such a first call).
    double = grid_groups(cp=4, hp=1, inner_ring=2, placement="context-first")
    calls, all_reduce = [], dist.all_reduce
    dist.all_reduce = lambda *a, **kw: calls.append(kw.get("group")) or all_reduce(*a, **kw)
    try:
        check_documents(double, 4, 2, case_starts("shorter than a chunk"))
    finally:
        dist.all_reduce = all_reduce
    assert calls == [double.inner, double.outer]  # once per ring call's communicators, first
    # Plain ring R = 4: one document meets every block: 3 KV hops per rank forward; backward the
    # same plus the dK/dV accumulator's 4 (around the circle). Documents shorter than a chunk
    # leave blocks nobody downstream meets: KV stops at its last reader (6 of 12 hops) and the
    # accumulator returns from there (9 of 16).
    ring = grid_groups(cp=4, hp=1)
    assert _transfers(ring, "single document") == {"fwd inner": 12, "fwd outer": 0, "bwd inner": 28, "bwd outer": 0}
    assert _transfers(ring, "shorter than a chunk") == {"fwd inner": 6, "fwd outer": 0, "bwd inner": 15, "bwd outer": 0}
    # Double ring W = 2, O = 2: per rank 2 inner KV hops and 1 outer forward; backward adds 4
    # inner and 2 outer accumulator hops. Short documents halve them (the outer accumulator of a
    # block no later ring needs goes straight home).
    assert _transfers(double, "single document") == {"fwd inner": 8, "fwd outer": 4, "bwd inner": 24, "bwd outer": 12}
    assert _transfers(double, "shorter than a chunk") == {"fwd inner": 4, "fwd outer": 2, "bwd inner": 12,
                                                          "bwd outer": 6}


def test_blocks_travel_only_as_far_as_their_last_reader():
    run_ranks(_blocks_travel_only_as_far_as_needed, 4)


@pytest.mark.parametrize("ring", [2, 4, 8])
def test_meeting_is_the_blocks_with_pieces(ring):
    """The route's [R, R] matrix (vectorised) against the pieces of every block, every case."""
    for name in CASES:
        for lengths in ([32], [16, 16]):
            if any(n % (2 * ring) for n in lengths):
                continue
            layout = DocumentLayout(case_starts(name), ring, lengths)
            for q_segment in range(len(lengths)):
                for k_segment in range(q_segment + 1):
                    want = torch.tensor([[bool(layout.pieces(q_segment, k_segment, j, src)) for src in range(ring)]
                                         for j in range(ring)])
                    got = layout.meeting(q_segment, k_segment)
                    assert torch.equal(got, want), (name, lengths, q_segment, k_segment)


def test_layout_gives_every_rank_what_the_data_loader_placed():
    starts = case_starts("random")
    layout = DocumentLayout(starts, ring=4, segment_lengths=[16, 16])
    for b in range(B):
        for j in range(4):
            want = segmented_token_indices([16, 16], 1, 4, 0, j, starts[b])
            assert torch.equal(torch.cat([layout.tokens(b, 0, j), layout.tokens(b, 1, j)]), want)
    with pytest.raises(ValueError, match="do not add up"):
        DocumentLayout(starts, ring=4, segment_lengths=[16, 8])


def test_megatron_core_packed_thd_batches_attend_by_their_cu_seqlens():
    """megatron-core's PackedSeqParams (qkv_format 'thd'): q [t, h, d], documents ending at
    cu_seqlens; the same output as one sample carrying those documents' starts, with positions
    restarting at each document."""
    from megatron.core.packed_seq_params import PackedSeqParams

    gen = torch.Generator().manual_seed(5)
    t, lengths = 24, [5, 11, 8]
    q, k, v = (torch.randn(t, n, 16, generator=gen) for n in (4, 2, 2))
    cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    attn = module(config())
    packed = attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    starts = starts_of(lengths, t).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    want = attn(*(x.unsqueeze(1) for x in (q, k, v)), None,
                packed_seq_params=AttentionInputs(position_ids=positions, document_starts=starts))
    assert packed.shape == (t, 4 * 16)
    torch.testing.assert_close(packed, want.squeeze(1), atol=0, rtol=0)
    with pytest.raises(ValueError, match="same cu_seqlens"):
        attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu,
                                                              cu_seqlens_kv=torch.tensor([0, 24], dtype=torch.int32)))


def test_per_batch_metadata_is_made_once_for_all_layers(monkeypatch):
    """Every layer gets the same packed 'thd' params (their conversion, a host read of cu_seqlens,
    and the documents' layout are made by the first) and the same dense mask for SDPA's dropout
    path (made on the device once, not on the host and copied per layer)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.longseq.attention import core

    made = {"thd": 0, "mask": 0}

    def counted(name, fn):
        def call(*a):
            made[name] += 1
            return fn(*a)
        return call
    monkeypatch.setattr(core, "_thd_inputs", counted("thd", core._thd_inputs))
    monkeypatch.setattr(core, "dense_document_mask", counted("mask", core.dense_document_mask))
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(24, n, 16, generator=gen) for n in (4, 2, 2))
    cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    layers = [module(config()) for _ in range(3)]
    outs = [attn(q, k, v, None, packed_seq_params=params) for attn in layers]
    assert made["thd"] == 1 and all(torch.equal(o, outs[0]) for o in outs)
    from megatron.longseq.random import seed_everything

    seed_everything(0, 0, torch.device("cpu"))  # attention dropout draws from the model-parallel stream
    dropout = config()
    dropout.attention_dropout = 0.1  # training with attention dropout: SDPA with the dense mask
    inputs = AttentionInputs(position_ids=torch.arange(S).expand(B, S), document_starts=case_starts("random"))
    q, k, v = (torch.randn(S, B, n, 16, generator=gen) for n in (4, 2, 2))
    for _ in range(3):
        module(dropout)(q, k, v, None, packed_seq_params=inputs)
    assert made["mask"] == 1
