"""The checks of MEMO's flags (part of validate_args), and what a saved memory plan records of
the run it was made for."""
from __future__ import annotations

import os

from megatron.training.problems import flag, require


def memo_args(args):
    require(args.memo or args.memo_allocator == "caching", "--memo-allocator planned needs --memo")
    if not args.memo:
        return
    if args.memo_allocator == "planned":
        _planned_allocator_args(args)
    if args.memo_swap_fraction != "auto":
        alpha = _number(args.memo_swap_fraction)
        if require(alpha is not None,
                   f"--memo-swap-fraction must be 'auto' or a number, got {args.memo_swap_fraction!r}"):
            require(0.0 <= alpha <= 1.0, f"--memo-swap-fraction must be in [0, 1], got {alpha}")
    require(args.recompute_granularity is None,
            "--memo replaces activation recompute: drop --recompute-granularity")
    require(args.hidden_dropout == 0.0,
            "--memo needs --hidden-dropout 0: recomputing a subset of tokens cannot redraw the full dropout mask")
    require(not args.sequence_parallel, "--memo does not support --sequence-parallel yet")
    # Transformer Engine's layers save [s*b, h] views: no saved tensor has the tokens first, so
    # MEMO would keep them all on the device (exact, but nothing saved)
    require(args.transformer_impl == "local", "--memo manages the local layers' saved tensors: use "
                                              "--transformer-impl local")
    require(args.memo_host_memory_gb > 0, "--memo-host-memory-gb must be positive")
    kept = min(KEPT_LAYERS, _last_chunk_layers(args))
    require(args.num_layers > kept, f"--memo manages no layer: the model's last chunk keeps its last {kept} "
                                    f"layers' activations (its backward starts at once) and --num-layers "
                                    f"{args.num_layers} leaves none other")


# The model's last chunk keeps the activations of its last layers on the device, unmanaged (see
# memo_setup.wrap_model): their backward follows their forward at once.
KEPT_LAYERS = 2


def _last_chunk_layers(args) -> int:
    """Transformer layers of the model's last chunk, as megatron-core splits them (uneven first /
    last stages; the embedding and the loss each counted as a layer)."""
    L, p, v = args.num_layers, args.pipeline_model_parallel_size, args.virtual_pipeline_chunks
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if last is not None:
        return last
    if first is not None:  # the rest shared evenly by the other stages
        return (L - first) // (p - 1)
    embedding, loss = int(args.account_for_embedding_in_pipeline_split), int(args.account_for_loss_in_pipeline_split)
    return (L + embedding + loss) // (p * v) - loss - (embedding if p * v == 1 else 0)


def _planned_allocator_args(args):
    from megatron.longseq.memo.allocator import build_problem

    require(args.device_type == "cuda", "--memo-allocator planned needs a CUDA device: it replaces torch's CUDA "
                                        "caching allocator (on CPU, plan offline with tools/plan_memory.py)")
    require(not args.record_memory_history,
            "--record-memory-history records torch's caching allocator, which "
            "--memo-allocator planned replaces (a pluggable allocator keeps no history)")
    problem = build_problem()
    require(problem is None, f"--memo-allocator planned: {problem}")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def saved_plan_args(args) -> None:
    """Every pipeline stage's saved plan (one file per stage when pipelined) is there, readable and
    made for this run's sizes (the vocabulary's among them: checked once it is sized)."""
    if not (args.memo and args.memo_plan):
        return
    from megatron.longseq.memo.planner import load_plan_summary, stage_plan_path

    stages = args.pipeline_model_parallel_size
    for stage in range(stages):
        one = stage_plan_path(args.memo_plan, stage, stages)
        if not require(os.path.isfile(one), f"--memo-plan: cannot read {one}"):
            continue
        try:
            mismatch = plan_mismatch(load_plan_summary(one)["planned_for"], args)
        except (ValueError, KeyError, OSError) as err:  # json's decode error is a ValueError
            require(False, f"--memo-plan: {err}")
            continue
        require(mismatch is None, f"--memo-plan: {one} was planned for {mismatch}: plan again for this run")


# The settings a plan's request sizes depend on, recorded in the plan: under other settings a run
# requests other sizes, and the planned allocator would replay a plan that does not fit it.
PLANNED_FOR = ("seq_length", "micro_batch_size", "num_layers", "hidden_size", "ffn_hidden_size",
               "num_attention_heads", "num_query_groups", "kv_channels", "tensor_model_parallel_size",
               "context_parallel_size", "hierarchical_context_parallel_sizes", "pipeline_model_parallel_size",
               "pipe_sp_splits", "pipe_sp_strategy", "bf16", "fp16", "padded_vocab_size", "num_microbatches",
               "swiglu", "untie_embeddings_and_output_weights", "add_bias_linear", "normalization",
               "position_embedding_type")
# Those derived from flags, as a message names them
DERIVED = {"padded_vocab_size": "the padded vocabulary", "num_microbatches": "micro-batches per iteration",
           "add_bias_linear": "bias in linear layers (--disable-bias-linear)"}


def planned_for(args, alpha: float) -> dict:
    """What a saved plan records of the run it was made for (`alpha`: the swap fraction it ran)."""
    return {"memo_swap_fraction": alpha, **{name: getattr(args, name, None) for name in PLANNED_FOR}}


def plan_mismatch(made_for: dict, args) -> str | None:
    """The first setting of the plan this run differs in, as 'flag value (this run: value)'. The
    swap fraction counts only when the run fixes one: under 'auto' the run takes the plan's."""
    if made_for is None or made_for["memo_swap_fraction"] is None:
        return "no run of --memo it records (a trace profiled without --memo, or saved without its run)"
    for name in PLANNED_FOR:
        if made_for.get(name) != getattr(args, name, None):
            return f"{DERIVED.get(name, flag(name))} {made_for.get(name)} (this run: {getattr(args, name, None)})"
    alpha = None if args.memo_swap_fraction == "auto" else _number(args.memo_swap_fraction)
    if alpha is not None and abs(alpha - made_for["memo_swap_fraction"]) > 1e-9:
        return f"--memo-swap-fraction {made_for['memo_swap_fraction']!r} (this run: {alpha})"
    return None
