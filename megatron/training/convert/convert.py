"""tools/checkpoint/convert.py: Hugging Face Llama-family models <-> this trainer's checkpoints.

  --loader hf --saver megatron        a safetensors directory -> a released torch-format checkpoint
                                      at --target-tensor/pipeline-parallel-size; prints the
                                      pretrain_gpt.py model flags that load it
  --loader megatron --saver hf        the latest (or released) checkpoint -> a safetensors directory
  --loader megatron --saver megatron  the same model at another tp / pp

Everything is checked before anything is written; a bad input is one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.convert import checkpoint as ckpt
from megatron.training.convert.hf import (
    FAMILIES, ConvertError, Model, check_flags, check_weights, hf_config, model_from_args, model_from_hf,
    pretrain_flags, read_hf_config, read_hf_weights, shard_size_bytes, trainer_args, write_hf_dir)
from megatron.training.convert.layout import from_hf, pad_rows, shard, to_hf
from megatron.training.problems import flag
from megatron.training.validate import padded_vocab_size

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "kv_channels", "vocab_size")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConvertError(message)


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = _Parser(prog="convert.py", description=__doc__.splitlines()[0])
    p.add_argument("--model-type", choices=["GPT"], default="GPT", help="Megatron's; GPT is the only one")
    p.add_argument("--loader", choices=["hf", "megatron"], required=True)
    p.add_argument("--saver", choices=["hf", "megatron"], required=True)
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="the vocabulary padding multiple (times tp) of the training run")
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="megatron -> hf: rows to keep (default: the checkpoint's record)")
    p.add_argument("--hf-family", choices=["llama", "mistral", "qwen2"], default=None,
                   help="megatron -> hf without the original config: the architecture to write "
                        "(default: qwen2 with --add-qkv-bias, else llama)")
    p.add_argument("--max-shard-size", default="5GB", help="hf saver: the largest safetensors file")
    g = p.add_argument_group("model flags (optional): checked against the checkpoint")
    for name in MODEL_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    return p.parse_args(argv)


def _check_targets(args) -> None:
    for name in ("target_tensor_parallel_size", "target_pipeline_parallel_size", "make_vocab_size_divisible_by"):
        if getattr(args, name) < 1:
            raise ConvertError(f"{flag(name)} must be >= 1, got {getattr(args, name)}")
    if os.path.realpath(args.load_dir) == os.path.realpath(args.save_dir):
        # the saver would overwrite what the loader still reads (side files, tokenizer)
        raise ConvertError(f"--save-dir is --load-dir ({args.load_dir}): write the conversion to another directory")
    args.max_shard_bytes = shard_size_bytes(args.max_shard_size)
    if args.saver == "hf":
        _check_hf_target(args.save_dir)


def _check_hf_target(path: str) -> None:
    """The export replaces --save-dir whole: only an earlier model directory (or none) may be there."""
    if os.path.exists(path) and not (os.path.isdir(path) and _is_hf_dir(path)):
        raise ConvertError(f"--save-dir {path} exists and is not a Hugging Face model directory: "
                           "the export replaces it whole, so name a new directory")


def _is_hf_dir(path: str) -> bool:
    return not os.listdir(path) or os.path.isfile(os.path.join(path, "config.json"))


def _check_split(m: Model, tp: int, pp: int) -> None:
    """The target layout must divide the model as megatron-core divides it."""
    for what, n in (("query groups", m.groups), ("attention heads", m.heads), ("ffn width", m.ffn_hidden_size)):
        if n % tp:
            raise ConvertError(f"--target-tensor-parallel-size {tp} does not divide the {what} ({n})")
    if m.num_layers % pp:
        raise ConvertError(f"--target-pipeline-parallel-size {pp} does not divide the {m.num_layers} layers")


# ---- loaders: -> (Model, whole state dict under our names, hf config dict or None, tokenizer dir) --
def load_hf(args) -> Tuple[Model, Dict[str, torch.Tensor], dict, str]:
    config = read_hf_config(args.load_dir)
    m = model_from_hf(config)
    _check_model(args, m)
    state = read_hf_weights(args.load_dir)
    check_weights(state, m)
    padded = padded_vocab_size(m.vocab, args.make_vocab_size_divisible_by, args.target_tensor_parallel_size)
    return m, from_hf(state, m.shape(padded)), config.to_dict(), args.load_dir


def _check_model(args, m: Model) -> None:
    check_flags(m, {k: getattr(args, k) for k in MODEL_FLAGS})
    if args.saver == "megatron":
        _check_split(m, args.target_tensor_parallel_size, args.target_pipeline_parallel_size)


def load_megatron(args) -> Tuple[Model, Dict[str, torch.Tensor], Optional[dict], str]:
    saved, whole = ckpt.read_checkpoint(args.load_dir)
    base = ckpt.read_hf_side(args.load_dir)
    family = args.hf_family or _family_of(base, saved)
    vocab = args.true_vocab_size if args.true_vocab_size is not None else (base or {}).get("vocab_size")
    rows = whole["embedding.word_embeddings.weight"].shape[0]
    if vocab is not None and not 0 < vocab <= rows:
        raise ConvertError(f"--true-vocab-size {vocab}: the checkpoint's embedding has {rows} rows")
    m = model_from_args(saved, family, vocab)
    _check_model(args, m)
    return m, whole, base, f"{args.load_dir}/{ckpt.TOKENIZER_DIR}"


def _family_of(base: Optional[dict], saved: dict) -> str:
    archs = (base or {}).get("architectures") or []
    known = [FAMILIES[a] for a in archs if a in FAMILIES]
    return known[0] if known else "qwen2" if saved.get("add_qkv_bias") else "llama"


# ---- savers ---------------------------------------------------------------------------------------
def save_megatron(args, m: Model, whole: dict, base: Optional[dict], tokenizer: str) -> None:
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    padded = padded_vocab_size(m.vocab, args.make_vocab_size_divisible_by, tp)
    whole = _repad(whole, padded)
    ranks = shard(whole, m.shape(padded), tp, pp)
    # the side files first: once the tracker names the release, an export reads them
    ckpt.write_hf_side(args.save_dir, base if base is not None else hf_config(m, _dtype(whole)).to_dict(), tokenizer)
    ckpt.write_release(args.save_dir, ranks, trainer_args(m, tp, pp, padded))
    flags = pretrain_flags(m, args.make_vocab_size_divisible_by)
    print(f"saved a released checkpoint at tp {tp}, pp {pp} under {args.save_dir}; pretrain_gpt.py model flags:")
    print(" ".join(flags + [f"--tensor-model-parallel-size {tp}", f"--pipeline-model-parallel-size {pp}",
                            f"--load {args.save_dir}", "--ckpt-format torch"]))


def _repad(whole: dict, padded: int) -> dict:
    """Vocabulary rows padded (zeros) or cut to this layout's padded size."""
    rows = ("embedding.word_embeddings.weight", "output_layer.weight")
    return {k: pad_rows(v, padded) if k in rows else v for k, v in whole.items()}


def _dtype(whole: dict) -> torch.dtype:
    return whole["embedding.word_embeddings.weight"].dtype


def save_hf(args, m: Model, whole: dict, base: Optional[dict], tokenizer: str) -> None:
    state = to_hf(whole, m.shape(whole["embedding.word_embeddings.weight"].shape[0]))
    # written aside and swapped in whole: a crash or a smaller re-export leaves no stale shards
    tmp = args.save_dir.rstrip("/") + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    write_hf_dir(tmp, hf_config(m, _dtype(whole), base), state, args.max_shard_bytes)
    ckpt.copy_tokenizer(tokenizer, tmp)
    ckpt.replace_dir(tmp, args.save_dir)
    print(f"saved a {m.family} model in safetensors under {args.save_dir}")


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse(argv)
        _check_targets(args)
        m, whole, base, tokenizer = (load_hf if args.loader == "hf" else load_megatron)(args)
        (save_megatron if args.saver == "megatron" else save_hf)(args, m, whole, base, tokenizer)
    except ConvertError as err:
        print(f"convert.py: error: {err}", file=sys.stderr)
        return 2
    return 0
