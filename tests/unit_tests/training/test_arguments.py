"""Command line: Megatron's defaults, derived values, and one-line errors for bad input."""
import os

import pytest
import torch

from megatron.training.arguments import ArgsError, parse_args
from megatron.training.validate import padded_vocab_size, validate_args
from megatron.training.checkpointing import schedule_of
from megatron.training.data import train_valid_test_num_samples
from tools import preprocess_data

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100").split()


def args_for(extra="", world=1, base=BASE):
    return validate_args(parse_args(base + extra.split()), world)


def error_of(extra="", world=1, base=BASE) -> str:
    with pytest.raises(ArgsError) as info:
        args_for(extra, world, base)
    message = str(info.value)
    assert "\n" not in message  # one line
    return message


def test_megatron_defaults():
    args = args_for()
    expected = dict(hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02, weight_decay=0.01,
                    clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, lr_decay_style="linear",
                    min_lr=0.0, make_vocab_size_divisible_by=128, log_interval=100, eval_interval=1000,
                    eval_iters=100, seed=1234, num_workers=2, norm_epsilon=1e-5, rotary_base=10000,
                    rotary_percent=1.0, position_embedding_type="learned_absolute", normalization="LayerNorm",
                    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, add_bias_linear=True,
                    untie_embeddings_and_output_weights=False, timing_log_level=0, attention_backend="auto",
                    split="969, 30, 1", lr_warmup_iters=0, rerun_mode="validate_results", mmap_bin_files=True)
    for key, value in expected.items():
        assert getattr(args, key) == value, key


def test_derived_values():
    args = args_for()
    assert (args.kv_channels, args.ffn_hidden_size, args.num_query_groups) == (16, 256, 4)
    assert args.max_position_embeddings == 128 and args.lr_decay_iters == 10
    assert args.distributed_backend == "gloo" and args.device_type == "cpu"


def test_the_backend_decides_the_device_on_a_gpu_machine(monkeypatch):
    """nccl by default where CUDA is visible; gloo chosen there means a CPU run (gloo cannot
    reduce-scatter or send CUDA tensors)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = args_for()
    assert (on_gpu.distributed_backend, on_gpu.device_type) == ("nccl", "cuda")
    assert args_for("--distributed-backend gloo").device_type == "cpu"
    swiglu = args_for("--swiglu --hidden-size 96 --num-attention-heads 4")
    assert swiglu.ffn_hidden_size == int((4 * 96 * 2 / 3) / 64) * 64  # Megatron's SwiGLU width
    dp = args_for("--tensor-model-parallel-size 2 --global-batch-size 16", world=8)
    assert (dp.data_parallel_size, dp.num_microbatches) == (4, 2)
    assert args_for(world=4).global_batch_size == 8  # default: micro batch x dp


def test_what_the_planned_allocator_cannot_serve_is_refused_on_a_gpu_machine(monkeypatch, tmp_path):
    """A pluggable allocator keeps no history (torch errors at the first snapshot), it is compiled
    at start-up, and MEMO manages the local layers only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MEGATRON_LONGSEQ_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "no-such-compiler")
    planned = "--memo --hidden-dropout 0 --num-layers 4 --memo-allocator planned"
    assert error_of(f"{planned} --record-memory-history --transformer-impl transformer_engine").split("; ")[-3:] == [
        "--record-memory-history records torch's caching allocator, which --memo-allocator planned replaces "
        "(a pluggable allocator keeps no history)",
        "--memo-allocator planned: no C compiler (no-such-compiler) to build arena.c with (set CC)",
        "--memo manages the local layers' saved tensors: use --transformer-impl local"]
    monkeypatch.setenv("CC", "cc")
    assert args_for(planned).memo_allocator == "planned"


def test_interleaved_groups_larger_than_the_pipeline_are_refused_on_nccl(monkeypatch):
    """A model of NCCL's queues finds deadlocks for such groups (see validate.py); gloo runs
    them, and groups of exactly the pipeline size run on both."""
    pipeline = ("--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1 "
                "--attention-dropout 0 --micro-batch-size 1 --global-batch-size 8 ")
    larger = pipeline + "--microbatch-group-size-per-virtual-pipeline-stage 2 --pipe-sp-splits 2"
    assert args_for(larger, world=2).pipeline_group_units == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert error_of(larger, world=2) == (
        "--microbatch-group-size-per-virtual-pipeline-stage 2 makes interleaved groups of 4 units (x 2 segments), "
        "more than the pipeline size 2: on NCCL that schedule can deadlock, leave the flag out (groups of 2 units)")
    exact = args_for(pipeline + "--microbatch-group-size-per-virtual-pipeline-stage 2", world=2)
    assert exact.pipeline_group_units == 2
    assert args_for(pipeline + "--pipe-sp-splits 2", world=2).pipeline_group_units is None


def test_padded_vocab_matches_megatron():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(1001, 128, 2) == 1024


@pytest.mark.parametrize("extra, world, message", [
    ("--no-such-flag 3", 1, "unrecognized arguments: --no-such-flag 3"),
    ("--fp16 --bf16", 1, "--bf16 and --fp16 are mutually exclusive"),
    ("--async-save --ckpt-format torch", 1, "--async-save needs --ckpt-format torch_dist (got torch)"),
    ("--overlap-param-gather", 1, "--overlap-param-gather needs --use-distributed-optimizer"),
    ("--num-distributed-optimizer-instances 2", 2, "--num-distributed-optimizer-instances needs --use-distributed-optimizer"),
    ("--use-distributed-optimizer --num-distributed-optimizer-instances 3", 4,
     "data parallel size 4 is not divisible by the 3 distributed-optimizer instances"),
    ("--num-experts 8", 1, "--num-experts: mixture-of-experts models are outside this project's scope"),
    ("--tensor-model-parallel-size 4 --num-attention-heads 6 --hidden-size 96", 4,
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    ("--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2", 2,
     "number of query groups 1 is not divisible by --tensor-model-parallel-size 2"),
    ("--global-batch-size 6", 2, "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    ("--max-position-embeddings 64", 1, "--seq-length 128 exceeds --max-position-embeddings 64"),
    ("--tensor-model-parallel-size 2", 3, "world size 3 is not divisible by tensor (2)"),
    ("--group-query-attention --num-query-groups 3", 1, "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    ("--hidden-size 66", 1, "--hidden-size 66 is not divisible by --num-attention-heads 4"),
    ("--lr-warmup-iters 2 --lr-warmup-fraction 0.1", 1, "mutually exclusive"),
    ("--lr-warmup-iters 10", 1, "warm-up (20 samples) must be shorter than the decay (20 samples)"),
    ("--recompute-granularity full", 1, "--recompute-granularity full needs --recompute-method"),
    ("--recompute-method uniform", 1, "--recompute-method needs --recompute-granularity full"),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 3", 1,
     "--recompute-num-layers must be in [1, --num-layers 2], got 3"),
    ("--distributed-backend nccl", 1, "--distributed-backend nccl needs CUDA"),
    ("--sequence-parallel --tensor-model-parallel-size 2", 2, "--sequence-parallel needs CUDA"),
    ("--pipeline-model-parallel-size 2 --num-layers 3", 2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 3", 2,
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 2 x --num-layers-per-virtual-pipeline-stage 3 = 6"),
    ("--pipe-sp-splits 200 --attention-dropout 0", 1, "--pipe-sp-splits 200 does not fit --seq-length 128: at most 128 segments"),
    ("--context-parallel-size 2 --pipe-sp-splits 40 --attention-dropout 0", 2,
     "--pipe-sp-splits 40 does not fit --seq-length 128: at most 32 segments of 4 tokens"),
    ("--pipeline-model-parallel-size 4 --num-layers 8 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 6", 4, "3 micro-batches x 1 segments = 3 units in groups of the pipeline size 4: 3 is not divisible by 4"),
    ("--pipeline-model-parallel-size 4 --num-layers 8 --num-layers-per-virtual-pipeline-stage 1 "
     "--global-batch-size 8 --pipe-sp-splits 3 --attention-dropout 0", 4,
     "needs the sequence splits 3 to divide the pipeline size 4"),
    ("--pipe-sp-splits 2 --attention-dropout 0.1", 1, "--attention-dropout must be 0 with --pipe-sp-splits > 1"),
    ("--context-parallel-size 3", 3, "--seq-length 128 is not divisible by 2 x --context-parallel-size 3 = 6"),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 4", 4,
     "--hierarchical-context-parallel-sizes 2 x 4 = 8 differs from --context-parallel-size 4"),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p", 4, "needs --hierarchical-context-parallel-sizes"),
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes -1 -2", 2,
     "--hierarchical-context-parallel-sizes must be >= 1, got -1 -2"),  # their product alone passes
    ("--tensor-model-parallel-size 0", 1, "--tensor-model-parallel-size must be >= 1, got 0"),
    ("--memo --hidden-dropout 0", 1, "--memo manages no layer: the model's last chunk keeps its last 2 layers' "
                                 "activations (its backward starts at once) and --num-layers 2 leaves none other"),
    ("--pipeline-model-parallel-size -1", 1, "--pipeline-model-parallel-size must be >= 1, got -1"),
    ("--context-parallel-size 2 --hierarchical-context-parallel-sizes 1 2", 2,
     "--hierarchical-context-parallel-sizes needs --cp-comm-type a2a+p2p"),
    ("--context-parallel-size 8 --cp-inner-ring-size 3 --seq-length 128", 8, "inner ring size 3 does not divide the ring size 8"),
    ("--context-parallel-size 2 --cp-comm-type a2a --cp-inner-ring-size 2", 2, "--cp-inner-ring-size needs a ring"),
    ("--context-parallel-size 8 --cp-comm-type a2a --num-attention-heads 4", 8,
     "head-parallel size 8: 4 query heads per tensor-parallel rank cannot be split over head-parallel size 8"),
    ("--context-parallel-size 4 --cp-comm-type a2a --group-query-attention --num-query-groups 6 "
     "--num-attention-heads 12 --hidden-size 96", 4,
     "head-parallel size 4: 6 KV heads per tensor-parallel rank and head-parallel size 4: one must divide the other"),
    ("--context-parallel-size 2 --hidden-dropout 0 --attention-dropout 0.1", 2, "--attention-dropout must be 0"),
    ("--selective-checkpoint-pp", 1, "--selective-checkpoint-pp needs --recompute-granularity full"),
    ("--cp-comm-type a2a p2p", 1, "--cp-comm-type takes one value for all layers"),
    ("--save-interval 5", 1, "--save-interval needs --save"),
    ("--ckpt-convert-format torch_dist", 1, "--ckpt-convert-format and --ckpt-convert-save go together"),
    ("--ckpt-convert-format torch --ckpt-convert-save x", 1, "--ckpt-convert-format needs --load"),
    ("--ckpt-format fsdp_dtensor", 1, "--ckpt-format: invalid choice: 'fsdp_dtensor'"),
    ("--verify-integrity --ckpt-format torch", 1, "--verify-integrity needs --ckpt-format torch_dist"),
    ("--position-embedding-type rope --rotary-percent 0.1", 1, "rotary dim = kv channels 16 x --rotary-percent 0.1 = 1"),
    ("--hidden-dropout 1.0", 1, "--hidden-dropout must be in [0, 1)"),
    # each of these used to pass and fail later, most after the process group was up
    ("--group-query-attention --num-query-groups 0", 1, "--num-query-groups must be positive, got 0"),
    ("--kv-channels 0 --ffn-hidden-size -1", 1,
     "--kv-channels must be positive, got 0; --ffn-hidden-size must be positive, got -1"),  # all at once
    ("--position-embedding-type rope --rotary-percent 2", 1, "--rotary-percent must be in (0, 1], got 2.0"),
    ("--start-weight-decay 0.1", 1, "--start-weight-decay and --end-weight-decay go together, and only with"),
    ("--weight-decay-incr-style linear --start-weight-decay 0.1", 1, "--end-weight-decay go together"),
    ("--weight-decay-incr-style cosine --start-weight-decay 0.1 --end-weight-decay 0.05", 1,
     "--end-weight-decay must be >= --start-weight-decay"),
    ("--qk-layernorm --normalization RMSNorm --test-mode", 1,
     "--test-mode compares the q/k norms' biases (megatron-core), which --normalization RMSNorm lacks"),
    # a scaling's settings without its switch would leave plain RoPE in force, silently
    ("--position-embedding-type rope --mscale 0.707", 1, "--mscale changes nothing without --rope-type yarn"),
    ("--position-embedding-type rope --rope-scaling-factor=16", 1,
     "--rope-scaling-factor changes nothing without --use-rope-scaling"),
    ("--position-embedding-type rope --original-max-position-embeddings 64", 1,
     "--original-max-position-embeddings changes nothing without --use-rope-scaling or --rope-type yarn"),
    # the profiler's settings without --profile (or the snapshot's path without the history): nothing runs
    ("--use-pytorch-profiler --profile-step-start 3", 1, "--use-pytorch-profiler changes nothing without --profile"),
    ("--profile-ranks 0", 1, "--profile-ranks changes nothing without --profile"),
    ("--pytorch-profiler-collect-shapes", 1,
     "--pytorch-profiler-collect-shapes changes nothing without --profile --use-pytorch-profiler"),
    ("--memory-snapshot-path x.pickle", 1, "--memory-snapshot-path changes nothing without --record-memory-history"),
    # MEMO's settings without --memo: no plan would be written, no activation swapped
    ("--memo-save-plan p.json --memo-swap-fraction 0.5", 1, "--memo-swap-fraction changes nothing without --memo; "
     "--memo-save-plan changes nothing without --memo"),
    ("--tensorboard-queue-size 0", 1, "--tensorboard-queue-size must be positive, got 0"),
    ("--recompute-granularity full --recompute-method uniform --selective-checkpoint-pp --attention-dropout 0.1", 1,
     "--selective-checkpoint-pp keeps the attention kernel's output and softmax statistics, which "
     "--attention-dropout > 0 (torch's SDPA) does not give"),
    ("--rotary-base 0", 1, "--rotary-base must be positive, got 0"),
    ("--manual-gc --manual-gc-interval -1", 1, "--manual-gc-interval must be >= 0, got -1"),  # % -1 is always 0
    ("--adam-beta1 1.5 --adam-eps -1 --weight-decay -1 --init-method-std -1", 1,
     "--adam-eps must be positive, got -1.0; --init-method-std must be >= 0, got -1.0; --weight-decay must be >= 0, "
     "got -1.0; --adam-beta1 must be in [0, 1), got 1.5"),
    ("--seed -1 --make-vocab-size-divisible-by 0", 1,
     "--make-vocab-size-divisible-by must be positive, got 0; --seed must be >= 0, got -1"),
    ("--distributed-timeout-minutes 0 --tensorboard-log-interval 0", 1,
     "--distributed-timeout-minutes must be positive, got 0; --tensorboard-log-interval must be positive, got 0"),
    ("--tensor-model-parallel-size 2 --ffn-hidden-size 65", 2,
     "--ffn-hidden-size 65 is not divisible by --tensor-model-parallel-size 2"),
    ("--ckpt-convert-format torch --ckpt-convert-save x --load /no/such/checkpoint", 1,
     "--ckpt-convert-format: no checkpoint directory /no/such/checkpoint"),
    ("--data-path /nonexistent/corpus", 1,
     "give exactly one of --mock-data, --passkey-data, --data-path and --train/valid/test-data-path"),
    ("--train-data-path /nonexistent/corpus", 1,
     "give exactly one of --mock-data, --passkey-data, --data-path and --train/valid/test-data-path"),
    ("--memo --hidden-dropout 0 --memo-swap-fraction 1.5", 1, "--memo-swap-fraction must be in [0, 1], got 1.5"),
    ("--memo --hidden-dropout 0 --memo-swap-fraction half", 1, "--memo-swap-fraction must be 'auto' or a number"),
    ("--memo", 1, "--memo needs --hidden-dropout 0"),
    ("--memo --hidden-dropout 0 --recompute-granularity selective", 1, "--memo replaces activation recompute"),
    ("--memo --hidden-dropout 0 --memo-host-memory-gb 0", 1, "--memo-host-memory-gb must be positive"),
    ("--memo --hidden-dropout 0 --num-layers 4 --memo-plan /no/such/plan.json", 1,
     "--memo-plan: cannot read /no/such/plan.json"),
    ("--memo --hidden-dropout 0 --memo-plan /no/plan.json --pipeline-model-parallel-size 2 --num-layers 4", 2,
     "--memo-plan: cannot read /no/plan.stage0.json"),  # pipelined: one plan per stage
    ("--memo-allocator planned", 1, "--memo-allocator planned needs --memo"),
    ("--exit-duration-in-mins 0", 1, "--exit-duration-in-mins must be positive"),
    ("--exit-interval -1", 1, "--exit-interval must be positive"),
    ("--exit-signal-handler --exit-signal SIGKILL", 1, "--exit-signal: invalid choice: 'SIGKILL'"),
    pytest.param("--memo --hidden-dropout 0 --memo-allocator planned", 1, "--memo-allocator planned needs a CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="valid where a CUDA device is visible")),
])
def test_bad_input_is_one_line(extra, world, message):
    assert message in error_of(extra, world)


@pytest.mark.parametrize("missing", ["--num-layers", "--lr", "--micro-batch-size"])
def test_missing_required_flag(missing):
    base, i = list(BASE), BASE.index(missing)
    del base[i : i + 2]
    assert error_of(base=base) == f"{missing} is required"


# Bad flags that share a group of checks (model, parallel layout, precision, schedule, MEMO, data,
# checkpoints), each independent of the others: a user who makes them all hears of them all at once.
INDEPENDENT_PROBLEMS = (
    "--position-embedding-type rope --rotary-percent 0.1", "--max-position-embeddings 64", "--hidden-dropout 1.0",
    "--ffn-hidden-size 65", "--cross-entropy-fusion-impl te", "--selective-checkpoint-pp",
    "--fp16 --loss-scale -1 --hysteresis 0", "--overlap-param-gather",
    "--min-lr 1", "--log-interval 0", "--eval-interval 0",
    "--recompute-method uniform", "--cross-entropy-chunk-tokens -1",
    "--memo --memo-swap-fraction 1.5 --memo-host-memory-gb 0",
    "--num-workers -1", "--save-interval 5", "--exit-interval -1", "--record-memory-history",
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="--record-memory-history is valid there")
def test_every_problem_of_a_command_line_at_once():
    """The command line with all of them reports exactly what each reports alone: none is hidden
    behind another of its group, and none adds a consequence of another."""
    alone = [error_of(f"{extra} --tensor-model-parallel-size 2", world=2).split("; ") for extra in INDEPENDENT_PROBLEMS]
    everything = " ".join(INDEPENDENT_PROBLEMS) + " --tensor-model-parallel-size 2"
    together = error_of(everything, world=2).split("; ")
    assert sorted(together) == sorted(set(sum(alone, [])))
    assert len(together) > len(INDEPENDENT_PROBLEMS)  # some flags above carry several problems
    # without GQA the query groups are the heads: one problem, said once
    assert error_of("--tensor-model-parallel-size 4 --num-attention-heads 6 --hidden-size 96", world=4) == (
        "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4")

def test_training_length_in_iterations_or_samples():
    base, i = list(BASE), BASE.index("--train-iters")
    del base[i : i + 2]
    assert error_of(base=base) == "--train-iters or --train-samples is required"
    args = args_for("--train-samples 100 --global-batch-size 8 --lr-warmup-samples 16 --lr-decay-samples 80",
                    base=base)
    assert (args.train_iters, args.lr_warmup_steps, args.lr_decay_steps) == (12, 16, 80)
    # Megatron sizes the weight-decay ramp and the train split by --train-samples itself (100),
    # though the last partial batch is not trained (12 x 8 = 96)
    assert schedule_of(args)["wd_incr_steps"] == 100 and train_valid_test_num_samples(args)[0] == 100
    iters = args_for("--global-batch-size 8 --lr-warmup-iters 2 --lr-decay-iters 10")
    assert (iters.lr_warmup_steps, iters.lr_decay_steps) == (16, 80)  # Megatron counts samples either way
    assert schedule_of(iters)["wd_incr_steps"] == 80 and train_valid_test_num_samples(iters)[0] == 80
    assert "mutually exclusive" in error_of("--train-samples 100")
    assert "need --train-samples" in error_of("--lr-warmup-samples 16")
    assert error_of("--lr-warmup-init 0.01 --lr 0.001") == "need 0 <= --lr-warmup-init 0.01 <= --lr 0.001"


def test_null_tokenizer_needs_vocab_size():
    base = [a for a in BASE if a not in ("--vocab-size", "100")]
    assert error_of(base=base) == "--tokenizer-type NullTokenizer needs --vocab-size"


def test_unreadable_data_path(tmp_path):
    base = [a for a in BASE if a != "--mock-data"]
    (tmp_path / "corpus.bin").write_bytes(b"")
    message = error_of(f"--data-path {tmp_path}/corpus", base=base)
    assert message == f"--data-path: cannot read {tmp_path}/corpus.idx"
    if os.geteuid() != 0:  # root reads anything
        (tmp_path / "corpus.idx").write_bytes(b"")
        os.chmod(tmp_path / "corpus.idx", 0)
        assert "cannot read" in error_of(f"--data-path {tmp_path}/corpus", base=base)


def test_per_split_corpora_are_checked_before_any_work(tmp_path):
    """Megatron's --train/valid/test-data-path: every corpus readable and not empty, no --split
    (megatron-core asserts on the pair), and a training corpus unless nothing trains."""
    base = [a for a in BASE if a != "--mock-data"]
    (tmp_path / "docs.jsonl").write_text('{"text": "1 2 3"}\n')
    preprocess_data.main(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "a"),
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"])
    (tmp_path / "empty.jsonl").write_text("")
    preprocess_data.main(["--input", str(tmp_path / "empty.jsonl"), "--output-prefix", str(tmp_path / "e"),
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
    good, empty = f"{tmp_path}/a_text_document", f"{tmp_path}/e_text_document"
    args = args_for(f"--train-data-path {good} --valid-data-path 1 {good} 2 {good}", base=base)
    assert args.split is None and args.data_path is None
    assert error_of(f"--train-data-path {good} --split 99,1,0", base=base) == (
        "--split '99,1,0' cuts --data-path, but each split has its own corpus with --train/valid/test-data-path: "
        "drop --split")
    assert error_of(f"--valid-data-path {good}", base=base) == (
        "--valid/test-data-path need --train-data-path (or --skip-train)")
    args_for(f"--valid-data-path {good} --skip-train", base=base)
    assert error_of(f"--train-data-path {good} --test-data-path 0.5 {tmp_path}/x 0.5", base=base) == (
        f"--test-data-path with weights needs pairs 'weight prefix', got ['0.5', '{tmp_path}/x', '0.5']")
    assert error_of(f"--train-data-path {good} --test-data-path {tmp_path}/x", base=base) == (
        f"--test-data-path: cannot read {tmp_path}/x.bin; --test-data-path: cannot read {tmp_path}/x.idx")
    assert error_of(f"--train-data-path {empty}", base=base) == f"--train-data-path: {empty} holds no documents"


def test_a_conversion_writes_under_its_format_and_never_over_its_source(tmp_path):
    """Megatron's --ckpt-convert-save DIR receives DIR/<format>; one that is --load itself is refused
    (the save would replace the iteration it reads)."""
    from megatron.training.validate import convert_target

    (tmp_path / "torch_dist").mkdir()
    args = args_for(f"--load {tmp_path} --ckpt-convert-format torch_dist --ckpt-convert-save {tmp_path}")
    assert convert_target(args) == f"{tmp_path}/torch_dist"
    over = f"--load {tmp_path}/torch_dist --ckpt-convert-format torch_dist --ckpt-convert-save {tmp_path}"
    assert error_of(over) == (
        f"--ckpt-convert-save would write the converted checkpoint over --load {tmp_path}/torch_dist")
    assert error_of("--ckpt-step 3") == "--ckpt-step needs --load and an iteration >= 0"


def test_a_saved_plan_of_another_format_is_refused(tmp_path):
    old = tmp_path / "plan.json"
    old.write_text('{"format": "memo-plan-1", "windows": {}}')
    message = error_of(f"--memo --hidden-dropout 0 --num-layers 4 --memo-plan {old}")
    assert message == f"--memo-plan: {old} is not a MEMO memory plan of this version (memo-plan-4): plan again"
    old.write_text("{")
    assert error_of(f"--memo --hidden-dropout 0 --num-layers 4 --memo-plan {old}").startswith("--memo-plan: Expecting")


def test_tokenizer_files_must_be_local(tmp_path):
    base = BASE[:-4]  # drop the tokenizer flags
    message = error_of(f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/v.json", base=base)
    assert message.startswith("GPT2BPETokenizer needs --vocab-file pointing at a local file")
    message = error_of("--tokenizer-type HuggingFaceTokenizer --tokenizer-model gpt2", base=base)
    assert "must be a local directory" in message
    message = error_of(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}", base=base)
    assert message.startswith(f"--tokenizer-model {tmp_path} holds no tokenizer (tokenizer.json, ")


def test_a_tokenizer_that_cannot_load_is_one_line_before_any_work(tmp_path):
    """Loaded during validation: a malformed vocab.json, or a tokenizer without an end-of-document
    token, used to pass it and then stop every rank with a traceback once the groups were up."""
    base = BASE[:-4]
    (tmp_path / "vocab.json").write_text("{bad")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    message = error_of(f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/vocab.json "
                       f"--merge-file {tmp_path}/merges.txt", base=base)
    assert message.startswith("cannot load the GPT2BPETokenizer: Error while initializing BPE")
    (tmp_path / "vocab.json").write_text('{"a": 0, "b": 1}')
    message = error_of(f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/vocab.json "
                       f"--merge-file {tmp_path}/merges.txt", base=base)
    assert message.endswith("the tokenizer defines no end-of-document token")


def test_the_vocabulary_is_sized_during_validation():
    """Megatron's padding to --make-vocab-size-divisible-by x tp, of the tokenizer's size or a
    wider --vocab-size (a NullTokenizer has one id more: its end-of-document token)."""
    args = args_for("--tensor-model-parallel-size 2", world=2)
    assert (args.true_vocab_size, args.padded_vocab_size) == (101, 256)


def test_a_corrupt_index_is_one_line(tmp_path):
    base = [a for a in BASE if a != "--mock-data"]
    for ext in ("bin", "idx"):
        (tmp_path / f"corpus.{ext}").write_bytes(b"not an index")
    message = error_of(f"--data-path {tmp_path}/corpus", base=base)
    assert message.startswith(f"--data-path: {tmp_path}/corpus.idx/.bin is not an indexed dataset (")


def test_output_directories_are_checked_before_any_work(tmp_path):
    """A --save under a file would fail at the first save, after the training it was to keep."""
    (tmp_path / "file").write_text("")
    args_for(f"--save {tmp_path}/new/ckpt --tensorboard-dir {tmp_path}/tb")  # to be made: fine
    message = error_of(f"--save {tmp_path}/file/ckpt --tensorboard-dir {tmp_path}/file/tb --data-cache-path {tmp_path}")
    assert message == f"cannot create or write --save {tmp_path}/file/ckpt, --tensorboard-dir {tmp_path}/file/tb"


def test_no_op_compatibility_flags_are_accepted():
    args = args_for("--use-mcore-models --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
                    "--attention-softmax-in-fp32 --use-cpu-initialization --no-bias-dropout-fusion")
    assert args.num_layers == 2


def test_context_parallel_layouts():
    ring = args_for("--context-parallel-size 4 --attention-dropout 0", world=8)
    assert (ring.head_parallel_size, ring.ring_size, ring.data_parallel_size) == (1, 4, 2)
    uly = args_for("--context-parallel-size 4 --cp-comm-type a2a --attention-dropout 0", world=4)
    assert (uly.head_parallel_size, uly.ring_size) == (4, 1)
    two_d = args_for("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes "
                     "2 2 --cp-inner-ring-size 1 --attention-dropout 0", world=4)
    assert (two_d.head_parallel_size, two_d.ring_size, two_d.cp_inner_ring_size) == (2, 2, 1)
    # GQA with fewer KV heads than the head-parallel size: legal (KV replication).
    gqa = args_for("--context-parallel-size 4 --cp-comm-type a2a --group-query-attention --num-query-groups 1 "
                   "--attention-dropout 0", world=4)
    assert gqa.head_parallel_size == 4


def test_pipeline_layouts_and_segments():
    args = args_for("--pipeline-model-parallel-size 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2 "
                    "--global-batch-size 8 --pipe-sp-splits 4 --attention-dropout 0", world=4)
    assert (args.virtual_pipeline_chunks, args.num_microbatches, args.segment_lengths) == (2, 2, [32] * 4)
    uc = args_for("--pipe-sp-splits 4 --pipe-sp-strategy uniform_comp --seq-length 2048 "
                  "--max-position-embeddings 2048 --attention-dropout 0")
    assert sum(uc.segment_lengths) == 2048 and uc.segment_lengths[0] > uc.segment_lengths[-1]
    cp = args_for("--context-parallel-size 2 --pipe-sp-splits 3 --attention-dropout 0", world=2)
    assert all(n % 4 == 0 for n in cp.segment_lengths) and sum(cp.segment_lengths) == 128


def test_sequence_parallel_with_one_tp_rank_is_off_as_in_megatron():
    assert args_for("--sequence-parallel").sequence_parallel is False


def test_passkey_depth_is_a_fraction():
    base = [a if a != "--mock-data" else "--passkey-data" for a in BASE]
    assert args_for("--passkey-depth 1", base=base).passkey_depth == 1.0
    assert "--passkey-depth must be in (0, 1], got 1.5" in error_of("--passkey-depth 1.5", base=base)
    for length in (0, -1):  # no key: a loss mask of zeros, a loss of 0 that looks perfect
        assert error_of(f"--passkey-length {length}", base=base) == f"--passkey-length must be >= 1, got {length}"


@pytest.mark.parametrize("rank, printed, waited", [("0", True, False), ("1", False, True)])
def test_bad_input_is_printed_by_rank_0_while_the_others_wait(monkeypatch, capsys, rank, printed, waited):
    """Only rank 0 prints the line; the others hold off their exit so that a launcher tearing the
    job down on the first failure cannot kill rank 0 before it printed."""
    from megatron.training import bad_input

    slept = []
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(bad_input.time, "sleep", slept.append)
    monkeypatch.setattr(bad_input, "_leave_process_group", lambda: None)  # this process's world stays up

    def main():
        raise ArgsError("--lr is required")

    with pytest.raises(SystemExit) as info:
        bad_input.run_main(main)
    assert info.value.code == 2
    assert (capsys.readouterr().err == "pretrain_gpt.py: error: --lr is required\n") == printed
    assert slept == ([bad_input.REPORT_GRACE_S] if waited else [])


def test_a_refusal_after_start_up_leaves_the_process_group_before_exiting(monkeypatch):
    """MEMO's host-budget refusal comes after the process group is up: it is destroyed before the
    exit, not left to interpreter teardown (where a joinable thread of its store once aborted the
    process with status -6 instead of 2)."""
    import torch.distributed as dist

    from megatron.longseq.memo.alpha import HostMemoryError
    from megatron.training import bad_input

    left = []
    monkeypatch.setattr(dist, "is_initialized", lambda: not left)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: left.append(True))

    def main():
        raise HostMemoryError("the plan needs 2 MiB, --memo-host-memory-gb allows 1 MiB")

    with pytest.raises(SystemExit) as info:
        bad_input.run_main(main)
    assert info.value.code == 2 and left == [True]


def test_transformer_engine_layers_need_transformer_engine(monkeypatch):
    """On a GPU without Transformer Engine, megatron-core's TE layer spec fails with a NameError
    after the process groups are up: refused with the rest of the flags instead."""
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine"
                        else real(name, *a))
    message = error_of("--transformer-impl transformer_engine")
    assert "--transformer-impl transformer_engine needs Transformer Engine installed" in message


def test_one_context_parallel_rank_takes_a_sequence_of_any_length():
    """Megatron's rule: 2 x cp chunks only when cp > 1 (33 tokens train on one rank and with
    Seq1F1B segments of 17 and 16; cp 2 still needs a multiple of 4)."""
    assert args_for("--seq-length 33 --max-position-embeddings 64").seq_length == 33
    assert args_for("--seq-length 33 --max-position-embeddings 64 --pipeline-model-parallel-size 2 "
                    "--num-layers 4 --pipe-sp-splits 2 --attention-dropout 0", 2).segment_lengths == [17, 16]
    assert "--seq-length 34 is not divisible by 2 x --context-parallel-size 2 = 4" in error_of(
        "--seq-length 34 --max-position-embeddings 64 --context-parallel-size 2", 2)


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
               "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")
BATCH_SCRIPT = {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}  # sbatch's own shell


def _launched(monkeypatch, env):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)


@pytest.mark.parametrize("env, world", [
    ({"SLURM_NTASKS": "4"}, 1),  # a plain python inside an allocation
    (BATCH_SCRIPT, 1),  # ... in the batch script itself: rank 0 of 4 before, waiting for 3 that never came
    ({**BATCH_SCRIPT, "SLURM_PROCID": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"}, 8),  # an srun task
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_STEP_ID": "0"}, 4),  # srun without the step's count
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, 2)])  # torchrun (under srun)
def test_validation_counts_the_ranks_start_up_will_have(monkeypatch, env, world):
    """Validation's world (batch arithmetic, the grid) is the one the process group is made with."""
    from megatron.training.validate import world_size_from_env

    _launched(monkeypatch, env)
    assert world_size_from_env() == world


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "WORLD_SIZE unset: RANK and WORLD_SIZE come together (start with torchrun, or set both)"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "this process's rank 1 is outside a world of 1 (from torchrun's variables)"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "the environment's RANK='x' is not a whole number"),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, "SLURM_NTASKS unset: an srun task has SLURM_PROCID and SLURM_NTASKS"),
])
def test_inconsistent_launch_variables_are_one_line_not_a_hang(monkeypatch, env, message):
    """RANK 1 of 1 waited for a store no rank hosts, silently, until the timeout."""
    from megatron.training.validate import world_size_from_env

    _launched(monkeypatch, env)
    with pytest.raises(ArgsError) as refused:
        world_size_from_env()
    assert message in str(refused.value)


@pytest.mark.parametrize("nodes, first", [("gpu[07-09,12]-ib,cpu3", "gpu07-ib"), ("a1,b2", "a1"), ("n5", "n5"),
                                          ("rack[2-3]-node[001-004]", "rack2-node001"), ("x[4,1-2]", "x4")])
def test_the_first_host_of_a_slurm_node_list(nodes, first):
    from megatron.training.initialize import first_host

    assert first_host(nodes) == first


def test_srun_tasks_find_the_rendezvous_from_slurms_variables(monkeypatch):
    """srun python pretrain_gpt.py with nothing exported: the step's first host, a port from the
    job id; what the script exports wins; without either, one line."""
    from megatron.training import initialize
    from megatron.training.arguments import ArgsError

    for var in ("MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID"):
        monkeypatch.setenv(var, "")  # recorded, so that what _rendezvous sets is undone after the test
        monkeypatch.delenv(var)
    srun = initialize.LaunchEnv(1, 2, 1, "srun")
    with pytest.raises(ArgsError, match="MASTER_ADDR and MASTER_PORT unset: 2 ranks need"):
        initialize._rendezvous(srun)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[03-04]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    initialize._rendezvous(srun)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node03", str(10000 + 123456 % 20000))
    monkeypatch.setenv("MASTER_PORT", "29500")
    initialize._rendezvous(srun)
    assert os.environ["MASTER_PORT"] == "29500"
