"""Plan MEMO's memory offline and draw the plan: of a saved trace (--trace), or of a model profiled
here, given by pretrain_gpt.py's model flags after `--` (this tool's own flags go before it).

    # profile a model (pretrain_gpt.py's model flags, one rank; on the GPU where there is one) and plan it
    python tools/plan_memory.py --out plan.json --png plan.png --planner cpsat -- \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 1024 \\
        --hidden-dropout 0 --memo --memo-swap-fraction 0.5
    (flags only training needs default to one step of mock data: see TRAINING_DEFAULTS; the
    profile is one iteration as the trainer runs it: every micro-batch, every Seq1F1B segment)
    # or plan a saved trace
    python tools/plan_memory.py --trace trace.json --out plan.json --png plan.png

The plan file is what pretrain_gpt.py --memo-plan reuses.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron.longseq  # noqa: E402,F401  (quiet megatron-core's import-time warnings first)
from megatron.longseq.memo.planner import bilevel_plan, draw  # noqa: E402
from megatron.longseq.memo.trace import Trace  # noqa: E402
from tools import cli  # noqa: E402


# What pretrain_gpt.py requires but a memory plan does not depend on, when the flags leave it out.
TRAINING_DEFAULTS = {"--micro-batch-size": ["1"], "--train-iters": ["1"], "--lr": ["1e-4"]}
DATA_FLAGS = ("--mock-data", "--data-path", "--passkey-data")


def with_training_defaults(flags):
    flags = list(flags)
    for flag, value in TRAINING_DEFAULTS.items():
        if flag not in flags:
            flags += [flag] + value
    if not any(f in flags for f in DATA_FLAGS):
        flags.append("--mock-data")
    if "--tokenizer-type" not in flags:
        flags += ["--tokenizer-type", "NullTokenizer"] + ([] if "--vocab-size" in flags else ["--vocab-size", "1000"])
    return flags


def profile_model(model_flags, save_trace=None) -> Trace:
    """One iteration of the model on one rank under the allocation tracer (CPU) or torch's
    allocator history (on a GPU machine, unless the flags say --distributed-backend gloo): the
    trace is of the device the plan is for."""
    import pretrain_gpt
    from megatron.training.initialize import device_of, initialize_distributed
    from megatron.training.training import parse_and_validate, setup

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    args = parse_and_validate(with_training_defaults(model_flags))  # sizes the vocabulary as the trainer
    pgs = initialize_distributed(args)
    trace = profile_state(setup(args, pgs, pretrain_gpt.model_provider), args, pgs, device_of(args))
    if save_trace:
        trace.save(save_trace)
    return trace


def profile_state(state, args, pgs, device) -> Trace:
    """The trace of one iteration of the set-up run `state` as the trainer profiles it: its
    micro-batches and Seq1F1B segments, MEMO's layers and alpha, on `device`."""
    import pretrain_gpt
    from megatron.longseq.memo.profiler import trace_iteration
    from megatron.training.memo_setup import choose_alpha, profile_iteration, wrap_model
    from megatron.training.model import unwrap
    from megatron.training.validate_memo import planned_for

    layers = [layer for chunk in unwrap(state.model) for layer in chunk.decoder.layers]
    iteration = profile_iteration(args, pgs, state, pretrain_gpt.forward_step)
    if args.memo:  # as the trainer: the last two layers keep their activations and get no window;
        memo, layers = wrap_model(state, 1.0, device)  # a measured iteration gives alpha and the buffers
        choose_alpha(args, memo, iteration, layers, device)
    trace = trace_iteration(iteration, layers, device)
    trace.planned_for = planned_for(args, memo.alpha) if args.memo else None
    return trace


def arguments(argv):
    """(parser, this tool's flags, the model flags after --)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = cli.parser(__doc__, usage="%(prog)s [options] (--trace PATH | -- PRETRAIN_GPT_MODEL_FLAGS ...)")
    ap.add_argument("--trace", help="plan this saved trace instead of profiling the model flags after --")
    ap.add_argument("--save-trace", type=cli.output_file, help="write the profiled trace here")
    ap.add_argument("--planner", choices=["gurobi", "cpsat", "greedy"], default="gurobi", help="the solver")
    ap.add_argument("--time-limit", type=cli.positive_float, default=30.0, help="seconds per solver call")
    ap.add_argument("--out", type=cli.output_file, help="plan JSON (what pretrain_gpt.py --memo-plan reads)")
    ap.add_argument("--png", type=cli.image_path, help="drawing of the plan")
    args = ap.parse_args(argv[:cut])
    model_flags = argv[cut + 1:]
    if args.out and model_flags and "--memo" not in model_flags:
        ap.error("--out writes a plan for pretrain_gpt.py --memo-plan, which needs --memo: add it to the model flags")
    if bool(args.trace) == bool(model_flags):
        ap.error("give --trace PATH or pretrain_gpt.py model flags after --" +
                 (", not both" if model_flags else ""))
    if args.trace and args.save_trace:
        ap.error("--save-trace writes a profiled trace: --trace reads one, there is none to write")
    return ap, args, model_flags


def load_trace(path: str) -> Trace:
    """The saved trace at `path`; a missing, unreadable or malformed file is the tool's one line."""
    try:
        trace = Trace.load(path)
        trace.windows()  # the layer windows the planner reads: a mangled event list shows here
        return trace
    except OSError as err:
        raise cli.ToolError(f"--trace {path}: cannot read it: {err.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # JSON's errors are ValueErrors
        said = str(err) if "not a memo trace file" in str(err) else \
            f"{path} is not a memo trace file ({type(err).__name__}: {err})"
        raise cli.ToolError(f"--trace {said}") from None


def main(argv=None):
    ap, args, model_flags = arguments(argv)
    from megatron.training.arguments import ArgsError

    try:
        trace = load_trace(args.trace) if args.trace else profile_model(model_flags, args.save_trace)
    except (ArgsError, cli.ToolError) as err:  # the model flags after --, in pretrain_gpt.py's one line
        ap.error(f"model flags: {err}" if isinstance(err, ArgsError) else str(err))
    plan = bilevel_plan(trace, args.planner, args.time_limit)
    s = plan.summary()
    made_for = trace.planned_for or {}
    print(f"{len(trace.events)} events, {len(trace.windows())} layer windows, swap fraction "
          f"{made_for.get('memo_swap_fraction')}")
    for label, level1 in s["level1"].items():
        if level1["reuses"]:
            print(f"level 1 {label}: same requests as {level1['reuses']}, its plan reused")
            continue
        print(f"level 1 {label}: {level1['solver']} peak {level1['peak']} B, bound {level1['lower_bound']} B, "
              f"optimal {level1['optimal']}, {level1['seconds']} s {'; '.join(level1['notes'])}")
    l2 = s["level2"]
    print(f"level 2: {l2['solver']} peak {l2['peak']} B, bound {l2['lower_bound']} B, optimal {l2['optimal']}, "
          f"{l2['seconds']} s {'; '.join(l2['notes'])}")
    print(f"plan: peak {plan.peak} B, lower bound {plan.lower_bound} B (+{100 * s['gap']:.2f}%)")
    if args.out:
        plan.save(args.out, trace.planned_for)
    if args.png:
        draw(trace, plan, args.png)


if __name__ == "__main__":
    sys.exit(cli.run(main))
