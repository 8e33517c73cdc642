"""This trainer's checkpoints, read and written without process groups (one process holds every
rank's file), for the converter: torch-format ones both ways, torch_dist ones read.

A converted model is written as Megatron writes a released one: <dir>/release/mp_rank_TT[_PPP]/
model_optim_rng.pt and a tracker saying `release`, so training loads it as iteration 0 with a
fresh optimizer. The Hugging Face config it came from travels beside it (hf_config.json), with its
tokenizer files (tokenizer/), so an export writes back the same config.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from typing import Dict, Optional, Tuple

import torch

from megatron.training.checkpointing import (
    CHECKPOINT_VERSION, FORMAT_FILE, HF_CONFIG, LAYERS, RELEASE, TOKENIZER_DIR, atomic_torch_save, atomic_write_text,
    fused_norm_names, latest_checkpoint, local_layer_names, module_name, publish_tree, recorded,
    fsync_path, sync_tree)
from megatron.training.convert.hf import TOKENIZER_FILES, ConvertError
from megatron.training.convert.layout import unshard

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
        obj = {"checkpoint_version": CHECKPOINT_VERSION, "args": argparse.Namespace(**saved_args), "iteration": 0,
               "model": model}
        atomic_torch_save(obj, os.path.join(tmp, rank_dir(t, p, pp), "model_optim_rng.pt"))
    publish_tree(root, tmp, final, RELEASE)
    return final


def write_hf_side(root: str, config_dict: dict, tokenizer_from: Optional[str]) -> None:
    """The Hugging Face config and tokenizer files the model came with, beside the checkpoint:
    each replaced whole (a crash leaves the old or the new one), before the checkpoint is published."""
    os.makedirs(root, exist_ok=True)
    atomic_write_text(os.path.join(root, HF_CONFIG), json.dumps(config_dict, indent=2, sort_keys=True))
    final = os.path.join(root, TOKENIZER_DIR)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if copy_tokenizer(tokenizer_from, tmp):
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)


def replace_dir(tmp: str, final: str) -> None:
    """The finished tree `tmp` becomes `final`; an older `final` is moved aside first and removed
    last, so a crash leaves a whole directory (the old one as <final>.old at worst), never a mix."""
    sync_tree(tmp)
    old = final.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(old, ignore_errors=True)


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


def read_checkpoint(root: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(recorded args, the whole model under tp1 / pp1 names) of the checkpoint the tracker under
    `root` names, torch or torch_dist."""
    if not os.path.isdir(root):
        raise ConvertError(f"--load-dir {root}: no such directory")
    path = latest_checkpoint(root)
    if path is None or not os.path.isdir(path):
        raise ConvertError(f"--load-dir {root}: no checkpoint (no latest_checkpointed_iteration.txt naming one)")
    if os.path.isfile(os.path.join(path, FORMAT_FILE)):
        return _read_torch_dist(path)
    saved, ranks, tp, pp = _read_torch(path)
    return saved, unshard(ranks, tp, pp, _tied(saved))


def _tied(saved: dict) -> bool:
    return not saved["untie_embeddings_and_output_weights"]


def _read_torch(path: str) -> Tuple[dict, Dict[Tuple[int, int], dict], int, int]:
    """(recorded args, {(tp rank, pp rank): model state dict}, tp, pp) of a torch-format checkpoint."""
    found = {m.groups(): d for d in os.listdir(path) if (m := _RANK_DIR.match(d))}
    if not found:
        raise ConvertError(f"{path}: no mp_rank_* directories")
    tp = 1 + max(int(t) for t, _ in found)
    pp = 1 + max(int(p or 0) for _, p in found)
    ranks, saved = {}, None
    for (t, p), d in found.items():
        obj = torch.load(os.path.join(path, d, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
        if not isinstance(obj.get("args"), argparse.Namespace) or "model" not in obj:
            raise ConvertError(f"{path}/{d}: not a checkpoint of one model chunk with its arguments (a "
                               f"virtual-pipeline one has model0, model1, ...)")
        ranks[(int(t), int(p or 0))], saved = local_layer_names(obj["model"]), recorded(obj["args"])
    return saved, ranks, tp, pp


# Stored beside the model in a torch_dist checkpoint (dist_ckpt.py): not model tensors.
_NOT_MODEL = ("optimizer.", "rng_state")


def _read_torch_dist(path: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """A torch_dist checkpoint read in this one process. megatron-core stores every tensor whole,
    by its place in the whole model (so any tp / pp / virtual-pipeline run reads the same), and the
    layers of the decoder stacked on a leading axis; extra states are byte objects, skipped."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = recorded(dist_checkpointing.load_common_state_dict(path)["args"])
    reader = FileSystemReader(path)
    stored = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in reader.read_metadata().state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata) and not key.startswith(_NOT_MODEL)}
    load(stored, storage_reader=reader, no_dist=True)
    whole, fused_names = {}, fused_norm_names()
    for key, value in stored.items():
        if key.startswith(LAYERS):  # [layers, ...] -> one tensor per layer
            name = module_name(key[len(LAYERS):], fused_names)
            whole.update({f"{LAYERS}{i}.{name}": layer for i, layer in enumerate(value.unbind(0))})
        elif not (_tied(saved) and key == "output_layer.weight"):  # a tied output layer is the embedding
            whole[key] = value
    return saved, whole
