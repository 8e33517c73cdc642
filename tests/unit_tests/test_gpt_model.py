"""GPTModel with our spec: tensor parallel against one rank, recompute against no recompute."""
import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world, run_ranks
from tests.unit_tests.model_utils import lm_loss, sequence_parallel_on_host, tiny_args, tiny_gpt

CASES = {
    "mha-learned": "",
    "gqa-rope-swiglu-rms": ("--group-query-attention --num-query-groups 2 --position-embedding-type rope "
                            "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
                            "--disable-bias-linear"),
    # q/k norms are shared by every head: with tp their gradient is a partial sum (tagged, summed below)
    "qk-layernorm-1p": "--qk-layernorm --apply-layernorm-1p --position-embedding-type rope",
    # the loss a chunk at a time: the vocabulary-parallel sums over tp, the tied weight's gradient
    "cross-entropy-chunks": "--cross-entropy-chunk-tokens 10",
}


def gated_fc1_rows(rank: int, tp: int, ffn: int) -> torch.Tensor:
    """Rows of the full [gate; up] fc1 weight that tp rank `rank` holds: megatron-core builds fc1
    with stride 2, so rank r has gate rows r*ffn/tp.. and the matching up rows ffn + r*ffn/tp.."""
    gate = torch.arange(rank * ffn // tp, (rank + 1) * ffn // tp)
    return torch.cat([gate, gate + ffn])


def loss_and_grads(model, args):
    loss = lm_loss(model, args)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _tp_rank_check(extra, ref_path, sequence_parallel=False):
    if sequence_parallel:
        sequence_parallel_on_host()
        extra += " --sequence-parallel"
    args = tiny_args(extra + " --tensor-model-parallel-size 2", world_size=2)
    assert args.sequence_parallel == sequence_parallel
    pgs = grid_groups(tp=2)
    ref = torch.load(ref_path)
    loss, grads = loss_and_grads(tiny_gpt(args, pgs), args)
    # fp32: tp splits the GEMM reductions of the row-parallel layers in two and adds the halves;
    # the loss agrees to a few ulps of 7.0 (~5e-7) and gradients (O(1e-3..1)) to ~1e-6 relative.
    assert abs(loss - ref["loss"]) < 5e-6
    model = tiny_gpt(args, pgs)  # parameter metadata (partition dims)
    assert model.output_layer.sequence_parallel == sequence_parallel
    for name, param in model.named_parameters():
        grad = grads[name]
        if getattr(param, "sequence_parallel", False):  # what finalize_model_grads does
            dist.all_reduce(grad, group=pgs.tp)
        if getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(shards, grad.contiguous(), group=pgs.tp)
            grad = torch.cat(shards, dim=param.partition_dim)
            if args.swiglu and "linear_fc1" in name:  # rank r holds [gate_r; up_r]
                order = torch.cat([gated_fc1_rows(r, 2, grad.shape[0] // 2) for r in range(2)])
                grad = torch.empty_like(grad).index_copy_(0, order, grad)
        torch.testing.assert_close(grad, ref["grads"][name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_2_equals_one_rank(case, tmp_path):
    init_single_rank_world()
    args = tiny_args(CASES[case])
    loss, grads = loss_and_grads(tiny_gpt(args, grid_groups()), args)
    torch.save({"loss": loss, "grads": grads}, tmp_path / "ref.pt")
    run_ranks(_tp_rank_check, 2, CASES[case], str(tmp_path / "ref.pt"))


@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_tp2_equals_one_rank(case, tmp_path):
    """Each tp rank holds s/2 tokens between the layers' tensor-parallel regions; the norms' weight
    gradients are partial sums over tp (tagged, summed as finalize_model_grads does); the loss a
    chunk at a time gathers the hidden states first. Same bounds as without sequence parallelism."""
    init_single_rank_world()
    args = tiny_args(CASES[case])
    loss, grads = loss_and_grads(tiny_gpt(args, grid_groups()), args)
    torch.save({"loss": loss, "grads": grads}, tmp_path / "ref.pt")
    run_ranks(_tp_rank_check, 2, CASES[case], str(tmp_path / "ref.pt"), True)


@pytest.mark.parametrize("recompute", [
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "--recompute-granularity full --recompute-method block --recompute-num-layers 1",
    "--recompute-granularity selective",
])
def test_recompute_gives_identical_gradients_with_dropout(recompute):
    init_single_rank_world()
    dropout = "--hidden-dropout 0.2 --attention-dropout 0.2 --num-layers 3"
    base = tiny_args(dropout)
    ref_loss, ref_grads = loss_and_grads(tiny_gpt(base, grid_groups()).train(), base)
    args = tiny_args(f"{dropout} {recompute}")
    loss, grads = loss_and_grads(tiny_gpt(args, grid_groups()).train(), args)
    assert loss == ref_loss
    for name, grad in grads.items():
        # The same kernels run on the same inputs and dropout masks: bitwise equal.
        assert torch.equal(grad, ref_grads[name]), name


def test_layernorm_1p_stores_gamma_minus_one_and_computes_the_same():
    """--apply-layernorm-1p changes what the norm weights hold (gamma - 1, zero at start), not
    the function: loss and gradients equal the plain norm's (1 + 0 is exact)."""
    init_single_rank_world()
    plain, centred = tiny_args(), tiny_args("--apply-layernorm-1p")
    loss, grads = loss_and_grads(tiny_gpt(plain, grid_groups()), plain)
    model = tiny_gpt(centred, grid_groups())
    norm_weights = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight")]
    assert norm_weights and all(torch.equal(w, torch.zeros_like(w)) for w in norm_weights)
    loss_1p, grads_1p = loss_and_grads(model, centred)
    assert loss_1p == loss
    for name, grad in grads.items():
        assert torch.equal(grads_1p[name], grad), name


def test_cpu_model_gives_no_cuda_connection_advice():
    """megatron-core's tp linears advise CUDA_DEVICE_MAX_CONNECTIONS=1 once per process; on CPU
    that advice is noise, so building a CPU model spends it."""
    from megatron.core.tensor_parallel import layers

    init_single_rank_world()
    layers.linear_with_grad_accumulation_and_async_allreduce.warned = False
    tiny_gpt(tiny_args(), grid_groups())
    assert layers.linear_with_grad_accumulation_and_async_allreduce.warned


def _te_named_layer() -> torch.nn.Module:
    """A stand-in with Transformer Engine's parameter names for a layer's fused norm + qkv linear
    (TE is not installed here; only the names and shapes matter to the initialisation)."""
    qkv = torch.nn.Module()
    qkv.layer_norm_weight, qkv.layer_norm_bias = torch.nn.Parameter(torch.empty(8)), torch.nn.Parameter(torch.empty(8))
    qkv.weight = torch.nn.Parameter(torch.empty(24, 8))
    layer = torch.nn.Module()
    layer.layer_number, layer.self_attention = 1, torch.nn.Module()
    layer.self_attention.linear_qkv = qkv
    model = torch.nn.Module()
    model.share_embeddings_and_output_weights, model.decoder = False, torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer])
    return model


@pytest.mark.parametrize("one_p", [False, True])
def test_transformer_engines_fused_norms_start_as_megatrons(one_p):
    """TE's fused norms (`layer_norm_weight`, `layer_norm_bias`) start as our own norms do: bias 0,
    weight 1, or 0 with --apply-layernorm-1p (TE's zero-centred gamma); the linear weight drawn."""
    from megatron.training.init import initialize_parameters

    model = _te_named_layer()
    initialize_parameters([model], 1234, 0.02, 1, 0, 1, zero_centered=one_p)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert torch.equal(qkv.layer_norm_bias, torch.zeros(8))
    assert torch.equal(qkv.layer_norm_weight, torch.zeros(8) if one_p else torch.ones(8))
    assert 0.01 < qkv.weight.std().item() < 0.03


def test_qk_norms_are_summed_over_tp_whichever_module_builds_them():
    """Each tp rank's q/k norm sees only its heads: its gradient is a partial sum, tagged to be
    summed over tp. TE's TENorm tags its parameters only under sequence parallel, so QKNorm tags
    whatever module it is given (a stand-in for TENorm here) and the spec uses it for both impls."""
    from megatron.longseq.attention.spec import gpt_block_spec
    from megatron.longseq.norm import Norm, QKNorm
    from megatron.training.model import transformer_config

    config = transformer_config(tiny_args("--qk-layernorm"))
    assert not config.sequence_parallel

    class UntaggedNorm:  # what TENorm gives without sequence parallel
        def __new__(cls, config, hidden_size, eps):
            return torch.nn.LayerNorm(hidden_size, eps=eps)
    norm = QKNorm(config, 16, norm=UntaggedNorm)
    assert isinstance(norm, torch.nn.LayerNorm) and all(p.sequence_parallel for p in norm.parameters())
    attention = gpt_block_spec(config, 1).layer_specs[0].submodules.self_attention.submodules
    assert attention.q_layernorm.module is QKNorm and attention.q_layernorm.params == {"norm": Norm}
    assert attention.k_layernorm is attention.q_layernorm
