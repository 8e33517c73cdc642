"""Our core_attention module (what megatron-core's SelfAttention calls) against float64 math."""
import math

import pytest
import torch

from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.longseq.attention.core import AttentionInputs, LongSeqCoreAttention, positions_of
from megatron.longseq.config import LongSeqConfig
from megatron.longseq.random import seed_everything
from tests.unit_tests.attention.test_rope import complex_rope


def config(heads=4, groups=2, d=16, rope=True, dropout=0.0, backend="auto", selective=False):
    return LongSeqConfig(
        num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=d, attention_dropout=dropout, use_rope=rope, rotary_base=10000.0,
        attention_backend=AttnBackend[backend], recompute_core_attention=selective,
    )


def module(cfg):
    return LongSeqCoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal)


def reference(q, k, v, positions, mask=None, rope=True):
    """q [s, b, h, d], k/v [s, b, g, d] -> [s, b, h*d] in float64; mask True = hidden (Megatron)."""
    s, b, h, d = q.shape
    if rope:
        q, k = complex_rope(q, positions, d, 10000.0), complex_rope(k, positions, d, 10000.0)
    q, k, v = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    hidden = torch.ones(s, s, dtype=torch.bool).triu(1) if mask is None else mask
    out = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def inputs(s=24, b=2, h=4, g=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, n, d, generator=gen) for n in (h, g, g))
    return q, k, v


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_forward_and_grads_match_float64_with_rope_and_gqa(heads, groups, backend):
    q, k, v = inputs(h=heads, g=groups)
    positions = torch.tensor([[3 * i + 7 for i in range(24)], list(range(100, 124))])  # any ids
    attn = module(config(heads, groups, backend=backend))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = attn(qq, kk, vv, None, packed_seq_params=AttentionInputs(position_ids=positions))
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    want = reference(q64, k64, v64, positions)
    # fp32 compute on O(1) values; RoPE angles up to ~120 rad round at ~1e-5 (see test_rope).
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout.double())
    for got, ref in ((qq.grad, q64.grad), (kk.grad, k64.grad), (vv.grad, v64.grad)):
        torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=0)


def test_default_positions_are_zero_to_s():
    q, k, v = inputs()
    attn = module(config())
    default = attn(q, k, v, None)
    explicit = attn(q, k, v, None, packed_seq_params=AttentionInputs(position_ids=torch.arange(24).expand(2, 24)))
    assert torch.equal(default, explicit)


def test_document_mask_path():
    """--reset-attention-mask: block-diagonal causal masks, one per sample."""
    q, k, v = inputs(s=12, b=1)
    causal = torch.ones(12, 12, dtype=torch.bool).triu(1)
    doc = torch.zeros(12, 12, dtype=torch.bool)
    doc[6:, :6] = True  # the second document does not see the first
    mask = (causal | doc)[None, None]  # [1, 1, s, s], True = hidden
    positions = torch.cat([torch.arange(6), torch.arange(6)]).unsqueeze(0)
    out = module(config())(q, k, v, mask, packed_seq_params=AttentionInputs(position_ids=positions))
    torch.testing.assert_close(out.double(), reference(q, k, v, positions, mask[0, 0]), atol=1e-4, rtol=0)


def test_dropout_only_in_training_and_replayed_by_selective_recompute():
    seed_everything(7, tp_rank=0, device=torch.device("cpu"))
    q, k, v = inputs()
    attn = module(config(dropout=0.5))
    attn.eval()
    no_drop = attn(q, k, v, None)
    torch.testing.assert_close(no_drop, module(config())(q, k, v, None))
    attn.train()
    assert not torch.allclose(attn(q, k, v, None), no_drop)

    def grads(selective):
        seed_everything(7, tp_rank=0, device=torch.device("cpu"))
        m = module(config(dropout=0.5, selective=selective)).train()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = m(*leaves, None)
        out.square().sum().backward()
        return out, [x.grad for x in leaves]

    out_a, grads_a = grads(False)
    out_b, grads_b = grads(True)
    assert torch.equal(out_a, out_b)  # same stream, same masks
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)  # recompute redraws the very same dropout mask


@pytest.mark.parametrize("backend, device, kinds", [
    ("unfused", "cpu", ["MATH"]), ("local", "cuda", ["MATH"]), ("auto", "cuda", None), ("flash", "cpu", None),
    ("flash", "cuda", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]),
    ("fused", "cuda", ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]),
])
def test_under_dropout_sdpa_runs_the_kind_of_kernel_the_backend_names(backend, device, kinds):
    from megatron.longseq.attention.kernel_choice import sdpa_backends

    got = sdpa_backends(backend, device)
    assert (None if got is None else [b.name for b in got]) == kinds


def test_the_sdpa_path_attends_under_the_backends_the_flag_names(monkeypatch):
    """Attention dropout goes through torch's SDPA: --attention-backend unfused is its math path
    there too, not whichever kernel SDPA would pick."""
    from megatron.longseq.attention import core

    seen, real = [], core.sdpa_kernel

    def spy(backends, set_priority=False):
        seen.append(([b.name for b in backends], set_priority))
        return real(backends, set_priority=set_priority)
    monkeypatch.setattr(core, "sdpa_kernel", spy)
    seed_everything(7, tp_rank=0, device=torch.device("cpu"))
    module(config(dropout=0.5, backend="unfused")).train()(*inputs(), None)
    module(config(dropout=0.5, backend="auto")).train()(*inputs(), None)
    assert seen == [(["MATH"], True)]


def test_a_segment_without_position_ids_is_refused():
    """0..s-1 would give every Seq1F1B segment the first one's RoPE angles."""
    from megatron.longseq.attention.segments import SegmentSlot, SegmentState

    x = torch.zeros(8, 1, 2, 4)  # [s, b, h, d]
    assert torch.equal(positions_of(AttentionInputs(), x), torch.arange(8).unsqueeze(0))
    with pytest.raises(ValueError, match="position ids"):
        positions_of(AttentionInputs(segment=SegmentSlot(SegmentState(2), 1)), x)
