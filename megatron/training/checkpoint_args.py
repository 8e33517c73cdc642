"""--use-checkpoint-args: the model's settings read from the checkpoint under --load before the
command line is validated, so that evaluating or extending a trained model needs no copy of its
flags. What the checkpoint records fills every setting the command line does not name; a setting
the command line names wins (a new --seq-length or --rotary-base to extend the context), and one
that contradicts the weights (--hidden-size, say) is still refused at start-up by the load check."""
from __future__ import annotations

import argparse
import os
from typing import List

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException

from megatron.training.checkpointing import (
    DESCRIBED, LAYOUT_ARGS, MUST_MATCH, TRACKER, checkpoint_format, loaded_checkpoint,
)

# The model and its tokenizer. padded_vocab_size is no flag: it is kept when it fits this run's
# tokenizer and tensor-parallel size (validate._vocab_args), so a checkpoint resharded to another
# tp keeps its table's rows.
MODEL = tuple(n for n in MUST_MATCH + DESCRIBED if n not in LAYOUT_ARGS + ("true_vocab_size",)) + (
    "group_query_attention", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
    "make_vocab_size_divisible_by")


def checkpoint_settings(args) -> List[str]:
    """Fill `args` from the recorded arguments of the checkpoint --load names; the problems found,
    as lines (none when the flag is off). The names taken are kept in args._from_checkpoint."""
    if not args.use_checkpoint_args:
        return []
    try:
        saved = vars(_recorded_namespace(args))
    except (ValueError, OSError, CheckpointingException) as err:  # no file, or not a checkpoint
        return [f"--use-checkpoint-args: {' '.join(str(err).split())}"]
    names = [n for n in _taken(args) if n in saved and saved[n] is not None]
    for name in names:
        setattr(args, name, saved[name])
    args._from_checkpoint = names
    return []


def _taken(args) -> tuple:
    """The settings to read: the model's unless named on the command line, and the layout with
    --use-mp-args-from-checkpoint-args (a torch-format checkpoint loads only under its own)."""
    given = getattr(args, "_given", frozenset())
    model = tuple(n for n in MODEL if n not in given)
    return model + (LAYOUT_ARGS if args.use_mp_args_from_checkpoint_args else ())


def _recorded_namespace(args) -> argparse.Namespace:
    """The `args` entry of the checkpoint --load names: common.pt of a torch_dist checkpoint, any
    rank's file of a torch one (every rank records the same), memory-mapped."""
    if not args.load:
        raise ValueError("needs --load, the checkpoint whose settings it reads")
    path = loaded_checkpoint(args)
    if path is None:
        raise ValueError(f"no checkpoint under --load {args.load} ({TRACKER} names none)")
    if checkpoint_format(path, args) == "torch_dist":
        saved = dist_checkpointing.load_common_state_dict(path).get("args")
    else:
        first = min(n for n in os.listdir(path) if n.startswith("mp_rank_"))
        saved = torch.load(os.path.join(path, first, "model_optim_rng.pt"), map_location="cpu",
                           weights_only=False, mmap=True).get("args")
    if saved is None:
        raise ValueError(f"{path} records no arguments to read")
    return saved
