"""This trainer's torch-format checkpoints, read and written without process groups (one process
holds every rank's file), for the converter.

A converted model is written as Megatron writes a released one: <dir>/release/mp_rank_TT[_PPP]/
model_optim_rng.pt and a tracker saying `release`, so training loads it as iteration 0 with a
fresh optimizer. The Hugging Face config it came from travels beside it (hf_config.json), with its
tokenizer files (tokenizer/), so an export writes back the same config.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Optional, Tuple

import torch

from megatron.training.checkpointing import (
    CHECKPOINT_VERSION, FORMAT_FILE, HF_CONFIG, RELEASE, TOKENIZER_DIR, atomic_torch_save, latest_checkpoint,
    publish_tree)
from megatron.training.convert.hf import TOKENIZER_FILES, ConvertError
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def write_release(root: str, ranks: Dict[Tuple[int, int], dict], saved_args: dict) -> str:
    """Every rank's model file under <root>/release, published atomically (tracker last)."""
    final = os.path.join(root, RELEASE)
    tmp = final + ".tmp"
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    pp = saved_args["pipeline_model_parallel_size"]
    for (t, p), model in ranks.items():
        os.makedirs(os.path.join(tmp, rank_dir(t, p, pp)))
        obj = {"checkpoint_version": CHECKPOINT_VERSION, "args": saved_args, "iteration": 0, "model": model}
        atomic_torch_save(obj, os.path.join(tmp, rank_dir(t, p, pp), "model_optim_rng.pt"))
    publish_tree(root, tmp, final, RELEASE)
    return final


def write_hf_side(root: str, config_dict: dict, tokenizer_from: Optional[str]) -> None:
    """The Hugging Face config and tokenizer files the model came with, beside the checkpoint."""
    with open(os.path.join(root, HF_CONFIG), "w") as f:
        json.dump(config_dict, f, indent=2, sort_keys=True)
    copy_tokenizer(tokenizer_from, os.path.join(root, TOKENIZER_DIR))


def copy_tokenizer(src: Optional[str], dst: str) -> bool:
    names = [n for n in TOKENIZER_FILES if src and os.path.isfile(os.path.join(src, n))]
    if names:
        os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return bool(names)


def read_hf_side(root: str) -> Optional[dict]:
    path = os.path.join(root, HF_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_checkpoint(root: str) -> Tuple[dict, Dict[Tuple[int, int], dict], int, int]:
    """(recorded args, {(tp rank, pp rank): model state dict}, tp, pp) of the checkpoint the
    tracker under `root` names."""
    if not os.path.isdir(root):
        raise ConvertError(f"--load-dir {root}: no such directory")
    path = latest_checkpoint(root)
    if path is None or not os.path.isdir(path):
        raise ConvertError(f"--load-dir {root}: no checkpoint (no latest_checkpointed_iteration.txt naming one)")
    if os.path.isfile(os.path.join(path, FORMAT_FILE)):
        raise ConvertError(f"{path} is a torch_dist checkpoint: this converter reads torch-format ones; resave it "
                           f"with pretrain_gpt.py --ckpt-format torch (load it with --auto-detect-ckpt-format)")
    found = {m.groups(): d for d in os.listdir(path) if (m := _RANK_DIR.match(d))}
    if not found:
        raise ConvertError(f"{path}: no mp_rank_* directories")
    tp = 1 + max(int(t) for t, _ in found)
    pp = 1 + max(int(p or 0) for _, p in found)
    ranks, saved = {}, None
    for (t, p), d in found.items():
        obj = torch.load(os.path.join(path, d, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
        if not isinstance(obj.get("args"), dict) or "model" not in obj:
            raise ConvertError(f"{path}/{d}: not this trainer's checkpoint of one model chunk (Megatron-LM's own "
                               f"or a virtual-pipeline one)")
        ranks[(int(t), int(p or 0))], saved = obj["model"], obj["args"]
    return saved, ranks, tp, pp
