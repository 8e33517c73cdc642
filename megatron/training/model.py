"""megatron-core GPTModel from Megatron arguments, with our layer spec."""
from __future__ import annotations

import importlib.util
from typing import List

import torch
import torch.nn.functional as F

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.longseq.attention.context_parallel import ContextParallel
from megatron.longseq.attention.rope import RopeScaling
from megatron.longseq.attention.spec import gpt_block_spec
from megatron.longseq.chunked_loss import LongSeqGPTModel
from megatron.longseq.config import LongSeqConfig
from megatron.longseq.recompute import apply_full_recompute
from megatron.training.init import initialize_parameters


def params_dtype(args) -> torch.dtype:
    """The model's dtype: --bf16 or --fp16 (Megatron's mixed precision: fp32 main params in the
    optimizer), else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def fusions(args) -> dict:
    """megatron-core's fused ops: on GPU as Megatron enables them (each --no-*-fusion flag turns
    one off), on CPU none -- they are CUDA extensions or torch.compile'd kernels meant for GPU."""
    gpu = args.device_type == "cuda"
    # megatron-core's jit_fuser is torch.compile, which guards on the saved-tensor hooks in force;
    # MEMO installs its own per layer, so those fusions would recompile each layer, then fall back.
    compiled = gpu and not args.memo
    activation = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
    return dict(
        # an ungated GELU is fused only together with its bias (megatron-core refuses it otherwise)
        bias_activation_fusion=compiled and activation and (args.swiglu or args.add_bias_linear),
        bias_dropout_fusion=compiled and args.bias_dropout_fusion,
        masked_softmax_fusion=gpu and args.masked_softmax_fusion,
        gradient_accumulation_fusion=gpu and args.gradient_accumulation_fusion and _wgrad_fusion_present(args),
        # bf16 only: the fused backward hands bf16 gradients of the logits whatever their dtype. Not
        # under the planned allocator: the fused loss is torch.compile'd, and Inductor's autotuning
        # may ask the allocator for statistics, which a pluggable allocator refuses with an error.
        cross_entropy_loss_fusion=(gpu and args.bf16 and args.cross_entropy_loss_fusion is not False
                                   and args.memo_allocator != "planned"),
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
    )


def _wgrad_fusion_present(args) -> bool:
    """apex's extension, whatever --transformer-impl: Transformer Engine's linears fuse it
    themselves, but GPTModel's output layer is megatron-core's own linear, which refuses to be
    built with the fusion and without apex."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def _drawn_by_init_py(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


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
        add_qkv_bias=args.add_qkv_bias,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm,
        test_mode=args.test_mode,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        init_method_std=args.init_method_std,
        # init.py draws every parameter: megatron-core's pass (kept on below for its partition
        # tags) draws nothing, where it drew each full master weight only to have it overwritten
        # (12.5 of the 39 s a 1.3B model took to set up on two cores).
        init_method=_drawn_by_init_py,
        output_layer_init_method=_drawn_by_init_py,
        embedding_init_method=_drawn_by_init_py,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_chunks if args.virtual_pipeline_chunks > 1 else None,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
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
        **fusions(args),
        persist_layer_norm=False,  # apex's persistent LayerNorm: our norms are our own
        apply_rope_fusion=False,  # RoPE is applied by our core attention
        use_rope=args.position_embedding_type == "rope",
        rotary_base=float(args.rotary_base),
        rotary_percent=args.rotary_percent,
        rotary_interleaved=args.rotary_interleaved,
        rope_scaling=rope_scaling(args),
        recompute_core_attention=args.recompute_granularity == "selective",
        selective_checkpoint_pp=args.selective_checkpoint_pp,
        cross_entropy_chunk_tokens=args.cross_entropy_chunk_tokens,
    )


def rope_scaling(args) -> RopeScaling:
    """The context-extension flags as one value (rope.py)."""
    kind = "llama3" if args.use_rope_scaling else "yarn" if args.rope_type == "yarn" else "rope"
    factor = {"llama3": args.rope_scaling_factor, "yarn": args.rotary_scaling_factor}.get(kind, 1.0)
    return RopeScaling(kind=kind, factor=factor, interpolation=float(args.rotary_seq_len_interpolation_factor or 1),
                       original_context=args.original_max_position_embeddings, beta_fast=args.beta_fast,
                       beta_slow=args.beta_slow, mscale=args.mscale, mscale_all_dim=args.mscale_all_dim)


def _quiet_cuda_advice(device: torch.device) -> None:
    """megatron-core's tp linears advise CUDA_DEVICE_MAX_CONNECTIONS=1 once per process: a CUDA
    stream setting, which means nothing to a CPU run."""
    if device.type != "cuda":
        from megatron.core.tensor_parallel import layers

        layers.linear_with_grad_accumulation_and_async_allreduce.warned = True


def build_model_chunks(args, pgs, device: torch.device) -> List[torch.nn.Module]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving), each
    a GPTModel with its share of the layers; bf16 chunks wrapped in megatron-core's Float16Module."""
    _quiet_cuda_advice(device)
    config = transformer_config(args)
    p, v, stage = args.pipeline_model_parallel_size, args.virtual_pipeline_chunks, pgs.index("pp")
    cp = ContextParallel.from_process_groups(pgs, args.segment_lengths)
    # embd=None: megatron-core's tied-embedding sync needs CUDA; init.py gives both copies the same
    # values and finalize_model_grads keeps their gradients summed.
    groups = ProcessGroupCollection(tp=pgs.tp, cp=pgs.cp, pp=pgs.pp, embd=None)
    chunks = []
    for c in range(v):
        vs = c * p + stage
        chunks.append(LongSeqGPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(config, chunk_layers(config, stage, c), args.transformer_impl, cp),
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
    initialize_parameters(chunks, args.seed, args.init_method_std, args.num_layers, pgs.index("tp"), pgs.size("tp"),
                          args.apply_layernorm_1p)
    for model in chunks:
        if args.recompute_granularity == "full":
            apply_full_recompute(model.decoder.layers, args.recompute_method, args.recompute_num_layers)
        model.to(device)
    return [Float16Module(config, m) if args.bf16 or args.fp16 else m for m in chunks]


def chunk_layers(config, stage: int, chunk: int) -> int:
    """Transformer layers of a model chunk, as megatron-core splits them (uneven first / last
    stages, the embedding and loss counted in the split); it numbers the layers from the same
    config, so layer names and checkpoint offsets follow."""
    return get_num_layers_to_build(config, vp_stage=chunk if config.virtual_pipeline_model_parallel_size else None,
                                   pp_rank=stage)


def logits_line(args, cp: int) -> str:
    """What one step's logits take on a last-stage rank: a micro-batch's (or Seq1F1B segment's)
    tokens of this rank x its vocabulary slice, in the model's dtype and again in fp32 for the loss;
    with --cross-entropy-chunk-tokens, one chunk's. At long sequences the whole logits are the
    largest tensors of a step, and the log says so before any memory is spent."""
    tokens = args.micro_batch_size * max(args.segment_lengths) // cp
    vocab = args.padded_vocab_size // args.tensor_model_parallel_size
    per_token = vocab * (params_dtype(args).itemsize + 4) / 2**30  # GiB
    chunk = args.cross_entropy_chunk_tokens
    if chunk:
        held = min(chunk, tokens)
        return f"> logits: {held} of {tokens} tokens at a time x {vocab} vocabulary: {held * per_token:.2f} GiB"
    line = f"> logits: {tokens} tokens x {vocab} vocabulary: {tokens * per_token:.2f} GiB"
    if tokens * per_token > 1.0:
        line += f" (--cross-entropy-chunk-tokens 8192 would hold {min(8192, tokens) * per_token:.2f} GiB)"
    return line


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
