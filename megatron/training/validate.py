"""Argument validation and derived values. Runs before any process group is built: every error is
one line with the numbers that do not fit, and the run exits non-zero having done no work."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from functools import partial
from typing import Sequence

import torch

from megatron.longseq.attention.placement import split_heads
from megatron.longseq.parallel_state import GridError, RankGrid
from megatron.longseq.pipeline import partition, plan
from megatron.training.arguments import ArgsError
from megatron.training.problems import collecting, flag, guard, require
from megatron.training.tokenizer import build_tokenizer
from megatron.training.validate_data import data_args
from megatron.training.validate_memo import memo_args, saved_plan_args

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")


def world_size_from_env() -> int:
    """The world the process group will have: start-up's own reading of the launcher (a plain
    `python` inside an allocation that sets SLURM_NTASKS is still one rank)."""
    from megatron.training.initialize import launch_env

    return launch_env().world_size


def validate_args(args: argparse.Namespace, world_size: int, errors: Sequence[str] = ()) -> argparse.Namespace:
    """Check `args` for a run of `world_size` ranks and fill in derived values. Raises ArgsError
    with every problem found, `errors` (the parser's) first, in one line."""
    errors = list(errors)
    with collecting(errors):
        for check in (_required, _ranges, _model_args, partial(_parallel_args, world_size=world_size), _batch_args,
                      _precision_args, _overlap_args, _pipeline_args, _schedule_args, _recompute_args, memo_args,
                      data_args, _rerun_args, _checkpoint_args, partial(_profile_args, world_size=world_size)):
            _run_check(check, args, errors)
        if not errors:  # last: they read files the checks above found (a saved plan, the vocabulary's size)
            for check in (_vocab_args, saved_plan_args):
                _run_check(check, args, errors)
    if errors:
        raise ArgsError("; ".join(dict.fromkeys(errors)))
    return args


def _run_check(check, args, errors: list) -> None:
    try:
        check(args)
    except ArgsError as err:  # a guard stopped this check
        errors.append(str(err))
    except (TypeError, AttributeError, ValueError, ZeroDivisionError):
        if not errors:
            raise
        # a value an earlier problem left unset or invalid: that problem is already reported


def _required(args):
    missing = [flag(name) for name in REQUIRED if getattr(args, name) is None]
    guard(not missing, f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")


# Values outside these ranges pass argparse and fail later, some after the process group is up.
RANGES = (
    (("num_query_groups", "kv_channels", "ffn_hidden_size", "rotary_base", "adam_eps", "make_vocab_size_divisible_by",
      "distributed_timeout_minutes", "tensorboard_log_interval", "tensorboard_queue_size"), lambda x: x > 0,
     "must be positive"),
    (("init_method_std", "weight_decay", "start_weight_decay", "end_weight_decay", "seed", "manual_gc_interval"),
     lambda x: x >= 0, "must be >= 0"),
    (("adam_beta1", "adam_beta2"), lambda x: 0 <= x < 1, "must be in [0, 1)"),
    (("rotary_percent",), lambda x: 0 < x <= 1, "must be in (0, 1]"),
)


def _ranges(args):
    """Every value out of its range at once (None: unset, derived later)."""
    bad = [f"{flag(n)} {rule}, got {getattr(args, n)}"
           for names, ok, rule in RANGES for n in names if _out(args, n, ok)]
    require(not bad, "; ".join(bad))


def _out(args, name: str, ok) -> bool:
    value = getattr(args, name, None)
    return value is not None and not ok(value)


def _model_args(args):
    guard(args.num_layers > 0 and args.hidden_size > 0 and args.num_attention_heads > 0,
          "--num-layers, --hidden-size and --num-attention-heads must be positive")
    if args.kv_channels is None:
        guard(args.hidden_size % args.num_attention_heads == 0,
              f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
              f"{args.num_attention_heads} (or pass --kv-channels)")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    require(args.num_attention_heads % args.num_query_groups == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}")
    if args.ffn_hidden_size is None:
        # Megatron: 4h, or for SwiGLU 2/3 of that rounded down to a multiple of 64.
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    require(args.seq_length <= args.max_position_embeddings,
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}")
    if args.position_embedding_type == "rope":
        rot = int(args.kv_channels * args.rotary_percent)
        require(rot > 0 and rot % 2 == 0,
                f"rotary dim = kv channels {args.kv_channels} x --rotary-percent "
                f"{args.rotary_percent} = {rot} must be a positive even number")
    _check_rope_scaling(args)
    require(not (args.test_mode and args.qk_layernorm and args.normalization == "RMSNorm"),
            "--test-mode compares the q/k norms' biases (megatron-core), which --normalization RMSNorm lacks")
    for name in ("hidden_dropout", "attention_dropout"):
        require(0.0 <= getattr(args, name) < 1.0, f"{flag(name)} must be in [0, 1)")
    if args.tokenizer_type == "NullTokenizer":
        require(args.vocab_size is not None and args.vocab_size > 0,
                "--tokenizer-type NullTokenizer needs --vocab-size")


def _check_rope_scaling(args):
    """At most one of llama3 and yarn; every factor a stretch (>= 1); only with RoPE."""
    llama3, yarn = args.use_rope_scaling, args.rope_type == "yarn"
    interpolation = args.rotary_seq_len_interpolation_factor
    if llama3 or yarn or interpolation is not None:
        require(args.position_embedding_type == "rope", "RoPE scaling needs --position-embedding-type rope")
    require(not (llama3 and yarn), "--use-rope-scaling (llama3) and --rope-type yarn are two scalings: pick one")
    for name, on in (("rope_scaling_factor", llama3), ("rotary_scaling_factor", yarn),
                     ("rotary_seq_len_interpolation_factor", interpolation is not None)):
        require(not on or getattr(args, name) >= 1, f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    orig = args.original_max_position_embeddings
    require(orig is None or orig > 0, f"--original-max-position-embeddings must be positive, got {orig}")


def _parallel_args(args, world_size):
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "num_distributed_optimizer_instances"):  # by flag name here, not the grid's axis names
        guard(getattr(args, name) >= 1, f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    _device_args(args)  # first: later checks of every group read the device
    args.head_parallel_size, args.ring_size = _cp_split(args, cp)
    try:
        grid = RankGrid(world_size=world_size, tp=tp, pp=pp, cp=cp, hp=args.head_parallel_size,
                        inner_ring=args.cp_inner_ring_size, placement=args.cp_placement,
                        instances=args.num_distributed_optimizer_instances)
    except GridError as err:
        raise ArgsError(str(err)) from None
    args.world_size = world_size
    args.data_parallel_size = grid.dp
    heads_even = require(args.num_attention_heads % tp == 0,
                         f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {tp}")
    # without GQA the groups are the heads: one message for both
    groups_even = heads_even if args.num_query_groups == args.num_attention_heads else require(
        args.num_query_groups % tp == 0,
        f"number of query groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    require(args.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if heads_even and groups_even:  # else a tp rank's heads are no whole number to split further
        _head_parallel_split(args, tp)
    _context_parallel_args(args, cp)


def _device_args(args):
    """The backend decides the device; what needs CUDA or Transformer Engine is refused without."""
    cuda = torch.cuda.is_available()
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    require(cuda or args.distributed_backend == "gloo",
            "--distributed-backend nccl needs CUDA devices and none is visible (use gloo on CPU)")
    # gloo moves host tensors (no reduce-scatter or send/recv of CUDA tensors): it means a CPU run
    args.device_type = "cuda" if args.distributed_backend == "nccl" else "cpu"
    cuda = args.device_type == "cuda"
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as Megatron: nothing to split with one tp rank
    sequence_parallel_device(args)
    require(args.transformer_impl == "local" or cuda,
            "--transformer-impl transformer_engine needs CUDA and Transformer Engine (use local on CPU)")
    require(args.transformer_impl == "local" or importlib.util.find_spec("transformer_engine"),
            "--transformer-impl transformer_engine needs Transformer Engine installed "
            "(pip install 'transformer-engine[pytorch]'), or use --transformer-impl local")
    require(args.cross_entropy_fusion_impl == "native" or importlib.util.find_spec("transformer_engine"),
            "--cross-entropy-fusion-impl te needs Transformer Engine (use native)")


def sequence_parallel_device(args) -> None:
    """A separate check, so that tests can run sequence parallelism on host ranks (model_utils)."""
    require(not args.sequence_parallel or args.device_type == "cuda",
            "--sequence-parallel needs CUDA: megatron-core 0.16's sequence-parallel collectives "
            "allocate their buffers on the GPU")


def _cp_split(args, cp):
    """(head-parallel, ring) sizes from --cp-comm-type and --hierarchical-context-parallel-sizes."""
    if len(args.cp_comm_type) != 1:
        raise ArgsError(f"--cp-comm-type takes one value for all layers, got {args.cp_comm_type}")
    mode, sizes = args.cp_comm_type[0], args.hierarchical_context_parallel_sizes
    args.cp_comm_type = mode
    require(args.cp_inner_ring_size is None or mode != "a2a",
            "--cp-inner-ring-size needs a ring (--cp-comm-type p2p or a2a+p2p)")
    if mode != "a2a+p2p":
        require(sizes is None, "--hierarchical-context-parallel-sizes needs --cp-comm-type a2a+p2p")
        return (cp, 1) if mode == "a2a" else (1, cp)
    guard(sizes is not None and len(sizes) == 2,
          "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes HEAD_PARALLEL RING")
    guard(min(sizes) >= 1, f"--hierarchical-context-parallel-sizes must be >= 1, got {sizes[0]} {sizes[1]}")
    guard(sizes[0] * sizes[1] == cp,
          f"--hierarchical-context-parallel-sizes {sizes[0]} x {sizes[1]} = {sizes[0] * sizes[1]} "
          f"differs from --context-parallel-size {cp}")
    return sizes[0], sizes[1]


def _head_parallel_split(args, tp):
    hp = args.head_parallel_size
    try:
        split_heads(args.num_attention_heads // tp, args.num_query_groups // tp, hp)
    except ValueError as err:
        require(False, f"head-parallel size {hp}: {err}")


def _context_parallel_args(args, cp):
    if cp > 1:  # each rank holds two of the 2 x cp chunks; one rank takes the sequence whole
        require(args.seq_length % (2 * cp) == 0,
                f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size {cp} = {2 * cp}")
        require(args.attention_dropout == 0.0,
                "--attention-dropout must be 0 with --context-parallel-size > 1 (ring attention merges "
                "softmax partials: dropout would need one mask across ranks)")
    require(not args.selective_checkpoint_pp or args.recompute_granularity == "full",
            "--selective-checkpoint-pp needs --recompute-granularity full")
    # attention dropout at cp 1 runs torch's SDPA (a dropout mask), which keeps no (out, lse)
    require(not args.selective_checkpoint_pp or cp > 1 or args.attention_dropout == 0.0,
            "--selective-checkpoint-pp keeps the attention kernel's output and softmax statistics, which "
            "--attention-dropout > 0 (torch's SDPA) does not give: set --attention-dropout 0")


def _batch_args(args):
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    guard(mbs > 0, f"--micro-batch-size must be positive, got {mbs}")
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    guard(args.global_batch_size % (mbs * dp) == 0,
          f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
          f"{mbs} x data-parallel size {dp} = {mbs * dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)


def _precision_args(args):
    require(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    require(args.loss_scale is None or args.loss_scale > 0, f"--loss-scale must be positive, got {args.loss_scale}")
    require(args.loss_scale is None or args.fp16 or args.bf16 or args.use_distributed_optimizer,
            "--loss-scale needs --fp16, --bf16 or --use-distributed-optimizer (Megatron's fp32 optimizer takes "
            "no loss scale)")
    if args.fp16 and args.loss_scale is None:
        # Megatron's: under dynamic scaling a non-finite loss or gradient is the scaler's signal to
        # skip the step and back off, not a fault
        args.check_for_nan_in_loss_and_grad = False
    if args.fp16:
        require(args.initial_loss_scale >= args.min_loss_scale > 0,
                f"need --initial-loss-scale {args.initial_loss_scale:g} >= "
                f"--min-loss-scale {args.min_loss_scale:g} > 0")
        require(args.loss_scale_window > 0 and args.hysteresis > 0,
                "--loss-scale-window and --hysteresis must be positive")


def _overlap_args(args):
    # Megatron's rules: the gather exists only with the sharded optimizer, and is overlapped only
    # together with the reduction.
    if args.overlap_param_gather:
        require(args.use_distributed_optimizer, "--overlap-param-gather needs --use-distributed-optimizer")
        require(args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce")
    require(args.num_distributed_optimizer_instances == 1 or args.use_distributed_optimizer,
            "--num-distributed-optimizer-instances needs --use-distributed-optimizer (it shards that optimizer)")


def _pipeline_args(args):
    """Layers per stage and chunk, the Seq1F1B segment lengths, and what the schedule needs."""
    p, L, k = args.pipeline_model_parallel_size, args.num_layers, args.pipe_sp_splits
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    # Megatron's accounting: the embedding and the loss each take one layer's place in the split
    counted = int(args.account_for_embedding_in_pipeline_split) + int(args.account_for_loss_in_pipeline_split)
    require(k == 1 or args.attention_dropout == 0.0, "--attention-dropout must be 0 with --pipe-sp-splits > 1")
    guard(not counted or (first is None and last is None), "--account-for-embedding/loss-in-pipeline-split "
                                                            "and --decoder-first/last-pipeline-num-layers "
                                                            "are two ways to split: give one")
    v = _virtual_chunks(args, p, L, counted)
    if first is None and last is None:
        guard((L + counted) % (p * v) == 0,
              f"--num-layers {L}{f' + {counted} counted' if counted else ''} is not divisible by "
              f"--pipeline-model-parallel-size {p}")
    else:
        _uneven_stages(L, p, v, first, last)
    args.virtual_pipeline_chunks = v
    group = args.microbatch_group_size_per_vp_stage
    guard(group is None or v > 1, "--microbatch-group-size-per-virtual-pipeline-stage needs an interleaved "
                                  "schedule (--num-layers-per-virtual-pipeline-stage)")
    # groups hold whole micro-batches' segments; plan.check refuses a group smaller than the pipeline
    args.pipeline_group_units = group * k if group is not None else None
    # A model of NCCL's queues run on the executor's own issue order (test_nccl_queues.py) finds a
    # hang for groups larger than the pipeline, and none for groups of its size, when the streams
    # share one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1); gloo's sends progress on threads.
    if args.device_type == "cuda" and group is not None:
        guard(group * k <= p, f"--microbatch-group-size-per-virtual-pipeline-stage {group} makes interleaved "
                              f"groups of {group * k} units (x {k} segments), more than the pipeline size {p}: "
                              f"on NCCL that schedule can deadlock, leave the flag out (groups of {p} units)")
    try:
        plan.check(p, args.num_microbatches, k, v, args.pipeline_group_units)
    except plan.ScheduleError as err:
        raise ArgsError(f"{err} (micro-batches = global batch / (micro batch x dp) = "
                        f"{args.num_microbatches})") from None
    granularity = 2 * args.context_parallel_size if args.context_parallel_size > 1 else 1
    if args.sequence_parallel:
        granularity *= args.tensor_model_parallel_size
    args.segment_granularity = granularity
    try:
        args.segment_lengths = partition.partition(args.seq_length, k, args.pipe_sp_strategy, granularity,
                                                   num_parameters(args), L, args.hidden_size)
    except partition.PartitionError as err:
        raise ArgsError(str(err)) from None


def _virtual_chunks(args, p: int, L: int, counted: int) -> int:
    """Model chunks per pipeline rank, from either of Megatron's spellings; the split is of L
    layers plus the `counted` embedding / loss."""
    per, chunks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    guard(per is None or chunks is None, "give one of --num-layers-per-virtual-pipeline-stage and "
                                         "--num-virtual-stages-per-pipeline-rank")
    layers = f"--num-layers {L}{f' + {counted} counted' if counted else ''}"
    if chunks is not None:
        guard(chunks > 0 and (L + counted) % (p * chunks) == 0,
              f"{layers} is not divisible by --pipeline-model-parallel-size {p} x "
              f"--num-virtual-stages-per-pipeline-rank {chunks} = {p * chunks}")
        v = chunks
    elif per is not None:
        guard(per > 0 and (L + counted) % (p * per) == 0,
              f"{layers} is not divisible by --pipeline-model-parallel-size {p} x "
              f"--num-layers-per-virtual-pipeline-stage {per} = {p * per}")
        v = (L + counted) // (p * per)
    else:
        return 1
    guard(p > 1 or v == 1, "an interleaved schedule needs --pipeline-model-parallel-size > 1")
    return v


def _uneven_stages(L, p, v, first, last):
    guard(p > 1 and v == 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1 "
                            "and no virtual pipeline")
    guard(all(n is None or n > 0 for n in (first, last)),
          "--decoder-first/last-pipeline-num-layers must be positive")
    rest, middle = L - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
    guard(rest >= middle and (rest % middle == 0 if middle else rest == 0),
          f"--num-layers {L} less the first/last stages' {(first or 0) + (last or 0)} leaves {rest} for "
          f"{middle} middle stage(s): not an even positive share")


def num_parameters(args) -> int:
    """Parameters of the whole model (Seq1F1B's P in Eq. 8)."""
    h, q = args.hidden_size, args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * args.num_query_groups
    mlp = h * args.ffn_hidden_size * (3 if args.swiglu else 2)
    per_layer = h * (q + 2 * kv) + q * h + mlp
    vocab = args.vocab_size or 0
    return args.num_layers * per_layer + vocab * h * (1 if not args.untie_embeddings_and_output_weights else 2)


def _schedule_args(args):
    """Training length and the LR schedule, both counted in samples as Megatron's scheduler does:
    given in iterations (x global batch) or, with --train-samples, in samples."""
    decay, warmup = _train_iters(args) if args.train_samples is None else _train_samples(args)
    require(args.train_iters > 0, f"--train-iters must be positive, got {args.train_iters}")
    require(args.lr >= args.min_lr >= 0.0, f"need --lr {args.lr} >= --min-lr {args.min_lr} >= 0")
    require(0.0 <= args.lr_warmup_init <= args.lr,
            f"need 0 <= --lr-warmup-init {args.lr_warmup_init} <= --lr {args.lr}")
    if args.decoupled_lr is not None:
        low = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
        require(args.decoupled_lr >= low >= 0.0,
                f"need --decoupled-lr {args.decoupled_lr} >= --decoupled-min-lr (or --min-lr) {low} >= 0")
    require(not (args.lr_warmup_fraction is not None and warmup),
            "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are mutually exclusive")
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    require(warmup < decay, f"warm-up ({warmup:g} samples) must be shorter than the decay ({decay} samples)")
    moving = args.weight_decay_incr_style != "constant"  # Megatron's rule: both ends given, or neither
    require((args.start_weight_decay is not None, args.end_weight_decay is not None) == (moving, moving),
            "--start-weight-decay and --end-weight-decay go together, and only with --weight-decay-incr-style "
            "linear|cosine")
    require(not moving or (args.end_weight_decay or 0) >= (args.start_weight_decay or 0),
            "--end-weight-decay must be >= --start-weight-decay (megatron-core's scheduler only increases it)")
    args.lr_decay_steps, args.lr_warmup_steps = decay, warmup
    require(not (args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler),
            "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler are mutually exclusive")
    require(args.log_interval > 0, "--log-interval must be positive")
    interval = args.log_memory_interval
    require(interval is None or (interval > 0 and interval % max(args.log_interval, 1) == 0),
            f"--log-memory-interval {interval} must be a positive multiple of --log-interval {args.log_interval}")
    require(args.eval_interval is None or args.eval_interval > 0, "--eval-interval must be positive")


def _train_iters(args):
    guard(args.train_iters is not None, "--train-iters or --train-samples is required")
    require(args.lr_decay_samples is None and not args.lr_warmup_samples,
            "--lr-decay-samples and --lr-warmup-samples need --train-samples (with --train-iters: "
            "--lr-decay-iters, --lr-warmup-iters)")
    gbs = args.global_batch_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    return args.lr_decay_iters * gbs, args.lr_warmup_iters * gbs


def train_samples(args) -> int:
    """Megatron's: --train-samples as given (a last partial batch is not trained, but the
    weight-decay ramp and the train split are sized by it), else iterations x global batch."""
    return args.train_samples if args.train_samples is not None else args.train_iters * args.global_batch_size


def _train_samples(args):
    gbs = args.global_batch_size
    require(args.train_iters is None, "--train-iters and --train-samples are mutually exclusive")
    require(args.lr_decay_iters is None and not args.lr_warmup_iters,
            "with --train-samples the schedule is in samples: --lr-decay-samples, --lr-warmup-samples")
    guard(args.train_samples >= gbs, f"--train-samples {args.train_samples} is less than one global batch ({gbs})")
    args.train_iters = args.train_samples // gbs  # a last partial batch is not trained, as in Megatron
    return args.lr_decay_samples or args.train_samples, args.lr_warmup_samples


def _recompute_args(args):
    require(args.cross_entropy_chunk_tokens >= 0,
            f"--cross-entropy-chunk-tokens must be >= 0 (0: whole), got {args.cross_entropy_chunk_tokens}")
    gran, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if gran == "full":
        require(method is not None, "--recompute-granularity full needs --recompute-method uniform|block")
        require(n is not None and 1 <= n <= args.num_layers,
                f"--recompute-num-layers must be in [1, --num-layers {args.num_layers}], got {n}")
    else:
        require(method is None, "--recompute-method needs --recompute-granularity full")


def _rerun_args(args):
    require(args.error_injection_rate >= 0, f"--error-injection-rate must be >= 0, got {args.error_injection_rate}")
    require(args.error_injection_rate == 0 or args.rerun_mode == "validate_results",
            "--error-injection-rate needs --rerun-mode validate_results (nothing reruns otherwise)")


def _profile_args(args, world_size):
    cuda = args.device_type == "cuda"
    if args.profile:
        start, end = args.profile_step_start, args.profile_step_end
        require(0 <= start < end, f"need 0 <= --profile-step-start {start} < --profile-step-end {end}")
        outside = [r for r in args.profile_ranks if not 0 <= r < world_size]
        require(not outside, f"--profile-ranks {outside} outside the {world_size} ranks")
        require(args.use_pytorch_profiler or cuda,
                "--profile without --use-pytorch-profiler starts CUDA's profiler (nsys), which needs CUDA")
    require(not args.record_memory_history or cuda, "--record-memory-history records the CUDA allocator: needs CUDA")


def _checkpoint_args(args):
    require(args.save_interval is None or args.save is not None, "--save-interval needs --save")
    require(args.save_interval is None or args.save_interval > 0, "--save-interval must be positive")
    require(not args.verify_integrity or args.ckpt_format == "torch_dist",
            f"--verify-integrity needs --ckpt-format torch_dist (got {args.ckpt_format})")
    require(not args.async_save or args.ckpt_format == "torch_dist",
            f"--async-save needs --ckpt-format torch_dist (got {args.ckpt_format})")
    for name in ("exit_interval", "exit_duration_in_mins"):
        require(getattr(args, name) is None or getattr(args, name) > 0, f"{flag(name)} must be positive")
    converting = args.ckpt_convert_format is not None
    require(converting == (args.ckpt_convert_save is not None),
            "--ckpt-convert-format and --ckpt-convert-save go together")
    if converting and require(args.load is not None, "--ckpt-convert-format needs --load"):
        # converting nothing would write a random initialisation as "the converted checkpoint"
        require(os.path.isdir(args.load), f"--ckpt-convert-format: no checkpoint directory {args.load}")
        require(os.path.realpath(convert_target(args)) != os.path.realpath(args.load),
                f"--ckpt-convert-save would write the converted checkpoint over --load {args.load}")
    require(args.ckpt_step is None or (args.load is not None and args.ckpt_step >= 0),
            "--ckpt-step needs --load and an iteration >= 0")


def convert_target(args) -> str:
    """Where --ckpt-convert-format writes: the format's directory under --ckpt-convert-save (Megatron's)."""
    return os.path.join(args.ckpt_convert_save, args.ckpt_convert_format)


def _vocab_args(args):
    """Load the tokenizer here, so that a malformed file or one without an end-of-document token is
    one line before any work (not a traceback on every rank), and size the model's table from it."""
    try:
        tokenizer = build_tokenizer(args)
    except Exception as err:  # noqa: BLE001 -- the tokenizers library raises a bare Exception for a bad vocab
        raise ArgsError(f"cannot load the {args.tokenizer_type}: {' '.join(str(err).split())}") from None
    # A model's table may be wider than its tokenizer (Qwen2's 151936 rows for 151665 ids): with a
    # text tokenizer, --vocab-size names the model's rows.
    args.true_vocab_size = max(tokenizer.vocab_size, args.vocab_size or 0)
    if "padded_vocab_size" in getattr(args, "_from_checkpoint", ()):  # the checkpoint's table, when it fits
        tp = args.tensor_model_parallel_size
        require(args.padded_vocab_size >= args.true_vocab_size and args.padded_vocab_size % tp == 0,
                f"the checkpoint's {args.padded_vocab_size} vocabulary rows cannot hold the tokenizer's "
                f"{args.true_vocab_size} ids split over --tensor-model-parallel-size {tp}")
        return
    args.padded_vocab_size = padded_vocab_size(args.true_vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by x tp."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
