"""megatron-core GPTModel from Megatron arguments, with our layer spec."""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module
from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.spec import gpt_block_spec
from megatron.longseq.config import LongSeqConfig
from megatron.longseq.recompute import apply_full_recompute
from megatron.training.init import initialize_parameters


def transformer_config(args) -> LongSeqConfig:
    return LongSeqConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_chunks if args.virtual_pipeline_chunks > 1 else None,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        # Parameters are allocated on CPU; init.py then overwrites megatron-core's values with the
        # same model for every layout. megatron-core's own pass must stay on: it is what tags
        # weights with their tensor-parallel partition (dim, stride), which init.py and the
        # gradient norms read.
        use_cpu_initialization=True,
        # No CUDA graphs are captured; megatron-core's default scope name ("full") is deprecated
        # and warns on every config, the empty list is its current spelling of the same thing.
        cuda_graph_scope=[],
        perform_initialization=True,
        deterministic_mode=args.deterministic_mode,
        attention_backend=AttnBackend[args.attention_backend],
        calculate_per_token_loss=args.calculate_per_token_loss,
        # Fusions that need CUDA extensions stay off; the local spec has none of them.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        use_rope=args.position_embedding_type == "rope",
        rotary_base=float(args.rotary_base),
        rotary_percent=args.rotary_percent,
        recompute_core_attention=args.recompute_granularity == "selective",
        selective_checkpoint_pp=args.selective_checkpoint_pp,
    )


def build_model_chunks(args, pgs, device: torch.device) -> List[torch.nn.Module]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving), each
    a GPTModel with its share of the layers; bf16 chunks wrapped in megatron-core's Float16Module."""
    config = transformer_config(args)
    p, v, stage = args.pipeline_model_parallel_size, args.virtual_pipeline_chunks, pgs.index("pp")
    per_chunk = args.num_layers // (p * v)
    cp = ContextParallel.from_process_groups(pgs)
    # embd=None: megatron-core's tied-embedding sync needs CUDA; init.py gives both copies the same
    # values and finalize_model_grads keeps their gradients summed.
    groups = ProcessGroupCollection(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, embd=None)
    chunks = []
    for c in range(v):
        vs = c * p + stage
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(config, per_chunk, args.transformer_impl, cp),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=vs == 0,
            post_process=vs == p * v - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            # RoPE is applied inside our core attention from position ids; GPTModel adds nothing.
            position_embedding_type="learned_absolute" if args.position_embedding_type == "learned_absolute" else "none",
            pg_collection=groups,
            vp_stage=c if v > 1 else None,
        ))
    initialize_parameters(chunks, args.seed, args.init_method_std, args.num_layers, pgs.index("tp"), pgs.size("tp"))
    for model in chunks:
        if args.recompute_granularity == "full":
            apply_full_recompute(model.decoder.layers, args.recompute_method, args.recompute_num_layers)
        model.to(device)
    return [Float16Module(config, m) if args.bf16 else m for m in chunks]


def build_gpt_model(args, pgs, device: torch.device):
    """The whole model on one pipeline stage (no pipelining)."""
    chunks = build_model_chunks(args, pgs, device)
    if len(chunks) != 1:
        raise ValueError("build_gpt_model builds one stage; use build_model_chunks with pipelining")
    return chunks[0]


def unwrap(model):
    if isinstance(model, list):
        return [unwrap(m) for m in model]
    return model.module if isinstance(model, Float16Module) else model
