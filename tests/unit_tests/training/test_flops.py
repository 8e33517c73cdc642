"""Megatron's FLOPs formula against the GEMMs torch actually runs in a GPTModel step."""
import pytest
from torch.utils.flop_counter import FlopCounterMode

from megatron.training.flops import default_peak_tflops, num_floating_point_operations, peak_tflops
from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world
from tests.unit_tests.model_utils import lm_loss, tiny_args, tiny_gpt


def attention_score_flops(args, batch):
    """QK^T and PV, forward 2 x 2*s*s*q per sample and layer, causal half, x3 for training."""
    q = args.num_attention_heads * args.kv_channels
    return 3 * batch * args.num_layers * (2 * 2 * args.seq_length**2 * q) / 2


@pytest.mark.parametrize("extra", [
    "",
    "--group-query-attention --num-query-groups 2 --swiglu --untie-embeddings-and-output-weights",
    "--kv-channels 8 --ffn-hidden-size 96 --disable-bias-linear",
])
def test_formula_counts_every_gemm_of_forward_and_backward(extra):
    init_single_rank_world()
    args = tiny_args(extra)
    model = tiny_gpt(args, grid_groups())
    with FlopCounterMode(display=False) as counter:
        lm_loss(model, args).backward()
    # torch's counter sees every linear layer (forward, data grad, weight grad) but not the fused
    # attention kernel; the formula's remaining term is the attention scores.
    gemms = counter.get_total_flops()
    formula = num_floating_point_operations(args, args.micro_batch_size)
    assert gemms == pytest.approx(formula - attention_score_flops(args, args.micro_batch_size), rel=1e-12)


def test_no_peak_on_cpu():
    assert default_peak_tflops() is None


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None)])
def test_each_card_gets_its_own_dense_bf16_peak(name, peak):
    """torch's names of the cards (the H100 variants share the prefix: the longer names first)."""
    assert peak_tflops(name) == peak
