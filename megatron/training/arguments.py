"""Megatron's command line: same spellings, same defaults, plus the long-sequence flags.

A flag that Megatron has and we do not implement is still known here, so that using it fails with a
one-line reason rather than argparse's generic "unrecognized arguments" (which also stays one line).
Deliberate deviations from Megatron's defaults are listed in README.md ("Flags").
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from megatron.training.flag_help import HELP
from megatron.training.flag_policy import NEEDS_SWITCH, NO_OP, OUT_OF_SCOPE, STRICTNESS, UNSUPPORTED


class ArgsError(ValueError):
    """Bad command line; reported as one line before any process group exists."""


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, but for a switch (--no-x's default of True reads as the
    opposite of what it does) and for a help that states its default itself."""

    def _get_help_string(self, action):
        if action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; we want the one line only
        raise ArgsError(message)


def _model(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rotate channel pairs (2j, 2j+1) instead of (j, j + rot/2)")
    _rope_scaling(p)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the query, key and value projections even with --disable-bias-linear (Qwen2)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights hold gamma - 1 (initialised to 0); the norm scales by 1 + weight")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise queries and keys over the head dimension before attention")
    g.add_argument("--test-mode", action="store_true",
                   help="megatron-core's real-time check: with --qk-layernorm, the q/k norm weights must agree "
                        "on every tp and dp rank at each forward")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-size", type=int)


def _parallel(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved schedule: layers per model chunk")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="interleaved schedule: model chunks per pipeline rank (instead of "
                        "--num-layers-per-virtual-pipeline-stage)")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="interleaved schedule: micro-batches each chunk runs before the next chunk takes them "
                        "(default: the pipeline size); at least the pipeline size")
    g.add_argument("--pipe-sp-splits", type=int, default=1,
                   help="Seq1F1B: sequence segments per micro-batch (1 = 1F1B)")
    g.add_argument("--pipe-sp-strategy", choices=["average", "uniform_comp"], default="average",
                   help="Seq1F1B segment lengths: equal, or equal FLOPs (Seq1F1B Eq. 7-8); with "
                        "--reset-attention-mask uniform_comp cuts each micro-batch by its packed documents' "
                        "FLOPs, no segment longer than the one-document partition's longest")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", nargs="+", choices=["p2p", "a2a", "a2a+p2p"], default=["p2p"],
                   help="p2p: ring attention; a2a: Ulysses; a2a+p2p: 2D attention (one value: all layers)")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                   help="a2a+p2p: head-parallel size and ring size, product = context parallel size")
    g.add_argument("--cp-inner-ring-size", type=int, default=None,
                   help="Double-Ring-Attention inner ring size (default: the ring size, a plain ring)")
    g.add_argument("--cp-placement", choices=["head-first", "context-first"], default="head-first",
                   help="which group sits on adjacent ranks (LoongTrain 4.4)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="with --use-distributed-optimizer: shard the optimizer inside N groups of consecutive "
                        "data-parallel ranks, all-reducing each shard's gradients across the groups")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="the embedding counts as one layer of the first (virtual) stage in the even split")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="the output layer and loss count as one layer of the last (virtual) stage in the even split")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (default: an even share)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (default: an even share)")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations, check that every data-parallel replica holds the same weights")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average the gradients inside the data-parallel reduction (NCCL's AVG; on gloo the sum "
                        "is divided on arrival) instead of dividing them before it")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="rank order tp, cp, pp, dp (pipeline stages on nearer ranks) instead of tp, cp, dp, pp")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: gather the updated parameters in the background, "
                        "each module's forward waiting only for its own")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: one bucket per 40M elements)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, else gloo; gloo runs on the CPU even where "
                   "CUDA is visible")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--local-rank", type=int, default=None, help="ignored; LOCAL_RANK is read")


def _data(p):
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--passkey-data", action="store_true",
                   help="synthetic passkey retrieval: a key planted early, asked at the end (long-range)")
    g.add_argument("--passkey-length", type=int, default=1, help="key tokens per passkey sample")
    g.add_argument("--passkey-depth", type=float, default=0.25,
                   help="the key lies in this first fraction of the sequence (1: anywhere before the query)")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default=None,
                   help="train, valid, test weights of --data-path (default: 969, 30, 1, Megatron's)")
    for name in ("train", "valid", "test"):
        g.add_argument(f"--{name}-data-path", nargs="*", default=None,
                       help=f"the {name} split's own corpus ('prefix ...' or 'weight prefix ...'), "
                            "instead of --data-path")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--tokenizer-type", choices=["NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"],
                   default="GPT2BPETokenizer")
    g.add_argument("--tokenizer-model", type=str)
    g.add_argument("--vocab-file", type=str)
    g.add_argument("--merge-file", type=str)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin files with plain reads instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="accepted, changes nothing: the dataloader never builds a dense attention mask "
                        "(document masks are found from the EOD tokens and attended piece by piece)")


def _training(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--train-samples", type=int,
                   help="train for this many samples instead of --train-iters (iterations = samples / global batch)")
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the embedding and output layer (default: --lr)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of the embedding and output layer (default: --min-lr)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear")
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-samples", type=int, help="with --train-samples: decay over this many samples")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples: warm up over this many samples")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="with --weight-decay-incr-style linear|cosine: the weight decay at the start")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="with --weight-decay-incr-style linear|cosine: the weight decay at the end of training")
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant",
                   help="how the weight decay moves from its start to its end value over training")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 model, fp32 main params, loss scaling (an overflowing step is skipped)")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="--fp16: a fixed loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="--fp16: the dynamic scale's start")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="--fp16: the dynamic scale's floor")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="--fp16: clean steps in a row before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16: overflows tolerated before the dynamic scale halves")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad")
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--memo", action="store_true",
                   help="MEMO: offload layer inputs and attention outputs, swap alpha of the other "
                        "activations' tokens to host memory and recompute the rest token-wise")
    g.add_argument("--memo-swap-fraction", default="auto", help="alpha: 'auto' (MEMO's LP) or a number in [0, 1]")
    g.add_argument("--memo-planner", choices=["gurobi", "cpsat", "greedy"], default="gurobi")
    g.add_argument("--memo-plan", default=None, help="reuse a saved memory plan (JSON; pipelined: plan.stageN.json)")
    g.add_argument("--memo-save-plan", default=None, help="write the memory plan (JSON; pipelined: plan.stageN.json)")
    g.add_argument("--memo-allocator", choices=["caching", "planned"], default="caching",
                   help="planned: replace torch's CUDA caching allocator with one that places each layer's "
                        "transient tensors at the memory plan's offsets (CUDA only)")
    g.add_argument("--memo-host-memory-gb", type=float, default=64.0,
                   help="pinned host memory MEMO may use per rank")
    g.add_argument("--selective-checkpoint-pp", action="store_true",
                   help="with --recompute-granularity full, keep attention (out, lse) instead of "
                        "recomputing it (LoongTrain's Selective Checkpoint++)")
    g.add_argument("--cross-entropy-chunk-tokens", type=int, default=0,
                   help="compute the output layer and the loss this many tokens at a time, so that the logits "
                        "(tokens x vocabulary, in the model's dtype and again in fp32) never exist whole; the "
                        "backward recomputes each chunk's logits (one more output-layer GEMM per token). "
                        "0: all tokens at once (Megatron's)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    g.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"], default="auto",
                   help="the local attention kernel (under every context-parallel mode). CPU: torch's CPU "
                        "flash kernel, or the fp32 reference for unfused/local. GPU, fp16/bf16: auto = on "
                        "Hopper/Blackwell torch's cuDNN attention (flash-attn or torch's flash kernel where "
                        "cuDNN cannot: head dim > 128, --deterministic-mode), elsewhere flash-attn if "
                        "installed else torch's flash kernel; flash = flash-attn if installed else torch's "
                        "flash kernel; fused = cuDNN attention. GPU fp32: torch's memory-efficient kernel. "
                        "unfused/local: the fp32 reference. Attention dropout and dense masks run torch's SDPA, "
                        "the named kind of kernel first. The log names the kernel that ran.")
    g.add_argument("--deterministic-mode", action="store_true")
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--exit-duration-in-mins", type=float,
                   help="save (with --save) and stop after the first iteration ending this many minutes after "
                        "launch (set it below the job's time limit by more than an iteration and a save)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal, finish the iteration, save (with --save) and stop")
    g.add_argument("--exit-signal", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"], default="SIGTERM",
                   help="the signal --exit-signal-handler catches (ranks started by srun: #SBATCH "
                        "--signal=USR1@300 and SIGUSR1; under torchrun see README)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collector off, so that no rank pauses at its own moment; "
                        "collect at the start, every --manual-gc-interval iterations and around evaluations")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: iterations between "
                                                                      "collections (0: none during training)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: no collection around evaluations")
    g.add_argument("--rerun-mode", choices=["disabled", "validate_results", "report_stats"], default="validate_results",
                   help="Megatron's rerun state machine. validate_results: an iteration whose loss fails a check "
                        "(NaN, Inf, spiky) runs again in place to tell a transient fault (exit 17) from a "
                        "reproducible result (checkpoint, exit 16: resume on other hardware); report_stats: every "
                        "iteration runs twice and the log reports how much the checked values differ; "
                        "disabled: a NaN or Inf loss stops the run")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="--rerun-mode validate_results: reject one loss check in N on each rank (0: never), to "
                        "exercise the reruns")
    g.add_argument("--error-injection-type", choices=["correct_result", "transient_error", "persistent_error"],
                   default="transient_error",
                   help="how the reruns of an injected rejection compare: transient_error differs in place, "
                        "persistent_error differs on other hardware, correct_result agrees on both")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="reject a loss >= 10x the largest of the first 100 micro-batches (not fatal: with "
                        "--rerun-mode validate_results the iteration runs again, then goes on)")


def _rope_scaling(p):
    g = p.add_argument_group("RoPE context extension (one of llama3 or yarn; linear composes with either)")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="linear position interpolation: every RoPE frequency divided by this factor")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.1's RoPE scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling: its factor")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None, help="yarn: YaRN's RoPE scaling")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="with --rope-type yarn: its factor")
    g.add_argument("--original-max-position-embeddings", type=int, default=None,
                   help="the context the model was pretrained at, for llama3 and yarn (default: 8192 for "
                        "llama3, 4096 for yarn, megatron-core's values)")
    g.add_argument("--beta-fast", type=float, default=32.0,
                   help="yarn: pairs turning more often than this over the original context keep their frequency")
    g.add_argument("--beta-slow", type=float, default=1.0,
                   help="yarn: pairs turning less often than this are interpolated fully")
    g.add_argument("--mscale", type=float, default=1.0, help="yarn: numerator scalar of the attention factor")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="yarn: denominator scalar of the attention factor (0: none)")


def _checkpoint_and_logging(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str)
    g.add_argument("--load", type=str)
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load the model only: no optimizer, RNG, scheduler or data position; start at iteration 0")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch_dist",
                   help="torch_dist: megatron-core's sharded format, loadable under any tp/pp/dp/cp layout; "
                        "torch: one file per model-parallel rank, loadable under the same tp and pp only")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="load a checkpoint in whichever format it is (default: it must be --ckpt-format)")
    g.add_argument("--ckpt-convert-format", choices=["torch", "torch_dist"], default=None,
                   help="load --load, save it in this format under --ckpt-convert-save, and exit")
    g.add_argument("--ckpt-convert-save", type=str, default=None,
                   help="where --ckpt-convert-format saves: under DIR/<format> (Megatron's)")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration, whatever the tracker says")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's and tokenizer's settings from the checkpoint --load names; a setting "
                        "named on the command line wins")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="with --use-checkpoint-args: the tensor and pipeline sizes too")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop when it holds no checkpoint rather than start from random weights")
    g.add_argument("--async-save", action="store_true",
                   help="torch_dist: write the checkpoint in the background while training goes on; the next "
                        "save and the end of the run wait for it")
    g.add_argument("--async-strategy", choices=["mcore"], default="mcore",
                   help="megatron-core's async request, run by a forked writer process")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=STRICTNESS,
                   help="torch_dist load: what to do about keys the checkpoint and the model do not share")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true", default=True,
                   help="torch_dist: the data-parallel replicas share the writing (the default)")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save",
                   help="torch_dist: the first data-parallel replica writes everything")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="torch_dist, GPU: the data-parallel replicas share the reading and exchange the pieces "
                        "(megatron-core's exchange needs CUDA; on CPU every rank reads its own)")
    g.add_argument("--verify-integrity", action="store_true",
                   help="torch_dist: hash every checkpoint file when saving (integrity.json), check them when loading")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="torch_dist: reuse the first save's plan for later saves of the same structure")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on load, take the LR/WD schedule's settings from the checkpoint (default: they must "
                        "equal this run's)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on load, take the LR/WD schedule's settings from this run's flags, whatever the "
                        "checkpoint says")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="iterations between evaluations (Megatron's default); the end of training evaluates too")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate the loaded model on the validation and test sets, and exit")
    g.add_argument("--tensorboard-dir", type=str)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="events tensorboard's writer holds before it writes them to disk")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax",
                   help="each timer over the ranks: its max, its (min, max), or every rank's")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-interval", type=int, default=None,
                   help="print the memory line every this many iterations too (a multiple of --log-interval)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false", dest="log_loss_scale_to_tensorboard",
                   help="leave loss-scale out of tensorboard")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="write world-size (and world-size vs samples) to tensorboard")
    g.add_argument("--pipeline-timeline", type=str, default=None,
                   help="record the last training iteration's schedule here (one JSON per stage), "
                        "for tools/pipeline_simulator.py --from-run")
    g.add_argument("--profile", action="store_true",
                   help="profile the iterations after --profile-step-start completed ones up to --profile-step-end "
                        "on --profile-ranks: under torch's profiler with --use-pytorch-profiler, else between "
                        "cudaProfilerStart/Stop for nsys --capture-range=cudaProfilerApi (CUDA only)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="--profile with torch's profiler: the trace under --tensorboard-dir, and a table of the "
                        "ops that took the most (device) time printed by each profiled rank")
    g.add_argument("--profile-step-start", type=int, default=10, help="--profile from this many completed iterations")
    g.add_argument("--profile-step-end", type=int, default=12, help="--profile up to this many completed iterations")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="the global ranks --profile covers")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true",
                   help="torch's profiler records each op's input shapes")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="torch's profiler records each op's Python call stack")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA caching allocator's history; the last rank writes a snapshot to "
                        "--memory-snapshot-path after every logged iteration (https://pytorch.org/memory_viz)")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="where --record-memory-history writes its snapshot")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device for MFU (default: by device name)")


def _fusions(p):
    g = p.add_argument_group("fusions (on GPU, as Megatron enables them; on CPU every op is unfused)")
    for name, what in (("gradient-accumulation", "weight-gradient GEMMs accumulate into main_grad (needs apex's "
                        "fused_weight_gradient_mlp_cuda, also with Transformer Engine; off where it is missing)"),
                       ("bias-dropout", "bias + dropout + residual add, torch.compile'd (off with --memo)"),
                       ("bias-gelu", "bias + GELU, torch.compile'd (off with --memo)"),
                       ("bias-swiglu", "bias + SwiGLU, torch.compile'd (off with --memo)"),
                       ("masked-softmax", "megatron-core's fused masked softmax (its DotProductAttention only: "
                        "our core attention never calls it)")):
        g.add_argument(f"--no-{name}-fusion", dest=f"{name.replace('-', '_')}_fusion", action="store_false",
                       help=f"unfused: {what}")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", default=None,
                   help="megatron-core's fused vocab-parallel cross entropy: the default on GPU with --bf16 "
                        "(Megatron: off); its backward hands bf16 logit gradients, so never with fp32")
    g.add_argument("--no-cross-entropy-loss-fusion", dest="cross_entropy_loss_fusion", action="store_false")
    g.add_argument("--cross-entropy-fusion-impl", choices=["native", "te"], default="native")


def _compat(p):
    g = p.add_argument_group("compatibility (accepted, no effect here)")
    for flag, reason in NO_OP.items():
        g.add_argument(flag, action="store_true", help=f"no effect: {reason}")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="no effect: the models here are dense, there are no experts to split")
    g = p.add_argument_group("known Megatron flags that are rejected")
    for flag in UNSUPPORTED:
        g.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS, dest=_unsupported_dest(flag))


def _unsupported_dest(flag: str) -> str:
    return "_unsupported_" + flag[2:].replace("-", "_")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = _Parser(prog="pretrain_gpt.py", description="Megatron-LongSeq GPT pretraining", allow_abbrev=False,
                     formatter_class=DefaultsHelpFormatter,
                     exit_on_error=False)
    for add in (_model, _parallel, _data, _training, _fusions, _checkpoint_and_logging, _compat):
        add(parser)
    for action in parser._actions:  # argparse keeps no public list of actions
        if action.help is None and action.option_strings:
            action.help = HELP.get(action.option_strings[0])
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def parse(argv: Optional[List[str]] = None, extra_args_provider=None) -> Tuple[argparse.Namespace, List[str]]:
    """Parse, collecting every bad flag instead of stopping at the first: a bad value is reported
    and its flag left at the default (so validation still sees a whole namespace), unknown and
    rejected flags are reported with their reason. Returns (args, errors)."""
    parser = build_parser(extra_args_provider)
    argv = list(sys.argv[1:] if argv is None else argv)
    errors: List[str] = []
    for _ in range(len(argv) + 1):
        try:
            args, unknown = parser.parse_known_args(argv)
            break
        except argparse.ArgumentError as err:  # a bad value: report it, parse again without the flag
            errors.append(str(err).replace("argument ", "", 1))
            argv = _without(argv, err.argument_name)
    else:  # every pass failed: nothing left to parse a namespace from
        raise ArgsError("; ".join(errors))
    errors += [f"{flag}: {reason}" for flag, reason in UNSUPPORTED.items()
               if getattr(args, _unsupported_dest(flag)) is not None]
    args._given = _given(parser, argv)
    return args, errors + _without_switch(args, argv) + _unknown(unknown)


def _given(parser: argparse.ArgumentParser, argv: List[str]) -> frozenset:
    """The settings (dests) the command line names: --use-checkpoint-args leaves them as given."""
    actions = parser._option_string_actions  # argparse keeps no public map of flags to actions
    flags = (token.split("=", 1)[0] for token in argv if token.startswith("--"))
    return frozenset(actions[f].dest for f in flags if f in actions)


def _without_switch(args, argv: List[str]) -> List[str]:
    given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    return [f"{flag} changes nothing without {switch}" for flag, (switch, on) in NEEDS_SWITCH.items()
            if flag in given and not on(args)]


def parse_args(argv: Optional[List[str]] = None, extra_args_provider=None) -> argparse.Namespace:
    """Parse; every bad flag at once as one ArgsError line."""
    args, errors = parse(argv, extra_args_provider)
    if errors:
        raise ArgsError("; ".join(errors))
    return args


def _without(argv: List[str], names: Optional[str]) -> List[str]:
    """argv less the flag(s) `names` ("--a/--b", as argparse names them) and the values after them."""
    drop, out, skipping = set((names or "").split("/")), [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token.split("=", 1)[0] in drop
        if not skipping:
            out.append(token)
    return out


def _unknown(tokens: List[str]) -> List[str]:
    """Unknown flags: out-of-scope families with their reason, the rest (with their values) as
    argparse names them."""
    errors, stray, rejected = [], [], False
    for token in tokens:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            reason = _out_of_scope(flag)
            rejected = reason is not None
            if rejected:
                errors.append(f"{flag}: {reason}")
        if not rejected:  # a flag we do not know, or a value after one
            stray.append(token)
    return errors + ([f"unrecognized arguments: {' '.join(stray)}"] if stray else [])


def _out_of_scope(flag: str) -> Optional[str]:
    return next((reason for prefix, reason in OUT_OF_SCOPE.items()
                 if flag == prefix or (prefix.endswith("-") and flag.startswith(prefix))), None)
