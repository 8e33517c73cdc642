import pytest
import torch

from megatron.longseq.attention.rope import RotaryEmbedding
from tests.unit_tests.alloc_count import CreatedTensors


def complex_rope(x, positions, rot_dim, base):
    """RoPE as a complex rotation, float64: pair (x_j, x_{j + rot/2}) is the number x_j + i x_{j+rot/2},
    multiplied by exp(i * p * base^(-2j/rot))."""
    half = rot_dim // 2
    x64 = x.double()
    z = torch.complex(x64[..., :half], x64[..., half:rot_dim])
    inv = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angle = positions.double().T[:, :, None, None] * inv  # [s, b, 1, half]
    z = z * torch.exp(1j * angle)
    return torch.cat([z.real, z.imag, x64[..., rot_dim:]], dim=-1)


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotation_matches_complex_form_with_arbitrary_positions(percent):
    s, b, h, d = 12, 2, 3, 16
    x = torch.randn(s, b, h, d)
    positions = torch.randint(0, 5000, (b, s))
    rope = RotaryEmbedding(d, rotary_percent=percent, rotary_base=10000)
    got = rope(x, positions)
    want = complex_rope(x, positions, int(d * percent), 10000.0)
    # fp32 angles: p * inv_freq up to 5e3 rad rounds at ~5e3 * 2^-24 ~ 3e-4; values are O(1).
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=0)
    if percent < 1:
        assert torch.equal(got[..., int(d * percent):], x[..., int(d * percent):])


def test_scores_depend_only_on_relative_position():
    d = 8
    rope = RotaryEmbedding(d)
    q, k = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d)
    def score(pq, pk):
        return (rope(q, torch.tensor([[pq]])) * rope(k, torch.tensor([[pk]]))).sum()
    torch.testing.assert_close(score(10, 3), score(107, 100), atol=1e-5, rtol=0)


def test_same_as_megatron_core_rope_for_contiguous_positions():
    """Interchangeable with megatron-core's RoPE (non-interleaved), so checkpoints carry over."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding as McoreRope

    s, b, h, d = 20, 2, 4, 32
    x = torch.randn(s, b, h, d)
    mcore = McoreRope(kv_channels=d, rotary_percent=0.5, rotary_base=500000, use_cpu_initialization=True)
    # Its forward moves the frequencies to CUDA; its embedding is [s, 1, 1, rot] = cat(f, f) of
    # positions x inv_freq (non-interleaved), built here from its own inv_freq.
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), mcore.inv_freq)
    want = _apply_rotary_pos_emb_bshd(x, torch.cat([freqs, freqs], -1)[:, None, None, :])
    ours = RotaryEmbedding(d, rotary_percent=0.5, rotary_base=500000)
    got = ours(x, torch.arange(s).expand(b, s))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_same_as_megatron_core_rope_in_both_pairings(interleaved):
    """--rotary-interleaved pairs channels (2j, 2j+1): megatron-core's interleaved form, whose
    embedding repeats each frequency twice in place; and the backward is still the inverse."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    s, b, h, d = 12, 2, 3, 16
    x = torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True)
    ours = RotaryEmbedding(d, rotary_percent=0.5, interleaved=interleaved).double()
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), ours.inv_freq.double())
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
    want = _apply_rotary_pos_emb_bshd(x, emb[:, None, None, :], rotary_interleaved=interleaved)
    got = ours(x, torch.arange(s).expand(b, s))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # inv_freq is kept in fp32
    grad = torch.randn_like(x)
    (g_ours,) = torch.autograd.grad(got, x, grad)
    (g_want,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(g_ours, g_want, atol=1e-6, rtol=0)


def test_bf16_rotates_in_bf16_within_its_rounding_and_makes_no_fp32_copies():
    """Megatron's unfused RoPE: fp32 angles, cos/sin cast to the input dtype, the rotation in that
    dtype. Each output is x1 cos - x2 sin with x, cos, sin in bf16 and two roundings (product, sum):
    |error| <= ~3 * 2^-8 * (|x1| + |x2|) on top of the input rounding; 4 * 2^-8 * max|x| bounds it."""
    x = torch.randn(8, 2, 2, 16, requires_grad=True)
    rope = RotaryEmbedding(16)
    pos = torch.arange(8).expand(2, 8)
    xb = x.detach().bfloat16().requires_grad_()
    with CreatedTensors() as created:
        got = rope(xb, pos)
        got.backward(torch.ones_like(got))
    assert got.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    # No fp32 tensor larger than the angles [s, b, 1, rot/2] (before: fp32 copies of q and k).
    assert not [c for c in created.created if c[2] == torch.float32 and c[1] > 8 * 2 * 8], created.created
    want = complex_rope(xb.detach().float(), pos, 16, 10000.0)
    bound = 4 * 2**-8 * x.detach().abs().max().item()
    torch.testing.assert_close(got.double(), want, atol=bound, rtol=0)
    rope(x, pos).backward(torch.ones_like(x))  # fp32 reference gradient
    torch.testing.assert_close(xb.grad.double(), x.grad.double(), atol=bound, rtol=0)


def test_backward_is_the_inverse_rotation():
    x = torch.randn(6, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    rope = RotaryEmbedding(8, rotary_percent=0.5).double()
    pos = torch.randint(0, 1000, (2, 6))
    assert torch.autograd.gradcheck(lambda t: rope(t, pos), (x,))


def test_cos_and_sin_are_computed_once_per_step_for_all_layers():
    """The batch's cache (AttentionInputs.rope_cache) carries the angles from layer to layer."""
    from megatron.longseq.attention.core import AttentionInputs, LongSeqCoreAttention
    from tests.unit_tests.attention.test_core_attention import config

    layers = [LongSeqCoreAttention(config(), layer_number=n, attn_mask_type=None) for n in (1, 2, 3)]
    q, k = torch.randn(12, 2, 4, 16), torch.randn(12, 2, 2, 16)
    params = AttentionInputs(position_ids=torch.arange(12).expand(2, 12))
    calls = []
    cos = torch.Tensor.cos
    torch.Tensor.cos = lambda t: (calls.append(t.shape), cos(t))[1]
    try:
        for layer in layers:
            layer(q, k, k, None, packed_seq_params=params)
    finally:
        torch.Tensor.cos = cos
    assert len(calls) == 1, calls


def test_odd_rotary_dim_is_rejected():
    with pytest.raises(ValueError, match="must be a positive even number"):
        RotaryEmbedding(10, rotary_percent=0.5)


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_a_half_precision_model_computes_positions_in_fp32(precision):
    """Megatron's Float16Module casts the whole model (its buffers too) to bf16 / fp16: the
    frequencies must stay fp32, or positions past 256 round to 8 significant bits in bf16 (100000
    to 100003 all become 99840) and overflow past 65504 in fp16. The rotation of positions near
    100K then equals the fp32 module's (to the output dtype's rounding of O(1) values)."""
    from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world
    from tests.unit_tests.model_utils import tiny_args, tiny_gpt

    init_single_rank_world()
    model = tiny_gpt(tiny_args(f"{precision} --position-embedding-type rope"), grid_groups())
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(r.inv_freq.dtype == torch.float32 for r in ropes)
    positions = torch.arange(100000, 100004).unsqueeze(0)
    fp32 = RotaryEmbedding(ropes[0].rot_dim, rotary_base=ropes[0].base)
    dtype = next(model.parameters()).dtype
    for got, want in zip(ropes[0].cos_sin(positions, dtype), fp32.cos_sin(positions, torch.float32)):
        torch.testing.assert_close(got.float(), want, atol=2 ** -8, rtol=0)  # one bf16 ulp at 1


@pytest.mark.parametrize("mscale, mscale_all_dim", [(1.0, 0.0), (0.707, 0.0), (2.0, 0.0), (0.8, 0.5), (0.707, 0.707)])
def test_yarn_attention_factor_is_megatron_cores_for_its_flags(mscale, mscale_all_dim):
    """Megatron's --mscale / --mscale-all-dim always give the ratio of the two; a lone --mscale was
    ignored here (transformers' rule), so a Megatron user's --mscale 0.707 changed nothing."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor
    from megatron.longseq.attention.rope import RopeScaling, attention_factor

    ours = attention_factor(RopeScaling("yarn", 16.0, mscale=mscale, mscale_all_dim=mscale_all_dim))
    assert ours == pytest.approx(_yarn_get_concentration_factor(16.0, mscale, mscale_all_dim), rel=1e-15)
