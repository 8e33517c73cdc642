"""Megatron-LM users' command lines: every flag of Megatron's own GPT functional-test configs
(vendored as flag lists, tests/functional_tests/megatron_configs) is known here -- implemented,
accepted as changing nothing (with the reason in --help), or refused with its reason -- and every
bad flag of a command line is reported at once, in one line."""
import gc
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron.training import training
from megatron.training.arguments import ArgsError, NO_OP, OUT_OF_SCOPE, UNSUPPORTED, _out_of_scope, build_parser, parse

CONFIGS = Path(__file__).resolve().parents[2] / "functional_tests" / "megatron_configs" / "gpt_training_flags.json"


def _configs():
    return json.loads(CONFIGS.read_text())["configs"]


def _local(flags):
    """${VARS} of Megatron's CI replaced by a local path (the values are not read by the parser);
    ${REPEAT}, the CI's repetition number (--seed), by 1."""
    return ["1" if f == "${REPEAT}" else "/tmp/x" if "${" in f or f.startswith("$") else f for f in flags]


def test_every_flag_of_megatrons_gpt_configs_is_known():
    configs = _configs()
    assert len(configs) >= 150
    unknown = {}
    for name, flags in configs.items():
        _, errors = parse(_local(flags))
        for e in errors:
            if e.startswith("unrecognized arguments"):
                unknown[name] = e
    assert not unknown, unknown


def test_refusals_name_their_reason_and_come_together():
    """A command line with several bad flags: all of them, each with its reason, in one line."""
    _, errors = parse(["--tp-comm-overlap", "--moe-router-topk", "2", "--no-such-flag", "3", "--cp-comm-type", "zzz",
                       "--wandb-project", "p", "--squared-relu"])
    assert errors[0].startswith("--cp-comm-type: invalid choice: 'zzz'")
    assert set(errors[1:]) == {
        "--tp-comm-overlap: " + UNSUPPORTED["--tp-comm-overlap"], "--squared-relu: " + UNSUPPORTED["--squared-relu"],
        "--moe-router-topk: mixture-of-experts models are outside this project's scope",
        "--wandb-project: Weights & Biases logging is not implemented (use --tensorboard-dir)",
        "unrecognized arguments: --no-such-flag 3"}


def test_parse_and_validate_reports_parser_and_validation_problems_in_one_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 "
            "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100 --no-such-flag "
            "--hidden-dropout 1.0 --rerun-mode disabled --error-injection-rate 3").split()
    with pytest.raises(ArgsError) as info:
        training.parse_and_validate(argv)
    parts = str(info.value).split("; ")
    assert parts[0] == "unrecognized arguments: --no-such-flag"
    assert "--hidden-dropout must be in [0, 1)" in parts
    assert "--train-iters or --train-samples is required" in parts
    assert "--error-injection-rate needs --rerun-mode validate_results (nothing reruns otherwise)" in parts
    assert "\n" not in str(info.value)


def test_a_refusal_is_one_part_of_the_line():
    """Problems are joined with "; ", so a reason holding one would read as two problems."""
    reasons = list(UNSUPPORTED.values()) + list(OUT_OF_SCOPE.values())
    assert not [r for r in reasons if "; " in r]


def test_help_says_why_a_no_op_flag_changes_nothing():
    text = " ".join(build_parser().format_help().split())  # argparse wraps lines: compare words
    for flag, reason in NO_OP.items():
        assert f"{flag} no effect: {reason}" in text


def test_manual_gc_collects_only_at_its_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    args = SimpleNamespace(manual_gc=True, manual_gc_interval=3)
    for iteration in range(1, 10):
        training._collect_garbage(args, iteration)
    assert len(calls) == 3
    args.manual_gc = False
    training._collect_garbage(args, 3)
    assert len(calls) == 3


# ---- Megatron's configs, scaled to CPU ---------------------------------------------------------
# What a CPU run changes, with the reason. Everything else in a config is taken as given.
ENVIRONMENT = {  # Megatron's CI machines, not the training: replaced by what this machine has
    "--data-path": "Megatron's CI corpus -> --mock-data",
    "--split": "belongs to the CI corpus",
    "--data-cache-path": "belongs to the CI corpus",
    "--vocab-file": "Megatron's CI GPT-2 vocabulary -> a tiny local one",
    "--merge-file": "Megatron's CI GPT-2 merges -> a tiny local one",
}
GPU_ONLY = {  # values that need a GPU, with what the CPU run uses instead
    "--distributed-backend": "nccl -> gloo",
    "--transformer-impl": "transformer_engine -> local (Transformer Engine needs CUDA)",
    "--attention-backend": "GPU kernels -> auto",
    "--sequence-parallel": "removed: megatron-core 0.16's sequence-parallel collectives allocate on the GPU",
}
TAKES_VALUE = {"--data-path", "--split", "--data-cache-path", "--vocab-file", "--merge-file",
               "--distributed-backend", "--transformer-impl", "--attention-backend"}
# Accepted among the configs within this project's scope when last measured (2026-11-23, 132 of
# 138, 95.7%; 23 more use out-of-scope families): it may only go up.
ACCEPTED_AT_LEAST = 132


def _words(flags):
    """Shell word splitting, as Megatron's launcher does to a value such as "2 2"."""
    return [w for f in flags for w in (f.split() if " " in f and not f.startswith("{") else [f])]


def scaled_to_cpu(flags, vocab_dir):
    flags, out, skip = _words(_local(flags)), [], 0
    for f in flags:
        if skip:
            skip -= 1
            continue
        if f in ENVIRONMENT or f in GPU_ONLY:
            skip = 1 if f in TAKES_VALUE else 0
            continue
        out.append(f)
    return out + ["--mock-data", "--distributed-backend", "gloo", "--transformer-impl", "local",
                  "--vocab-file", str(vocab_dir / "vocab.json"), "--merge-file", str(vocab_dir / "merges.txt")]


def _world(args):
    # dp x cp must hold the distributed-optimizer instances: one data-parallel rank per instance
    return (args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
            * args.num_distributed_optimizer_instances)


def test_megatrons_configs_scaled_to_cpu_are_accepted_or_refused_with_reasons(tmp_path, monkeypatch):
    """Every training config of Megatron-LM's GPT functional tests, with its CI environment and
    its GPU-only values replaced (ENVIRONMENT, GPU_ONLY), through parsing and validation on the
    smallest world its layout needs. Each one is accepted, or refused in one line whose every part
    names a flag and its reason; the accepted count may only grow."""
    from megatron.training.validate import validate_args

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "vocab.json").write_text('{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    accepted, refused = [], {}
    for name, flags in _configs().items():
        args, errors = parse(scaled_to_cpu(flags, tmp_path))
        if not errors:
            try:
                validate_args(args, _world(args))
                accepted.append(name)
                continue
            except ArgsError as err:
                errors = [str(err)]
        refused[name] = errors
    for name, errors in refused.items():  # one line, led by a flag and its reason
        line = "; ".join(errors)
        assert "\n" not in line and line.startswith("--"), (name, line)
    outside = {name for name, errors in refused.items()
               if any(_out_of_scope(e.split(":")[0]) for e in "; ".join(errors).split("; "))}
    within = len(accepted) + len(refused) - len(outside)
    print(f"\n{len(accepted)} of {within} Megatron GPT configs within scope accepted on CPU "
          f"({100 * len(accepted) / within:.1f}%); {len(outside)} use out-of-scope families")
    assert len(accepted) >= ACCEPTED_AT_LEAST, sorted(set(refused) - outside)


def _chunk_layers(flags, world):
    from megatron.training.model import chunk_layers, transformer_config

    args = training.validate_args(parse(flags.split())[0], world)
    config = transformer_config(args)
    p, v = args.pipeline_model_parallel_size, args.virtual_pipeline_chunks
    return [[chunk_layers(config, stage, c) for c in range(v)] for stage in range(p)]


def test_pipeline_splits_as_megatrons():
    """Uneven first / last stages, and the embedding and loss counted as layers (their chunks
    build one transformer layer fewer), split as megatron-core does; bad splits are one line."""
    base = ("--hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 "
            "--global-batch-size 8 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 100 ")
    assert _chunk_layers(base + "--num-layers 10 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
                         "--decoder-last-pipeline-num-layers 3", 4) == [[1], [3], [3], [3]]
    assert _chunk_layers(base + "--num-layers 8 --pipeline-model-parallel-size 3 "
                         "--decoder-last-pipeline-num-layers 2", 3) == [[3], [3], [2]]
    assert _chunk_layers(base + "--num-layers 6 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
                         "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 4) == \
        [[0, 1], [1, 1], [1, 1], [1, 0]]  # Megatron's functional config: 6 layers + 2 over 8 chunks
    assert _chunk_layers(base + "--num-layers 7 --pipeline-model-parallel-size 2 "
                         "--account-for-embedding-in-pipeline-split", 2) == [[3], [4]]
    with pytest.raises(ArgsError, match="leaves 7 for 2 middle stage"):
        _chunk_layers(base + "--num-layers 10 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
                      "--decoder-last-pipeline-num-layers 2", 4)
    with pytest.raises(ArgsError, match=r"--num-layers 7 \+ 2 counted is not divisible"):
        _chunk_layers(base + "--num-layers 7 --pipeline-model-parallel-size 2 "
                      "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 2)
    with pytest.raises(ArgsError, match=r"--num-layers 6 \+ 1 counted is not divisible by "
                                        r"--pipeline-model-parallel-size 2 x --num-virtual-stages-per-pipeline-rank 2"):
        _chunk_layers(base + "--num-layers 6 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                      "--account-for-loss-in-pipeline-split", 2)
    with pytest.raises(ArgsError, match="groups of 0 units must be at least the pipeline size 2"):
        _chunk_layers(base + "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                      "--microbatch-group-size-per-virtual-pipeline-stage 0", 2)
    with pytest.raises(ArgsError, match="give one of"):
        _chunk_layers(base + "--num-layers 8 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                      "--num-layers-per-virtual-pipeline-stage 2", 2)
    with pytest.raises(ArgsError, match="two ways to split: give one"):
        _chunk_layers(base + "--num-layers 8 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 "
                      "--account-for-loss-in-pipeline-split", 2)


def test_validation_and_test_lines_use_megatrons_words_and_tensorboard_names(monkeypatch, capsys):
    """During training "validation loss at iteration N", after it "... on validation set" and
    "... on test set"; tensorboard's name is "lm loss validation" for both, as Megatron's."""
    logged = []
    tb = SimpleNamespace(scalars=lambda values, iteration, samples=None: logged.append((dict(values), iteration)))
    monkeypatch.setattr(training, "evaluate", lambda *a, **k: {"lm loss": 2.0})
    monkeypatch.setattr(training, "print_rank_last", print)
    state = SimpleNamespace(iteration=7, consumed_valid_samples=0, consumed_train_samples=56)
    args = SimpleNamespace(manual_gc=False, eval_iters=1, global_batch_size=8, log_validation_ppl_to_tensorboard=False)
    training.evaluate_and_print("validation", None, None, state, args, None, tb, True)
    training.evaluate_and_print("test", None, None, state, args, None, tb, False)
    out = capsys.readouterr().out
    line = " validation loss at iteration 7 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert out.startswith(f"{'-' * (len(line) + 1)}\n{line}\n{'-' * (len(line) + 1)}\n")  # Megatron's, byte for byte
    assert " validation loss at iteration 7 on test set | lm loss value:" in out
    assert logged == [({"lm loss validation": 2.0}, 7)] * 2
    assert state.consumed_valid_samples == 8  # only the in-training evaluation counts its samples


def test_help_explains_every_flag_and_shows_its_default():
    parser = build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options and all(a.help for a in options), [a.option_strings[0] for a in options if not a.help]
    text = " ".join(parser.format_help().split())
    assert "--num-layers NUM_LAYERS transformer layers (default: None)" in text
    assert "--ckpt-format {torch,torch_dist}" in text and "(default: torch_dist)" in text
    # a switch's default reads as the opposite of what it does; a help that names its default says it once
    assert "--no-check-for-nan-in-loss-and-grad do not stop on a NaN/Inf loss" in text
    assert "(default: True)" not in text and "a plain ring) (default:" not in text


@pytest.mark.parametrize("style, halfway", [("linear", 0.05), ("cosine", 0.05), ("constant", 0.01)])
def test_weight_decay_moves_from_its_start_to_its_end_over_training(style, halfway):
    """Megatron's --weight-decay-incr-style with --start/--end-weight-decay: megatron-core's scheduler
    sets each group's weight decay (times its wd_mult: norms and biases stay at 0) every step."""
    from megatron.training.training import setup
    from tests.unit_tests.dist_utils import grid_groups, init_single_rank_world
    from tests.unit_tests.model_utils import tiny_args, tiny_gpt

    init_single_rank_world()
    ends = "" if style == "constant" else "--start-weight-decay 0 --end-weight-decay 0.1"
    args = tiny_args(f"--weight-decay-incr-style {style} {ends}")  # 10 iterations, --weight-decay 0.01

    state = setup(args, grid_groups(), lambda a, p, d: tiny_gpt(a, p))
    state.scheduler.step(args.global_batch_size * 5)  # half way: linear and cosine both give the mean
    decays = sorted(g["weight_decay"] for g in state.optimizer.param_groups)
    assert decays == pytest.approx([0.0, halfway])
