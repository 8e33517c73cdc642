"""Checkpoints in Megatron's `torch` layout, written atomically, resumed exactly; the parts every
format shares (tracker, directory names, argument checks, publishing a finished save).

  <dir>/latest_checkpointed_iteration.txt          the tracker, written last
  <dir>/iter_0000010/mp_rank_00[_001]/model_optim_rng.pt   one file per (tp[, pp]) rank
  <dir>/iter_0000010/mp_rank_00[_001]/distrib_optim.pt     the distributed optimizer's state, gathered

A save writes into iter_XXXXXXX.tmp, fsyncs every file, renames the directory into place, and only
then replaces the tracker (write + fsync + rename). A crash at any moment leaves the previous
checkpoint and a tracker that points at it.

What a resume needs to be exact: model, optimizer (fp32 main params and Adam moments), LR schedule,
every RNG stream, the iteration and the data position (consumed train and valid samples).

The files are Megatron-LM's, both ways: `args` is an argparse Namespace of every argument with
the consumed samples inside, `rng_state` a list of per-replica dicts under Megatron's key names
(a CPU run has no CUDA state: Megatron-LM, which always sets one, loads such a checkpoint with
--no-load-rng), and a tracker saying `release` names a released model (<dir>/release, trained
from iteration 0 with a fresh optimizer, as Megatron does). The distributed optimizer's state is
in Megatron's layout both ways (megatron_optim.py): distrib_optim.pt holds each model chunk's
buffer gathered whole, so it also loads under another data-parallel size; so is the
non-distributed optimizer's (torch's own state dict, indexed through Megatron's parameter groups,
with the fp32 main parameters beside it under --bf16 / --fp16).
"""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.longseq.collectives import all_gather_values, all_reduce_values
from megatron.longseq.random import load_rng_state_dict, rng_state_dict
from megatron.training.rerun import gathered_states, restore_states
from megatron.training.megatron_optim import (
    from_megatron, from_megatron_plain, megatron_groups, megatron_param_groups, megatron_steps, to_megatron,
    to_megatron_plain)
from megatron.training.metrics import print_rank_0
from megatron.training.model import unwrap
from megatron.training.validate import train_samples

TRACKER = "latest_checkpointed_iteration.txt"
PREVIOUS = ".previous"  # an iteration saved again is moved aside under this suffix until the new one is in
CHECKPOINT_VERSION = 3.0
# Arguments that must agree between the checkpoint and the run that loads it.
MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "kv_channels", "padded_vocab_size", "position_embedding_type", "normalization", "swiglu",
              "add_bias_linear", "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "qk_layernorm", "apply_layernorm_1p")
# Arguments recorded beside them, unchecked: what a converter needs to describe the model
# (tools/checkpoint/convert.py writes the Hugging Face config from them).
DESCRIBED = ("add_qkv_bias", "true_vocab_size", "norm_epsilon", "rotary_base", "rotary_percent", "rotary_interleaved",
             "max_position_embeddings", "seq_length", "rotary_seq_len_interpolation_factor", "use_rope_scaling",
             "rope_scaling_factor", "rope_type", "rotary_scaling_factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# The layout: fixed for a torch-format checkpoint, free for a torch_dist one.
LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
FORMAT_FILE = "metadata.json"  # written last into a torch_dist checkpoint by megatron-core
DISTRIB_OPTIM = "distrib_optim.pt"
SCHEDULE = "opt_param_scheduler"  # the scheduler's state in a checkpoint (Megatron's key)


class CheckpointError(ValueError):
    """A checkpoint this run's flags cannot load as asked: one line, with the flag that would."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir_name(pgs) -> str:
    tp, pp = pgs.index("tp"), pgs.index("pp")
    return f"mp_rank_{tp:02d}" if pgs.size("pp") == 1 else f"mp_rank_{tp:02d}_{pp:03d}"


def fsync_path(path: str) -> None:
    """A file's or a directory's contents to disk (Linux syncs through a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")


def model_keys(chunks) -> list:
    """Megatron's names: "model", or "model0", "model1", ... for virtual pipeline chunks."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_states(chunks) -> dict:
    # Copied: parameters are views of the flat DDP buffer; the file should hold each tensor alone.
    # To the host: a copy of the whole model on the device could overflow it during the save.
    # Unwrapped (no bf16 wrapper prefix), as Megatron saves.
    return {key: {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                  for k, v in model.state_dict().items()}
            for key, model in zip(model_keys(chunks), unwrap(chunks))}


def save_checkpoint(args, state, pgs) -> str:
    """Collective. `state` has model, optimizer, scheduler, iteration, consumed samples, flops."""
    iteration = state.iteration
    final, tmp = iteration_dir(args.save, iteration), iteration_dir(args.save, iteration) + ".tmp"
    on_rank_0(lambda: fresh_dir(tmp))
    rank_dir = os.path.join(tmp, rank_dir_name(pgs))
    distributed = args.use_distributed_optimizer and not args.no_save_optim
    writer = pgs.index("dp_cp") == 0  # the model is replicated over dp x cp: one writer per (tp, pp)
    # collective: every rank's shards, whole on the writer only; then it goes its own way
    flats = state.optimizer.model_space_state(keep=writer) if distributed else None
    rerun = gathered_states(state.rerun)

    def write():
        os.makedirs(rank_dir, exist_ok=True)
        atomic_torch_save(_main_file(args, state, rerun), os.path.join(rank_dir, "model_optim_rng.pt"))
        if distributed:
            atomic_torch_save(to_megatron(flats, state.optimizer.buffer.offsets, unwrap(state.model), args,
                                          pgs.index("pp"), pgs.size("dp_cp_intra")),
                              os.path.join(rank_dir, DISTRIB_OPTIM))
    everywhere_or_nowhere(write if writer else lambda: None)
    publish(args.save, tmp, final, iteration)
    return final


def fresh_dir(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
    os.makedirs(tmp)


def everywhere_or_nowhere(work: Callable[[], None]) -> None:
    """Collective: `work` on every rank (nothing, on some), then every rank learns whether it
    succeeded everywhere. A failed write (a full disk, a quota) raises on every rank at once;
    otherwise the others would wait at the next collective until NCCL's watchdog ends the job."""
    error = None
    try:
        work()
    except Exception as err:  # noqa: BLE001 -- re-raised below, once the others know
        error = err
    flags = all_gather_values([1.0 if error is not None else 0.0])
    if error is not None:
        raise error
    failed = [rank for rank, (flag,) in enumerate(flags) if flag]
    if failed:
        raise RuntimeError(f"checkpoint files could not be written on rank(s) {failed}; the previous checkpoint stays")


def on_rank_0(work: Callable[[], None]) -> None:
    everywhere_or_nowhere(work if dist.get_rank() == 0 else lambda: None)


def publish(root: str, tmp: str, final: str, iteration: int) -> None:
    """Collective, after every rank's files are complete: rank 0 syncs the tree, renames it into
    place and only then points the tracker at it."""
    on_rank_0(lambda: publish_tree(root, tmp, final, str(iteration)))


def sync_tree(top: str) -> None:
    """Every file and directory under `top` on disk, before a rename makes the tree visible."""
    for path, _, files in os.walk(top):
        for name in files:
            fsync_path(os.path.join(path, name))
        fsync_path(path)


def publish_tree(root: str, tmp: str, final: str, tracker: str) -> None:
    """Sync the finished tree `tmp`, rename it to `final` and only then write the tracker. Every
    file is synced here, whoever wrote it: megatron-core leaves torch_dist's common.pt and
    metadata.json unsynced, and a crash of the machine after the rename could leave them empty."""
    sync_tree(tmp)
    previous = final + PREVIOUS
    if os.path.exists(final):  # saving the same iteration again: the old copy stays until the new is in place
        if os.path.exists(previous):
            shutil.rmtree(previous)
        os.rename(final, previous)  # a crash from here on leaves it where the loader looks (published)
        fsync_path(root)
    os.rename(tmp, final)
    fsync_path(root)
    atomic_write_text(os.path.join(root, TRACKER), tracker)
    if os.path.exists(previous):
        shutil.rmtree(previous)


def _main_file(args, state, rerun: Optional[list]) -> dict:
    obj = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "args": saved_args(args, state),
        "iteration": state.iteration,
        **_model_states(state.model),
        SCHEDULE: state.scheduler.state_dict(),
        "num_floating_point_operations_so_far": state.flops_so_far,
    }
    if not args.no_save_optim:
        obj["optimizer"] = _megatron_optimizer(args, state)
    if not args.no_save_rng:  # Megatron's list of per-replica states; the replicas share one here
        obj["rng_state"] = [rng_state_dict()]
    if rerun is not None:
        obj["rerun_state_machine"] = rerun
    return obj


def _megatron_optimizer(args, state) -> dict:
    """model_optim_rng.pt's "optimizer" as Megatron writes it: with the distributed optimizer, the
    param groups without params beside distrib_optim.pt, Adam's step in each; without, the whole
    state (megatron_optim.py). The fp16 loss scaler in both."""
    optimizer = state.optimizer
    if args.use_distributed_optimizer:
        groups = megatron_param_groups(optimizer.param_groups, args, optimizer.adam_steps())
        out = {"optimizer": {"param_groups": groups}}
    else:
        out = to_megatron_plain(optimizer.param_state, megatron_groups(optimizer, unwrap(state.model), args),
                                args, optimizer.adam_steps())
    if optimizer.scaler is not None:  # Megatron's scale is a one-element fp32 tensor; a fixed one saves {}
        scaler = optimizer.scaler.state_dict()
        out["grad_scaler"] = {**scaler, "scale": torch.tensor([optimizer.scaler.scale])} if scaler else {}
    return out


RELEASE = "release"
# The Hugging Face config and tokenizer a converted model came with (tools/checkpoint/convert.py);
# every checkpoint of a run that loaded one carries them on, so an export writes the same config.
HF_CONFIG, TOKENIZER_DIR = "hf_config.json", "tokenizer"


def carry_model_card(load: Optional[str], save: str) -> None:
    """Copy --load's hf_config.json and tokenizer/ under --save (rank 0, once)."""
    if not load or os.path.abspath(load) == os.path.abspath(save) or not os.path.isfile(os.path.join(load, HF_CONFIG)):
        return
    os.makedirs(save, exist_ok=True)
    if not os.path.isfile(os.path.join(save, HF_CONFIG)):
        shutil.copyfile(os.path.join(load, HF_CONFIG), os.path.join(save, HF_CONFIG))
    tokenizer = os.path.join(load, TOKENIZER_DIR)
    if os.path.isdir(tokenizer) and not os.path.isdir(os.path.join(save, TOKENIZER_DIR)):
        shutil.copytree(tokenizer, os.path.join(save, TOKENIZER_DIR))


def read_tracker(root: str):
    """The iteration the tracker names, RELEASE for a released model, None without a tracker."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number or 'release', found {text!r}")
    return int(text)


def same_tracker_everywhere(root: str) -> None:
    """Collective: every rank read the same tracker. A stale view of a shared file system can show
    a rank an older one, and that rank would resume from another checkpoint than the rest."""
    mine = read_tracker(root)
    code = -1 if mine is None else -2 if mine == RELEASE else mine
    low, minus_high = all_reduce_values([code, -code], op=dist.ReduceOp.MIN)
    if low != -minus_high:
        names = {-1: "none", -2: RELEASE}
        seen = ", ".join(names.get(int(c), str(int(c))) for c in (low, -minus_high))
        raise ValueError(f"the ranks read different checkpoints from {os.path.join(root, TRACKER)} ({seen}): "
                         "is a shared file system showing some nodes an older copy?")


def latest_checkpoint(root: str, step: Optional[int] = None) -> Optional[str]:
    """The iteration directory the tracker under `root` points at, or `step`'s (Megatron's
    --ckpt-step, whatever the tracker says); None when there is none."""
    iteration = read_tracker(root) if step is None else step
    if iteration == RELEASE:
        return published(os.path.join(root, RELEASE))
    return None if iteration is None else published(iteration_dir(root, iteration))


def published(path: str) -> str:
    """`path`, or the copy a save of the same iteration moved aside if it crashed before putting
    the new one in place (publish_tree)."""
    return path + PREVIOUS if not os.path.exists(path) and os.path.isdir(path + PREVIOUS) else path


def loaded_checkpoint(args) -> Optional[str]:
    """The checkpoint --load (and --ckpt-step) name."""
    return latest_checkpoint(args.load, args.ckpt_step)


def checkpoint_format(path: str, args) -> str:
    """The format of the checkpoint at `path`; one that is not --ckpt-format is an error unless
    --auto-detect-ckpt-format (Megatron's rule)."""
    if not os.path.isdir(path):
        raise ValueError(f"no checkpoint directory {path} (named by the tracker, or --ckpt-step)")
    found = "torch_dist" if os.path.isfile(os.path.join(path, FORMAT_FILE)) else "torch"
    if found == "torch" and not any(name.startswith("mp_rank_") for name in os.listdir(path)):
        raise ValueError(f"{path} holds neither a torch_dist checkpoint ({FORMAT_FILE}) nor a torch one (mp_rank_*)")
    if found != args.ckpt_format and not args.auto_detect_ckpt_format:
        raise ValueError(f"{path} is a {found}-format checkpoint but --ckpt-format is {args.ckpt_format}: "
                         f"pass --ckpt-format {found} or --auto-detect-ckpt-format")
    return found


def load_checkpoint(args, state, pgs) -> bool:
    """Fill `state` from the latest torch-format checkpoint under --load. False when there is none.
    A released model (tracker `release`) or --finetune loads the model only, and training starts
    afresh from it: iteration 0, a new optimizer, schedule, RNG and data position (Megatron's rule)."""
    path = loaded_checkpoint(args)
    if path is None:
        return False
    rank_dir = os.path.join(path, rank_dir_name(pgs))
    obj = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
    check_args(recorded(obj.get("args")), args)
    for key, model in zip(model_keys(state.model), unwrap(state.model)):
        model.load_state_dict(_in_model_names(model, obj[key]), strict=True)
    state.optimizer.reload_model_params()
    if model_only(args, path):
        return True
    if not args.no_load_optim:
        _load_optimizer(args, state, obj, rank_dir, pgs)
        state.scheduler.load_state_dict(schedule_in(obj))  # check_schedule compared it at start-up
    _load_progress(args, state, obj, pgs)
    return True


def model_only(args, path: str) -> bool:
    """Megatron's rule: a released model (tracker `release`) or --finetune loads the weights only, and
    training starts afresh from them: iteration 0, a new optimizer, schedule, RNG and data position."""
    return os.path.basename(path) in (RELEASE, RELEASE + PREVIOUS) or args.finetune


def loads_schedule(args, path: str) -> bool:
    """The LR schedule rides with the optimizer state (Megatron's rule): --no-load-optim starts it
    afresh too, at step 0 from this run's flags, while the iteration and data position carry on."""
    return not model_only(args, path) and not args.no_load_optim


def _load_optimizer(args, state, obj: dict, rank_dir: str, pgs) -> None:
    saved, path = obj.get("optimizer"), os.path.join(rank_dir, DISTRIB_OPTIM)
    if saved is None:
        raise CheckpointError(f"{rank_dir} holds no optimizer state: load with --no-load-optim")
    if args.use_distributed_optimizer != os.path.isfile(path):
        said = "with" if os.path.isfile(path) else "without"
        raise CheckpointError(f"{rank_dir} was saved {said} --use-distributed-optimizer, this run differs: its "
                              f"optimizer state does not carry over (load with --no-load-optim)")
    if args.use_distributed_optimizer:
        world = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        states = from_megatron(world, state.optimizer.fragments_of, unwrap(state.model), args, pgs.index("pp"),
                               pgs.size("dp_cp_intra"))
        state.optimizer.load_param_states(states, megatron_steps(saved))
    else:
        flats, steps = from_megatron_plain(saved, state.optimizer.buffer,
                                           megatron_groups(state.optimizer, unwrap(state.model), args))
        state.optimizer.load_model_space_state(flats, steps)
    if state.optimizer.scaler is not None and "grad_scaler" in saved:
        state.optimizer.scaler.load_state_dict(saved["grad_scaler"])


def _load_progress(args, state, obj: dict, pgs) -> None:
    """RNG streams, iteration and data position."""
    if not args.no_load_rng and "rng_state" in obj:
        load_rng_state_dict(replica_rng_state(obj["rng_state"], pgs))
    state.iteration = obj["iteration"]
    load_position(state, obj.get("args"))
    state.flops_so_far = obj.get("num_floating_point_operations_so_far", 0)
    # Megatron-LM keeps its machine's state in torch_dist checkpoints only: absent, nothing to rerun
    restore_states(state.rerun, obj.get("rerun_state_machine"), log=print_rank_0)


def load_position(state, saved: argparse.Namespace) -> None:
    """The data position, which Megatron keeps inside its `args`."""
    state.consumed_train_samples = getattr(saved, "consumed_train_samples", 0)
    state.consumed_valid_samples = getattr(saved, "consumed_valid_samples", 0)


def recorded_args(path: str, pgs) -> dict:
    """The model arguments the torch-format checkpoint at `path` records, and its schedule under
    SCHEDULE, from this rank's file memory-mapped (its tensors stay on disk)."""
    file = os.path.join(path, rank_dir_name(pgs), "model_optim_rng.pt")
    if not os.path.isfile(file):
        raise ValueError(f"{path} has no {rank_dir_name(pgs)}/model_optim_rng.pt: a torch-format checkpoint loads "
                         f"under the tensor / pipeline sizes that saved it (torch_dist loads under any)")
    obj = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
    return {**recorded(obj.get("args")), SCHEDULE: schedule_in(obj)}


def schedule_in(obj: dict) -> Optional[dict]:
    """The scheduler state, under its name before Megatron renamed it too."""
    return obj.get(SCHEDULE, obj.get("lr_scheduler"))


def recorded(namespace: Optional[argparse.Namespace]) -> dict:
    """The MUST_MATCH and DESCRIBED values of a checkpoint's `args` (none when it has none, as
    Megatron's loader allows). Without GQA, Megatron's num_query_groups means nothing: every head
    is its own group, as this trainer records it."""
    if namespace is None:
        return {}
    saved = {k: getattr(namespace, k) for k in MUST_MATCH + DESCRIBED if hasattr(namespace, k)}
    if not getattr(namespace, "group_query_attention", False):
        saved["num_query_groups"] = namespace.num_attention_heads
    return saved


def replica_rng_state(states: list, pgs) -> dict:
    """This rank's entry of Megatron's RNG list: one per data-parallel replica when they draw
    differently (its --data-parallel-random-init), else one for all."""
    return states[pgs.index("dp") if len(states) > 1 else 0]


def schedule_of(args) -> dict:
    """megatron-core's scheduler settings from this run's flags, as its state dict names them
    (steps count samples: validate.py derives them from iterations or samples)."""
    return {"max_lr": args.lr, "min_lr": args.min_lr, "lr_warmup_steps": args.lr_warmup_steps,
            "lr_decay_steps": args.lr_decay_steps, "lr_decay_style": args.lr_decay_style,
            "start_wd": _or(args.start_weight_decay, args.weight_decay),
            "end_wd": _or(args.end_weight_decay, args.weight_decay),
            "wd_incr_steps": train_samples(args), "wd_incr_style": args.weight_decay_incr_style}


def _or(value, default):
    return default if value is None else value


# What each setting is called on the command line (a longer --train-iters moves both step counts)
SCHEDULE_NAMES = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "LR warm-up samples",
                  "lr_decay_steps": "LR decay samples", "lr_decay_style": "--lr-decay-style",
                  "start_wd": "--start-weight-decay (or --weight-decay)",
                  "end_wd": "--end-weight-decay (or --weight-decay)",
                  "wd_incr_steps": "weight-decay samples (--train-samples, or --train-iters x --global-batch-size)",
                  "wd_incr_style": "--weight-decay-incr-style"}


def check_schedule(saved: Optional[dict], args) -> None:
    """megatron-core's scheduler refuses to resume a schedule other than the checkpoint's unless told
    which to take (an assertion, after the model is built): every difference, said at start-up."""
    if not saved or args.use_checkpoint_opt_param_scheduler or args.override_opt_param_scheduler:
        return
    ours = schedule_of(args)
    differ = [f"{SCHEDULE_NAMES[k]} {ours[k]} here, {saved[k]} in the checkpoint"
              for k in ours if k in saved and saved[k] != ours[k]]
    if differ:
        raise ValueError(f"the LR / weight-decay schedule is not the checkpoint's ({', '.join(differ)}): pass "
                         "--use-checkpoint-opt_param-scheduler to take the checkpoint's or "
                         "--override-opt_param-scheduler to take this run's")


def saved_args(args, state) -> argparse.Namespace:
    """Megatron's `args` entry: every argument of the run in an argparse Namespace, the data
    position inside (where Megatron's loader reads it)."""
    kept = {k: v for k, v in vars(args).items() if not k.startswith("_")}  # not the refusal bookkeeping
    return argparse.Namespace(**kept, consumed_train_samples=state.consumed_train_samples,
                              consumed_valid_samples=state.consumed_valid_samples)


def check_args(saved: dict, args) -> None:
    """Every MUST_MATCH value the checkpoint records equals this run's."""
    for key, value in saved.items():
        if key in MUST_MATCH and getattr(args, key) != value:
            raise ValueError(f"checkpoint has {key}={value} but this run has {getattr(args, key)}")


# ---- Transformer Engine's names ---------------------------------------------------------------------
LAYERS = "decoder.layers."


def _in_model_names(model, saved: dict) -> dict:
    """`saved` as `model` names its layers: a model of local layers reads Transformer Engine's
    names; one of Transformer Engine's layers reads its own as they are."""
    local = any(name.endswith("input_layernorm.weight") for name, _ in model.named_parameters())
    return local_layer_names(saved) if local else saved


def local_layer_names(model: dict) -> dict:
    """A torch-format model state under the local layers' names. Megatron-LM's GPU default,
    Transformer Engine layers, keeps each norm inside the fused linear module that applies it
    (linear_qkv.layer_norm_weight for input_layernorm.weight) and an `_extra_state` entry per
    module (FP8 metadata, no weights): the names are mapped and those entries dropped."""
    fused, out = fused_norm_names(), {}
    for key, value in model.items():
        if key.endswith("._extra_state"):
            continue
        if key.startswith(LAYERS):
            index, name = key[len(LAYERS):].split(".", 1)
            key = f"{LAYERS}{index}.{module_name(name, fused)}"
        out[key] = value
    return out


def fused_norm_names() -> dict:
    """{local module prefix: Transformer Engine's prefix}, as megatron-core's local spec maps them
    (its sharded_state_dict_keys_map, which is also how torch_dist stores the local layers' norms,
    so either implementation reads the other's checkpoints)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map


def module_name(stored: str, fused_names: dict) -> str:
    """A layer's parameter name under the local spec from its name under Transformer Engine's."""
    for module, fused in fused_names.items():
        if stored.startswith(fused):
            return module + stored[len(fused):]
    return stored
