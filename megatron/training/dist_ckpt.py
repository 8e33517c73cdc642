"""Checkpoints in megatron-core's `torch_dist` format (Megatron's default), loadable under any
tensor / pipeline / data / context-parallel layout.

  <dir>/latest_checkpointed_iteration.txt                  the tracker, written last
  <dir>/iter_0000010/{.metadata, __R_I.distcp, common.pt, metadata.json}

Every tensor is saved by its place in the whole model (megatron-core's sharded state dict: layer
offsets for pipeline stages, the tp-split axis), so any layout reads the pieces it needs. The
optimizer is saved in model space: each parameter's fp32 main copy and Adam moments as tensors of
the parameter's shape, cut like the parameter (Megatron's fully reshardable form), whatever the
data-parallel sharding of the run that wrote it. A load reads, into host memory, the state of the
parameters this rank's shard touches only, and takes it from what the load returns.

A save is one megatron-core async request on every path: device tensors are copied to host memory,
a forked process writes them (host tensors from its copy-on-write snapshot of the memory), and a
collective finish gathers the write results, writes the metadata, renames iter_XXXXXXX.tmp into
place and only then replaces the tracker. With --async-save the training loop goes on while the
process writes; the next save and the end of the run wait for it. A crash or SIGKILL at any
moment leaves the previous checkpoint and a tracker that points at it. With --verify-integrity the
finished files are hashed (sha256, the ranks sharing the files) into integrity.json before the
rename, and a load checks them first.

megatron-core's torch_dist writer assumes CUDA twice (staging ends in torch.cuda.synchronize; the
finish broadcasts a CUDA tensor). The strategy below replaces those two steps with device-agnostic
ones, so CPU runs (gloo) take the same path as GPU runs.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from dataclasses import replace
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy)

from megatron.longseq.random import load_rng_state_dict, rng_state_dict
from megatron.training.rerun import gathered_states, restore_states
from megatron.training.checkpointing import (
    CHECKPOINT_VERSION, LAYOUT_ARGS, SCHEDULE, CheckpointError, check_args, fresh_dir, iteration_dir, load_position,
    loads_schedule, model_keys, model_only, on_rank_0, publish, recorded, replica_rng_state, saved_args)
from megatron.training.metrics import print_rank_0
from megatron.training.model import unwrap
from megatron.training.optimizer import MODEL_SPACE

# ---- the writer: host staging and a device-agnostic finish ---------------------------------------
def _stage_on_host(writer):
    """The write buckets in host memory, for the forked writer, which touches no device. A device
    tensor is copied into pinned memory without blocking (torch pins the destination of a
    non-blocking device-to-host copy, and its host allocator keeps the pinned blocks for the next
    save), behind one wait per device; a host tensor is taken as it is: the fork that follows
    snapshots host memory, so training goes on without reaching the writer, and a second copy would
    only double the host memory of the optimizer state. The writer keeps what is returned only, so
    the device tensors (the model's weights) are freed as soon as the caller lets go of them."""
    staged, devices = [], set()
    for file_name, storage_key, (bytes_data, tensor_data) in writer.write_buckets:
        tensors = [(item, _to_host(t.detach(), devices)) for item, t in tensor_data]
        staged.append((file_name, storage_key, (bytes_data, tensors)))
    for device in devices:  # the copies were queued on the current stream: one wait for them all
        torch.get_device_module(device).current_stream(device).synchronize()
    writer.write_buckets = staged
    return staged


def _to_host(t: torch.Tensor, devices: set) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    devices.add(t.device)
    return t.to("cpu", non_blocking=True)


def _finish_write(writer, global_metadata, dist_wrapper) -> None:
    """Collective: every rank's write results to the coordinator, which writes `.metadata`; a
    failed write on any rank raises on all of them."""
    results = dist_wrapper.gather_object(writer.retrieve_write_results())
    failed, error = None, None
    if dist_wrapper.is_coordinator:
        failed = [rank for rank, r in enumerate(results) if not isinstance(r, list)]
        try:
            if not failed:
                writer.finish(global_metadata, results)  # .metadata
        except Exception as err:  # noqa: BLE001 -- re-raised below, once the others know
            error, failed = err, [dist_wrapper.get_rank()]
    failed = dist_wrapper.broadcast_object(failed)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"checkpoint write failed on rank(s) {failed}; the previous checkpoint stays")


class HostStagedTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist save with the two CUDA-only steps replaced (see the module doc)."""

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
        save_fn, _, save_args = writer.get_save_function_and_args()
        # no save_fn: this rank has nothing to write (and nothing to stage), yet joins the finish
        stage = partial(_stage_on_host, writer) if save_fn is not None else None
        return AsyncRequest(save_fn, save_args, [partial(_finish_write, *save_state_dict_ret)], preload_fn=stage)


# ---- what is saved ---------------------------------------------------------------------------------
def _layout(pgs) -> dict:
    return {axis: pgs.size(axis) for axis in ("tp", "pp", "dp", "cp")}


def _model_sharded(chunks, pgs) -> dict:
    metadata = {"dp_cp_group": pgs.dp_cp}  # replicas over dp x cp, from our groups
    return {key: m.sharded_state_dict(metadata=metadata) for key, m in zip(model_keys(chunks), chunks)}


def _parameters(chunks):
    """(model key, parameter name, parameter) of every parameter of this rank's model chunks."""
    for key, model in zip(model_keys(chunks), chunks):
        for name, p in model.named_parameters():
            yield key, name, p


def _state_key(key: str, name: str, state: str) -> str:
    return f"{key}.{name}.{state}"


def _optimizer_sharded(chunks, model_sd: dict, states: dict, reads) -> dict:
    """Each parameter's main copy and moments as the parameter's own ShardedTensor under Megatron's
    key prefix "optimizer.state.<name>.": same global shape, offsets, tp axis and replicas.
    states[p][state]: the tensor in p's shape, for each parameter this rank saves or loads. reads(p):
    whether this rank is p's one reader at a load, or its one writer at a save, among its
    data-parallel replicas (megatron-core checks that every piece has one main replica)."""
    out = {}
    for key, name, p in _parameters(chunks):
        for state, data in states.get(p, {}).items():
            sh = make_sharded_optimizer_tensor(model_sd[key][name], data, f"optimizer.state.{state}")
            sh = replace(sh, replica_id=(*sh.replica_id[:-1], 0 if reads(p) else 1))  # the last axis: dp x cp
            out[_state_key(key, name, state)] = sh
    return out


# How the RNG object is laid out: "pp,tp" as Megatron-LM (one entry per pipeline and tensor rank,
# their dp x cp replicas drawing the same streams), so any rank order and any dp x cp resumes it;
# "rank" (one per global rank, written before) only resumes the same grid in the same order.
RNG_BY = "pp,tp"


def _rng_sharded(pgs, by: str) -> ShardedObject:
    if by == "rank":
        world, rank = dist.get_world_size(), dist.get_rank()
        return ShardedObject("rng_state", rng_state_dict(), (world,), (rank,), replica_id=0)
    shape, offset = (pgs.size("pp"), pgs.size("tp")), (pgs.index("pp"), pgs.index("tp"))
    # Megatron's list of per-replica states (see checkpointing.replica_rng_state)
    return ShardedObject("rng_state", [rng_state_dict()], shape, offset, replica_id=pgs.index("dp_cp"))


def _rng_layout(args, path: str, common: dict, pgs) -> Optional[str]:
    """The layout to read the checkpoint's RNG streams by, or None when this run starts its own:
    none saved, --no-load-rng, a model-only load, or another pipeline or tensor split (the streams
    belong to those ranks; Megatron-LM's own checkpoints record none: not read)."""
    if not common.get("rng_saved", False) or args.no_load_rng or model_only(args, path):
        return None
    saved = common.get("layout") or {}
    if common.get("rng_layout") == RNG_BY:
        return RNG_BY if all(saved.get(axis) == pgs.size(axis) for axis in ("pp", "tp")) else None
    # written by global rank; rank order is not recorded, --use-tp-pp-dp-mapping must be unchanged
    return "rank" if saved == _layout(pgs) else None


def _common(args, state, pgs) -> dict:
    """Plain values (common.pt, written by rank 0): the same on every rank."""
    common = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "args": saved_args(args, state),
        "layout": _layout(pgs),
        "iteration": state.iteration,
        SCHEDULE: state.scheduler.state_dict(),
        "num_floating_point_operations_so_far": state.flops_so_far,
        "rng_saved": not args.no_save_rng,
        "rng_layout": RNG_BY,
    }
    rerun = gathered_states(state.rerun)
    if rerun is not None:
        common["rerun_state_machine"] = rerun
    if not args.no_save_optim:
        common["optimizer_steps"] = state.optimizer.adam_steps()
        if state.optimizer.scaler is not None:
            common["grad_scaler"] = state.optimizer.scaler.state_dict()
    return common


def _sharded(state, pgs, states: Optional[dict], rng: Optional[str], reads) -> dict:
    """The tensors (and per-rank objects), each placed in the whole model; the optimizer's when
    `states` is given (see _optimizer_sharded), the RNG streams laid out by `rng` when given."""
    chunks = unwrap(state.model)
    model_sd = _model_sharded(chunks, pgs)
    sd = dict(model_sd)
    if states is not None:
        sd["optimizer"] = _optimizer_sharded(chunks, model_sd, states, reads)
    if rng:
        sd["rng_state"] = _rng_sharded(pgs, rng)
    return sd


# ---- save ------------------------------------------------------------------------------------------
class CheckpointSaver:
    """At most one save in flight. `save` stages and starts it; `finish` completes it (collective:
    every rank calls it at the same iterations)."""

    def __init__(self, args, pgs, device: torch.device):
        self.args, self.pgs, self.device = args, pgs, device
        strategy = HostStagedTorchDistSave("torch_dist", 1, cached_metadata=args.ckpt_assume_constant_structure)
        if args.ckpt_fully_parallel_save:  # the replicas over dp x cp share the writing
            strategy = FullyParallelSaveStrategyWrapper(strategy, pgs.dp_cp, args.ckpt_assume_constant_structure)
        self.strategy = strategy
        self.pending = None  # (process, finalize functions, iteration, on_done)

    def save(self, state, on_done=None) -> str:
        """Start saving `state`; waits for a save still in flight first. Returns the final path."""
        self.finish(blocking=True)
        args = self.args
        final = iteration_dir(args.save, state.iteration)
        tmp = final + ".tmp"
        on_rank_0(lambda: fresh_dir(tmp))
        writes = state.optimizer.writes
        states = None if args.no_save_optim else state.optimizer.param_space_state(writes)
        rng = None if args.no_save_rng else RNG_BY
        sd = {**_common(args, state, self.pgs), **_sharded(state, self.pgs, states, rng, writes)}
        request = dist_checkpointing.save(sd, tmp, self.strategy, async_sharded_save=True)
        self._start(request, state.iteration, on_done)
        if not args.async_save:
            self.finish(blocking=True)
        return final

    def _start(self, request: AsyncRequest, iteration: int, on_done) -> None:
        save_args = list(request.async_fn_args)
        if request.preload_fn:
            save_args[1] = request.preload_fn()  # the write buckets, now host copies
        process = None
        if request.async_fn is not None:  # None: this rank has nothing to write
            # fork, right after staging and before training goes on: the staged tensors are inherited,
            # not pickled (megatron-core's own async caller does the same), and the child writes host
            # tensors as they were at this moment; it touches no device.
            process = mp.get_context("fork").Process(target=request.async_fn, args=save_args,
                                                     kwargs=request.async_fn_kwargs, daemon=False)
            process.start()
        self.pending = (process, request.finalize_fns, iteration, on_done)  # not the request: it holds the
        # device tensors it was built from

    def _done_everywhere(self) -> bool:
        process = self.pending[0]
        done = torch.tensor([0 if process is not None and process.is_alive() else 1], device=self.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def finish(self, blocking: bool) -> Optional[int]:
        """Complete the save in flight if every rank's writer is done (or wait for them when
        blocking). Returns the iteration it published, None if none."""
        if self.pending is None or not (blocking or self._done_everywhere()):
            return None
        process, finalize_fns, iteration, on_done = self.pending
        self.pending = None
        if process is not None:
            process.join()
        for fn in finalize_fns:  # write results gathered, .metadata and metadata.json written
            fn()
        final = iteration_dir(self.args.save, iteration)
        if self.args.verify_integrity:
            write_integrity(final + ".tmp")
        publish(self.args.save, final + ".tmp", final, iteration)
        if on_done is not None:
            on_done(iteration, final)
        return iteration


# ---- integrity -------------------------------------------------------------------------------------
INTEGRITY = "integrity.json"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _hashes(path: str, names) -> dict:
    """Collective: every rank hashes its share of `names`; all ranks get all hashes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: _sha256(os.path.join(path, n)) for n in sorted(names)[rank::world]}
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    return {k: v for share in shares for k, v in share.items()}


def write_integrity(path: str) -> None:
    names = [n for n in os.listdir(path) if n != INTEGRITY]
    hashes = _hashes(path, names)

    def write():
        with open(os.path.join(path, INTEGRITY), "w") as f:
            json.dump(hashes, f, indent=1, sort_keys=True)
    on_rank_0(write)


def verify_integrity(path: str) -> None:
    """Collective: every file integrity.json names has its hash, or one line says which do not."""
    listed = os.path.join(path, INTEGRITY)
    if not os.path.isfile(listed):
        raise ValueError(f"--verify-integrity: {path} has no {INTEGRITY} (saved without --verify-integrity)")
    with open(listed) as f:
        want = json.load(f)
    missing = sorted(n for n in want if not os.path.isfile(os.path.join(path, n)))
    got = _hashes(path, [n for n in want if n not in missing])
    bad = missing + sorted(n for n, h in got.items() if h != want[n])
    if bad:
        raise ValueError(f"--verify-integrity: {path}: {len(bad)} file(s) missing or changed since saved: "
                         f"{', '.join(bad)}")


# ---- load ------------------------------------------------------------------------------------------
def _load_strategy(args, pgs):
    strategy = TorchDistLoadShardedStrategy()
    # megatron-core's exchange of the pieces each rank read is CUDA-only; on CPU every rank reads
    # its own pieces, which loads the same values.
    if args.ckpt_fully_parallel_load and args.device_type == "cuda":
        strategy = FullyParallelLoadStrategyWrapper(strategy, pgs.dp_cp)
    return strategy


def _model_args(common: dict) -> dict:
    return {k: v for k, v in recorded(common["args"]).items() if k not in LAYOUT_ARGS}  # any layout loads


def recorded_args(path: str) -> dict:
    """The model arguments the torch_dist checkpoint at `path` records, and its schedule under
    SCHEDULE (common.pt alone)."""
    common = dist_checkpointing.load_common_state_dict(path)
    return {**_model_args(common), SCHEDULE: common.get(SCHEDULE)}


def _load_targets(optimizer) -> dict:
    """What a load asks of the optimizer state: every parameter this rank owns a piece of, whole (the
    checkpoint cuts by parameter), in host memory -- not three fp32 copies of the model part on the
    device beside the model, and not the parameters only other data-parallel ranks own."""
    return {p: {state: torch.zeros(p.shape, dtype=torch.float32, device="cpu") for state in MODEL_SPACE}
            for p in optimizer.fragments_of}


def _loaded_states(loaded: dict, chunks, targets: dict) -> dict:
    """The optimizer state per owned parameter, from what the load returned: the fully parallel
    load (CUDA) hands back the pieces other ranks read as new tensors instead of filling the
    targets. A key the checkpoint lacks (a lenient --dist-ckpt-strictness) keeps its zeros."""
    return {p: {state: loaded.get(_state_key(key, name, state), targets[p][state]) for state in MODEL_SPACE}
            for key, name, p in _parameters(chunks) if p in targets}


def load_checkpoint(args, state, pgs, path: str) -> None:
    """Fill `state` from the torch_dist checkpoint at `path` (an iteration directory)."""
    if args.verify_integrity:
        verify_integrity(path)
    common = dist_checkpointing.load_common_state_dict(path)
    check_args(_model_args(common), args)
    load_optim = loads_schedule(args, path)  # the optimizer state and the schedule go together
    if load_optim and "optimizer_steps" not in common:
        raise CheckpointError(f"{path} holds no optimizer state: load with --no-load-optim")
    targets = _load_targets(state.optimizer) if load_optim else None
    rng = _rng_layout(args, path, common, pgs)
    sharded = _sharded(state, pgs, targets, rng, state.optimizer.reads_first)
    loaded = dist_checkpointing.load(sharded, path, _load_strategy(args, pgs), strict=args.dist_ckpt_strictness)
    if isinstance(loaded, tuple):  # the return_* strictness modes also hand back the mismatches
        loaded = loaded[0]
    chunks = unwrap(state.model)
    for key, model in zip(model_keys(chunks), chunks):
        model.load_state_dict(loaded[key], strict=args.dist_ckpt_strictness != "ignore_all")
    if load_optim:
        state.optimizer.load_param_states(_loaded_states(loaded.get("optimizer", {}), chunks, targets),
                                          common["optimizer_steps"])
        if state.optimizer.scaler is not None and "grad_scaler" in common:
            state.optimizer.scaler.load_state_dict(common["grad_scaler"])
    else:
        state.optimizer.reload_model_params()
    if model_only(args, path):
        return
    if load_optim:
        state.scheduler.load_state_dict(common[SCHEDULE])  # compared at start-up (check_schedule)
    if rng:
        streams = loaded["rng_state"]
        load_rng_state_dict(streams if rng == "rank" else replica_rng_state(streams, pgs))
    state.iteration = common["iteration"]
    load_position(state, common["args"])
    state.flops_so_far = common["num_floating_point_operations_so_far"]
    restore_states(state.rerun, common.get("rerun_state_machine"), log=print_rank_0)
