"""The layer spec: megatron-core's GPT layer with our core attention swapped in."""
from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.core import LongSeqCoreAttention
from megatron.longseq.norm import Norm, QKNorm


def gpt_block_spec(config, num_layers: int, transformer_impl: str = "local",
                   cp: ContextParallel = None) -> TransformerBlockSubmodules:
    """Block spec of `num_layers` layers (this pipeline stage's share).

    local: megatron-core's local modules with our Norm (sequence-parallel aware);
    transformer_engine: TE's fused norm+linear modules (needs Transformer Engine and CUDA).
    Either way core_attention is ours, given this rank's context-parallel layout `cp`, and the
    q/k norms are QKNorm (their gradients summed over tp)."""
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        layer = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
        final_norm = TENorm
    else:
        layer = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
        layer.submodules.input_layernorm = Norm
        layer.submodules.pre_mlp_layernorm = Norm
        final_norm = Norm
    attention = layer.submodules.self_attention.submodules
    if config.qk_layernorm:  # under TE megatron-core's choice (TENorm; apex's before TE 1.9), else ours
        norm = attention.q_layernorm if transformer_impl == "transformer_engine" else Norm
        attention.q_layernorm = attention.k_layernorm = ModuleSpec(module=QKNorm, params={"norm": norm})
    attention.core_attention = ModuleSpec(
        module=LongSeqCoreAttention, params={"cp": cp if cp is not None else ContextParallel.local()})
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
