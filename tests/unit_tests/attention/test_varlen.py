"""Packed-document blocks as variable-length kernel calls (varlen.py): the grouping of pieces
into calls, a block through torch's flash varlen entry (stood in for on CPU) against the same
block piece by piece, and the kernels' variable-length contract."""
import math
import sys
from types import ModuleType

import pytest
import torch

from megatron.longseq.attention import varlen
from megatron.longseq.attention.documents import (Piece, Pieces, balanced_ring_tokens, block_pieces, document_ids,
                                                  lognormal_starts)
from megatron.longseq.attention.kernels import (
    FlashAttnKernel, KernelContractError, PaddedHeadDim, TorchCudaFlashKernel,
    TorchCudnnKernel, Varlen,
)
from megatron.longseq.attention.ring import _Rows, add_block_grads, block_backward, block_forward
from tests.unit_tests.attention.contract_kernel import (ContractKernel, flash_varlen_backward, flash_varlen_forward,
                                                       install_flash_varlen_stand_ins)
from tests.unit_tests.attention.test_documents import random_starts
from tests.unit_tests.attention.test_kernels import naive


def _rows(p: Piece, side: str):
    lo, hi = (p.q0, p.q1) if side == "q" else (p.k0, p.k1)
    return {(p.sample, r) for r in range(lo, hi)}


def check_groups(pieces, samples):
    groups = varlen.group_pieces(pieces, samples)
    order = lambda p: (p.sample, p.q0, p.k0, p.causal)  # noqa: E731
    assert sorted((p for g in groups for p in g), key=order) == sorted(pieces, key=order)  # each piece once
    for g in groups:
        assert len({p.causal for p in g}) == 1
        for side in ("q", "k"):  # distinct rows: results and gradients of a call land apart
            rows = [r for p in g for r in _rows(p, side)]
            assert len(rows) == len(set(rows)), (side, g)
        assert [(p.sample, p.q0) for p in g] == sorted((p.sample, p.q0) for p in g)
    return groups


def test_groups_are_calls_of_one_kind_over_distinct_rows():
    """Every block of random packed samples, both placements' rings 2 to 8: the groups partition
    the pieces, one kind each, with distinct query rows and distinct key rows; the diagonal block
    is one causal call over every row in order (views, no gather); few calls per block."""
    g = torch.Generator().manual_seed(0)
    most = 0
    for ring in (2, 4, 8):
        for _ in range(10):
            seq = 2 * ring * int(torch.randint(2, 10, (1,), generator=g))
            starts = random_starts(seq, g)
            tokens, doc = balanced_ring_tokens(starts, ring), document_ids(starts)
            for j in range(ring):
                for src in range(ring):
                    pieces = [Piece(p.q0, p.q1, p.k0, p.k1, p.causal, 0)
                              for p in block_pieces(tokens[j], tokens[src], doc)]
                    most = max(most, len(check_groups(pieces, 1)))
                    if j == src:
                        (only,) = varlen.plan(pieces, 1, seq // ring, seq // ring, "cpu")
                        assert only.seqs.causal and only.whole_q and only.whole_k
    assert most <= 3, most  # one causal group and at most two full ones


def test_pieces_reading_the_same_keys_go_to_separate_calls():
    """Two query runs that both see one key run in full (not adjacent, so not joined): one call
    would write their dK/dV rows twice, and the second write would hide the first."""
    pieces = [Piece(0, 3, 0, 2, False, 0), Piece(5, 8, 0, 2, False, 0), Piece(3, 5, 3, 5, True, 0)]
    groups = check_groups(pieces, 1)
    assert len(groups) == 3
    (every,) = varlen.group_pieces([Piece(0, 4, 0, 4, False)], 2)  # a piece for every sample: one call
    assert [p.sample for p in every] == [0, 1]


def test_calls_stay_within_the_kernels_limits_and_group_in_linear_time(monkeypatch):
    """Balanced blocks of many short documents (S 64K over 8 ranks, mean length 16): every call's
    backward padding (128 rows a sequence) stays within PAD_ROWS of its rows, and the sequence
    count within the grid's limit (here lowered to 50); pieces go in without a check against every
    member of their group (none here: each piece's keys lie past the group's)."""
    from megatron.longseq.attention.placement import DocumentLayout

    checks = []
    monkeypatch.setattr(varlen, "MAX_SEQS", 50)
    monkeypatch.setattr(varlen, "keys_apart", lambda members, p: checks.append(p) or True)
    layout = DocumentLayout(lognormal_starts(1 << 16, 16, 1.0, torch.Generator().manual_seed(0)).unsqueeze(0), 8)
    for src in range(8):
        for group in check_groups(layout.pieces(0, 0, 0, src), 1):
            rows = sum(p.q1 - p.q0 for p in group)
            assert len(group) <= 50 and varlen.PAD * len(group) <= rows + varlen.PAD_ROWS
    assert not checks


# ---- a block through the varlen entry against the same block piece by piece ----------------------

B, H, G, S, D = 2, 4, 2, 12, 8

# diagonal: per sample causal squares covering every row once; then blocks with full and causal
# pieces, one key run read by two query runs, and a sample without pieces
FIRST = Pieces([Piece(0, 5, 0, 5, True, 0), Piece(5, 12, 5, 12, True, 0), Piece(0, 12, 0, 12, True, 1)])
# a first block of two calls, neither over every row (each call's rows written where they belong)
SPLIT_FIRST = Pieces([Piece(0, 5, 0, 5, True, 0), Piece(5, 12, 0, 5, False, 0), Piece(0, 12, 0, 12, True, 1)])
LATER = Pieces([Piece(0, 4, 2, 6, False, 0), Piece(6, 9, 2, 6, False, 0), Piece(9, 12, 9, 12, True, 0),
                Piece(4, 6, 0, 2, False, 0), Piece(2, 7, 7, 12, False, 1), Piece(8, 10, 8, 10, True, 1)])


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, S, D, generator=g) for n in (H, G, G)]


def _attend(kernel, first):
    """Forward of two blocks (the diagonal, then another KV block) and their backward."""
    q, k1, v1 = _inputs(0)
    _, k2, v2 = _inputs(1)
    scale = 1 / math.sqrt(D)
    out, lse = block_forward(q, (k1, v1), first, kernel, scale)
    out, lse = block_forward(q, (k2, v2), LATER, kernel, scale, out, lse)
    out = out.to(q.dtype)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    rows, dq = _Rows(dout, out, lse), torch.zeros(q.shape)
    accs = [torch.zeros(2, B, G, S, D) for _ in range(2)]
    for acc, kv, pieces in zip(accs, ((k1, v1), (k2, v2)), (first, LATER)):
        add_block_grads(acc, block_backward(q, kv, rows, pieces, kernel, scale, dq))
    return out, lse, dq, accs


@pytest.mark.parametrize("first, first_calls, max_seqs", [(FIRST, 1, None), (SPLIT_FIRST, 2, None), (FIRST, 1, 1)])
def test_a_block_through_the_varlen_entry_equals_it_piece_by_piece(monkeypatch, first, first_calls, max_seqs):
    """Same output, lse and gradients as one kernel call per piece (fp32: the same CPU kernel
    runs per sequence either way, so only the merge order of the rows' sums differs: 1e-6); also
    with every call cut to one sequence by the kernels' limits."""
    install_flash_varlen_stand_ins(monkeypatch.setattr)
    if max_seqs is not None:
        monkeypatch.setattr(varlen, "MAX_SEQS", max_seqs)
        for pieces in (first, LATER):  # plans made under the real limit are kept on the lists
            monkeypatch.setattr(pieces, "plans", {})
    per_piece, calls = ContractKernel(), ContractKernel(varlen=True)
    want, got = _attend(per_piece, first), _attend(calls, first)
    for w, g in zip(want[:3] + tuple(want[3]), got[:3] + tuple(got[3])):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    # per piece: 3 + 6 forward calls, 3 + 6 backward; varlen: one per group -- the diagonal's one,
    # and LATER's full pieces (both samples), the full piece re-reading keys 2:6, the causal ones
    assert per_piece.calls.count("F") == 9 and per_piece.calls.count("B") == 9
    if max_seqs is None:
        assert calls.calls == ["FV"] * (first_calls + 3) + ["BV"] * (first_calls + 3), calls.calls
    else:  # one call per piece, the diagonal block's included
        assert calls.calls.count("FV") == 9 and calls.calls.count("BV") == 9, calls.calls


# ---- the kernels' varlen entry ------------------------------------------------------------------------

def _packed(lengths_q, lengths_k, hq, hkv, dtype=torch.float32, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    cu = [torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32) for lengths in
          (lengths_q, lengths_k)]
    q = torch.randn(sum(lengths_q), hq, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(lengths_k), hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, cu


def install_fake_flash_attn(set_item) -> None:
    """flash-attn 2.7/2.8's two private varlen functions (their signatures, read off its
    flash_attn_interface.py), doing what torch's varlen ops' stand-ins do."""
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size_left=-1,
                window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
        assert (window_size_left, window_size_right, softcap, alibi_slopes) == (-1, -1, 0.0, None)
        assert not return_softmax
        out, lse, *_ = flash_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, False,
                                            scale=softmax_scale)
        return out, lse, torch.empty(0), torch.zeros(2, dtype=torch.int64)

    def backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal,
                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
        grads = flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, causal, None,
                                      None, scale=softmax_scale)
        for into, grad in zip((dq, dk, dv), grads):  # it fills the buffers it is given
            into.copy_(grad)
        return torch.empty(0)

    interface = ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward = forward, backward
    package = ModuleType("flash_attn")
    package.flash_attn_interface = interface
    set_item(sys.modules, "flash_attn", package)
    set_item(sys.modules, "flash_attn.flash_attn_interface", interface)


@pytest.mark.parametrize("kernel", [TorchCudaFlashKernel, TorchCudnnKernel, FlashAttnKernel])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernels_varlen_entry_is_attention_per_sequence(monkeypatch, kernel, causal):
    """The varlen ops as the CUDA kernels call them (argument order, lse [h, T]; torch's flash
    ops, and flash-attn's functions), with GQA, against float64 attention of every sequence alone
    (fp32 kernel: 1e-5)."""
    install_flash_varlen_stand_ins(monkeypatch.setattr)
    install_fake_flash_attn(monkeypatch.setitem)
    _check_varlen_entry(kernel, causal, D)


@pytest.mark.parametrize("causal", [True, False])
def test_a_padded_head_dim_through_the_varlen_entry_is_attention_per_sequence(monkeypatch, causal):
    """d = 20, which fp16/bf16 CUDA kernels take only padded to 24 (PaddedHeadDim)."""
    install_flash_varlen_stand_ins(monkeypatch.setattr)
    _check_varlen_entry(lambda: PaddedHeadDim(TorchCudaFlashKernel()), causal, 20)


def _check_varlen_entry(kernel, causal, d):
    lengths_q = [3, 1, 6, 2]
    lengths_k = lengths_q if causal else [4, 2, 1, 5]
    q, k, v, (cu_q, cu_k) = _packed(lengths_q, lengths_k, 4, 2, d=d)
    seqs = Varlen(cu_q, cu_k, max(lengths_q), max(lengths_k), q.shape[0], k.shape[0], causal)
    out, lse = kernel().forward_varlen(q, k, v, seqs, 0.3)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    dq, dk, dv = kernel().backward_varlen(dout, q, k, v, out, lse, seqs, 0.3)
    for a, b, c, e in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        leaves = [x.double().transpose(0, 1).unsqueeze(0).requires_grad_() for x in (q[a:b], k[c:e], v[c:e])]
        ref_out, ref_lse = naive(*leaves, causal, 0.3)
        ref_out.backward(dout[a:b].double().transpose(0, 1).unsqueeze(0))
        torch.testing.assert_close(out[a:b].double(), ref_out[0].transpose(0, 1), atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[:, a:b].double(), ref_lse[0], atol=1e-5, rtol=0)
        for got, leaf in zip((dq[a:b], dk[c:e], dv[c:e]), leaves):
            torch.testing.assert_close(got.double(), leaf.grad[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_the_varlen_contract_refuses_what_mha_varlen_misreads():
    q, k, v, (cu_q, cu_k) = _packed([2, 3], [2, 3], 4, 2)
    seqs = Varlen(cu_q, cu_k, 3, 3, 5, 5, True)
    lse = torch.zeros(4, 5)
    bad = {
        "lse must be a contiguous": dict(lse=torch.zeros(5, 4).t()),  # [h, T] values laid out [T, h]
        "contiguous int32": dict(seqs=Varlen(cu_q.long(), cu_k, 3, 3, 5, 5, True)),
        "unit last stride": dict(q=torch.zeros(5, D, 4).transpose(1, 2)),
        "do not hold": dict(seqs=Varlen(cu_q, cu_k, 3, 3, 6, 5, True)),
        "count different": dict(seqs=Varlen(cu_q, cu_k[:2], 3, 3, 5, 5, True)),
        # 65536 one-row sequences over the 5 rows' worth of cu_seqlens: more than the grid takes
        "more than 65535": dict(seqs=Varlen(*(torch.zeros(65537, dtype=torch.int32),) * 2, 3, 3, 5, 5, True)),
    }
    for message, change in bad.items():
        args = dict(q=q, k=k, v=v, seqs=seqs, out=q, lse=lse, dout=q)
        args.update(change)
        with pytest.raises(KernelContractError, match=message) as err:
            TorchCudaFlashKernel().backward_varlen(args["dout"], args["q"], args["k"], args["v"], args["out"],
                                                  args["lse"], args["seqs"], 0.3)
        assert "\n" not in str(err.value)


def test_per_batch_plans_are_made_once_for_every_layer():
    """The plan (index and cu_seqlens tensors, moved to the device) is kept on the layout's list."""
    pieces = Pieces(LATER)
    first = varlen.plan(pieces, B, S, S, "cpu")
    assert varlen.plan(pieces, B, S, S, "cpu") is first
    assert varlen.plan(list(LATER), B, S, S, "cpu") is not varlen.plan(list(LATER), B, S, S, "cpu")  # kept nowhere


class _Transfers(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that take host tensors to another device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        moved = isinstance(out, torch.Tensor) and out.device.type != "cpu"
        self.count += moved and any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
        return out


def test_a_blocks_plan_reaches_the_device_in_one_copy():
    """A plan is made inside the first layer's ring loop: a copy per index or cu_seqlens tensor (six
    a group) would each wait for the compute stream on a GPU. One copy carries the block's plan (the
    meta device stands for the GPU), and its tensors are what the kernels are given."""
    groups = varlen.group_pieces(LATER, B)
    assert len(groups) > 1
    with _Transfers() as transfers:
        plan = varlen.plan(list(LATER), B, S, S, torch.device("meta"))
    on_host = varlen.plan(list(LATER), B, S, S, "cpu")
    assert transfers.count == 1 and len(plan) == len(on_host) == len(groups)
    for got, want in zip(plan, on_host):
        tensors = [(*g.q, *g.k, g.seqs.cu_q, g.seqs.cu_k) for g in (got, want)]
        for t, w in zip(*tensors):
            assert (t.device.type, t.dtype, t.shape, t.is_contiguous()) == ("meta", w.dtype, w.shape, True)
        assert got.seqs.cu_q.dtype == torch.int32 and (got.whole_q, got.whole_k) == (want.whole_q, want.whole_k)


def test_the_packed_attention_benchmark_runs_and_counts_calls(capsys):
    """tools/benchmark_attention.py --documents, tiny on CPU: both tables, and the packed row's
    kernel calls (the CPU kernel has no varlen entry: one dense call per document piece)."""
    from tools.benchmark_attention import main

    main(["--seq-lengths", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--dtype", "fp32",
          "--warmup", "0", "--iters", "1", "--documents", "32"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    work, calls = float(cells[4]), cells[5]
    assert 0 < work < 0.5 and calls.startswith("0 varlen, ") and int(calls.split()[2]) > 1, rows[1]


def test_a_merged_group_makes_one_out_sized_temporary(monkeypatch):
    """Merging a group into the fp32 accumulators gathers its rows once and updates them in place:
    besides the query rows the kernel is handed, one [T, h, d] temporary (no fp32 copy of the
    block, no separate result). The kernel's own allocations are its business (paused)."""
    from tests.unit_tests.alloc_count import CreatedTensors

    install_flash_varlen_stand_ins(monkeypatch.setattr)
    q, k, v = _inputs(0)
    out, lse = torch.randn(q.shape), torch.randn(q.shape[:3])
    pieces = Pieces([Piece(0, 4, 0, 4, False, 0), Piece(4, 8, 4, 8, False, 1)])  # one call of T = 8 rows
    groups = varlen.plan(pieces, B, S, S, "cpu")
    assert len(groups) == 1
    counter = CreatedTensors()
    kernel = ContractKernel(counter, varlen=True)
    with counter:
        varlen.block_forward(q, (k, v), groups, kernel, 0.3, out, lse)
    assert len(counter.at_least(8 * H * D)) == 2, counter.created  # the gathered q rows and out rows
