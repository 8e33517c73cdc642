"""Run a test body on N gloo ranks (spawned processes), or in a one-rank world in this process.

Assertions run inside the ranks; a failure on any rank fails the test with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # A short timeout: a rank that fails leaves the others waiting in a collective; the spawner
    # then reports the failing rank's traceback and terminates the rest.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=180))
    fn(*args)
    dist.barrier()
    dist.destroy_process_group()


# Ranks start from a fork server that imported these once: a spawned rank would spend ~7 s of CPU
# importing torch and megatron-core, and the suite starts a few hundred ranks on two cores. The
# server only imports (no threads, no process group), so forking from it is as clean as spawning.
PRELOAD = ["torch", "torch.distributed", "megatron.longseq", "megatron.core.models.gpt", "megatron.training.training",
           "tests.unit_tests.dist_utils"]


def run_ranks(fn, world_size: int, *args) -> None:
    """fn(*args) on `world_size` gloo ranks, fresh processes. fn must be a module-level function."""
    mp.set_forkserver_preload(PRELOAD)
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                       join=True, start_method="forkserver")


def child_env() -> dict:
    """The environment for a child process that builds its own world: without this process's
    MASTER_ADDR/MASTER_PORT (set by init_single_rank_world, its port still held here), on one
    thread whatever the caller's OMP_NUM_THREADS, as tests/functional_tests/run.py runs its cases:
    runs compared bitwise must sum in the same order (the thread count splits CPU reductions)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1")


def init_single_rank_world() -> None:
    """A gloo world of one in this process (idempotent), with megatron-core's parallel state."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)


_LAST = {}  # the one-rank world of this process: the grid built last, by its arguments


def grid_groups(tp=1, pp=1, cp=1, hp=1, inner_ring=None, placement="head-first", order="tp-cp-dp-pp", instances=1):
    """Every rank: build the grid of the current world and its groups.

    In the one-rank world that lives as long as pytest, the same grid is built once and handed
    out again: torch keeps every gloo group (and its ~80 threads) until the world ends, and
    hundreds of tests rebuilding it left thousands of threads whose polling took a core from the
    multi-rank tests running beside them."""
    from megatron.core import parallel_state as mpu
    from megatron.longseq.parallel_state import RankGrid, build_process_groups

    key = (dist.get_world_size(), tp, pp, cp, hp, inner_ring, placement, order, instances)
    if dist.get_world_size() == 1 and _LAST.get("key") == key and mpu.model_parallel_is_initialized():
        return _LAST["groups"]
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    grid = RankGrid(world_size=dist.get_world_size(), tp=tp, pp=pp, cp=cp, hp=hp,
                    inner_ring=inner_ring, placement=placement, order=order, instances=instances)
    groups = build_process_groups(grid)
    _LAST.update(key=key, groups=groups)
    return groups


def run_groups(args):
    """The grid and groups the trainer builds for validated `args` (initialize's), every axis."""
    from megatron.training.initialize import rank_order

    return grid_groups(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                       cp=args.context_parallel_size, hp=args.head_parallel_size, inner_ring=args.cp_inner_ring_size,
                       placement=args.cp_placement, order=rank_order(args),
                       instances=args.num_distributed_optimizer_instances)
