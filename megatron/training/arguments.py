"""Megatron's command line: same spellings, same defaults, plus the long-sequence flags.

A flag that Megatron has and we do not implement is still known here, so that using it fails with a
one-line reason rather than argparse's generic "unrecognized arguments" (which also stays one line).
Deliberate deviations from Megatron's defaults are listed in README.md ("Flags").
"""
from __future__ import annotations

import argparse
from typing import List, Optional


class ArgsError(ValueError):
    """Bad command line; reported as one line before any process group exists."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; we want the one line only
        raise ArgsError(message)


# Megatron flags that are deliberately not implemented, with the reason the user sees.
UNSUPPORTED = {
    "--fp16": "fp16 with loss scaling is not implemented; use --bf16",
    "--fp8-format": "FP8 training is not implemented",
    "--num-experts": "mixture-of-experts models are not implemented",
    "--use-legacy-models": "only megatron-core models are supported",
    "--use-torch-fsdp2": "FSDP is not implemented; use --use-distributed-optimizer",
    "--tp-comm-overlap": "TP communication overlap needs Transformer Engine userbuffers; not implemented",
    "--train-samples": "sample-based training is not implemented; use --train-iters",
    "--overlap-param-gather": "param all-gather overlap is not implemented (--overlap-grad-reduce is)",
}

# Flags a Megatron launch script passes that change nothing here (fusions we do not have, or
# behaviour that is always on). Accepted so existing scripts run unchanged.
NO_OP = (
    "--use-mcore-models",
    "--no-rope-fusion",  # RoPE is ours (core attention, from position ids), never megatron-core's fused one
    "--no-persist-layer-norm",  # the norms are ours, not apex's persistent LayerNorm
    "--no-async-tensor-model-parallel-allreduce",
    "--accumulate-allreduce-grads-in-fp32",  # always on with --bf16
    "--use-cpu-initialization",  # always on: identical weights for every tp size
    "--attention-softmax-in-fp32",  # always: every kernel keeps the softmax in fp32
)


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
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
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
    g.add_argument("--pipe-sp-splits", type=int, default=1,
                   help="Seq1F1B: sequence segments per micro-batch (1 = 1F1B)")
    g.add_argument("--pipe-sp-strategy", choices=["average", "uniform_comp"], default="average",
                   help="Seq1F1B segment lengths: equal, or equal FLOPs (Seq1F1B Eq. 7-8)")
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
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: one bucket per 40M elements)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--local-rank", type=int, default=None, help="ignored; LOCAL_RANK is read")


def _data(p):
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--passkey-data", action="store_true",
                   help="synthetic passkey retrieval: a key planted early, asked at the end (long-range)")
    g.add_argument("--passkey-length", type=int, default=1, help="key tokens per passkey sample")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default=None)
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--tokenizer-type", choices=["NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"])
    g.add_argument("--tokenizer-model", type=str)
    g.add_argument("--vocab-file", type=str)
    g.add_argument("--merge-file", type=str)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")


def _training(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear")
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
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
    g.add_argument("--memo-plan", type=str, default=None, help="reuse a saved memory plan (JSON)")
    g.add_argument("--memo-save-plan", type=str, default=None, help="write the memory plan (JSON) here")
    g.add_argument("--memo-allocator", choices=["caching", "planned"], default="caching",
                   help="planned: replace torch's CUDA caching allocator with one that places each layer's "
                        "transient tensors at the memory plan's offsets (CUDA only)")
    g.add_argument("--memo-host-memory-gb", type=float, default=64.0,
                   help="pinned host memory MEMO may use per rank")
    g.add_argument("--selective-checkpoint-pp", action="store_true",
                   help="with --recompute-granularity full, keep attention (out, lse) instead of "
                        "recomputing it (LoongTrain's Selective Checkpoint++)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    g.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"], default="auto",
                   help="the local attention kernel (under every context-parallel mode). CPU: torch's CPU "
                        "flash kernel, or the fp32 reference for unfused/local. GPU, fp16/bf16: auto = on "
                        "Hopper/Blackwell torch's cuDNN attention (flash-attn or torch's flash kernel where "
                        "cuDNN cannot: head dim > 128, --deterministic-mode), elsewhere flash-attn if "
                        "installed else torch's flash kernel; flash = flash-attn if installed else torch's "
                        "flash kernel; fused = cuDNN attention. GPU fp32: torch's memory-efficient kernel. "
                        "unfused/local: the fp32 reference. The log names the kernel that ran.")
    g.add_argument("--deterministic-mode", action="store_true")
    g.add_argument("--exit-interval", type=int)


def _checkpoint_and_logging(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str)
    g.add_argument("--load", type=str)
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--pipeline-timeline", type=str, default=None,
                   help="record the last training iteration's schedule here (one JSON per stage), "
                        "for tools/pipeline_simulator.py --from-run")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device for MFU (default: by device name)")


def _fusions(p):
    g = p.add_argument_group("fusions (on GPU, as Megatron enables them; on CPU every op is unfused)")
    for name, what in (("gradient-accumulation", "weight-gradient GEMMs accumulate into main_grad (apex's "
                        "fused_weight_gradient_mlp_cuda or Transformer Engine; off where neither is installed)"),
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
    for flag in NO_OP:
        g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    g = p.add_argument_group("known Megatron flags that are rejected")
    for flag in UNSUPPORTED:
        g.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS, dest=_unsupported_dest(flag))


def _unsupported_dest(flag: str) -> str:
    return "_unsupported_" + flag[2:].replace("-", "_")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = _Parser(prog="pretrain_gpt.py", description="Megatron-LongSeq GPT pretraining", allow_abbrev=False)
    for add in (_model, _parallel, _data, _training, _fusions, _checkpoint_and_logging, _compat):
        add(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def parse_args(argv: Optional[List[str]] = None, extra_args_provider=None) -> argparse.Namespace:
    """Parse and reject unsupported flags. Raises ArgsError (one line)."""
    args = build_parser(extra_args_provider).parse_args(argv)
    for flag, reason in UNSUPPORTED.items():
        if getattr(args, _unsupported_dest(flag)) is not None:
            raise ArgsError(f"{flag}: {reason}")
    return args
