"""Process start-up: ranks from torchrun or Slurm, the process group, the rank grid, the seeds."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.longseq.collectives import all_reduce_values
from megatron.longseq.parallel_state import ProcessGroups, RankGrid, build_process_groups
from megatron.longseq.random import seed_everything
from megatron.training.arguments import ArgsError


@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str = "torchrun"  # "torchrun", "srun" (one task per rank) or "none"


def launch_env() -> LaunchEnv:
    """torchrun exports RANK/WORLD_SIZE/LOCAL_RANK; `srun python pretrain_gpt.py` exports
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (MASTER_ADDR/PORT come from the batch script)."""
    if "RANK" in os.environ:
        return LaunchEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in os.environ:
        return LaunchEnv(int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]),
                         int(os.environ.get("SLURM_LOCALID", 0)), "srun")
    return LaunchEnv(0, 1, 0, "none")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(args) -> ProcessGroups:
    """Init the default group on the backend chosen in validation, then every grid group."""
    env = launch_env()
    if env.world_size == 1:  # a plain `python pretrain_gpt.py` run
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if args.device_type == "cuda":
        _claim_gpu(args, env)
    if args.deterministic_mode:
        _deterministic(args)
    dist.init_process_group(
        backend=args.distributed_backend, rank=env.rank, world_size=env.world_size,
        timeout=timedelta(minutes=args.distributed_timeout_minutes),
    )
    # The world group's first collective fixes its device. Were it megatron-core's dataset barrier,
    # NCCL would guess: global rank mod the visible GPUs, another rank's GPU on a node that runs
    # fewer ranks than it has GPUs.
    all_reduce_values([0.0])
    grid = RankGrid(world_size=env.world_size, tp=args.tensor_model_parallel_size,
                    pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
                    hp=args.head_parallel_size, inner_ring=args.cp_inner_ring_size, placement=args.cp_placement,
                    order=rank_order(args), instances=args.num_distributed_optimizer_instances)
    pgs = build_process_groups(grid, args.distributed_timeout_minutes, args.virtual_pipeline_chunks > 1)
    if args.device_type == "cuda":
        create_lone_communicators(pgs, device_of(args))
    # Megatron: the same seed on every tp rank of a stage, a different one per pipeline stage.
    seed_everything(args.seed + 100 * pgs.index("pp"), pgs.index("tp"), device_of(args))
    return pgs


def create_lone_communicators(pgs: ProcessGroups, device: torch.device) -> None:
    """NCCL makes a group's communicator, and takes device memory for it, at the group's first
    collective. A group of one rank is first used wherever the trainer reduces over an axis of
    size 1: megatron-core's loss all-reduces over tp at the end of the first forward, the step's
    memory peak (a 64K MEMO run on one H100 ran out of memory in iteration 1 at an NCCL allocation).
    Those communicators are made now, before the model takes the memory; each has this rank alone
    in it, so the ranks need no common order."""
    lone = {id(g): g for g in pgs.groups.values() if g is not None and dist.get_world_size(g) == 1}
    for group in lone.values():
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def _claim_gpu(args, env: LaunchEnv) -> None:
    """This rank's GPU. The planned allocator goes in first: torch refuses to swap an initialised
    allocator, and set_device already initialises CUDA (device_count does not)."""
    if args.memo and args.memo_allocator == "planned":
        from megatron.longseq.memo.allocator import install

        install()
    torch.cuda.set_device(gpu_index(env, torch.cuda.device_count()))


def gpu_index(env: LaunchEnv, visible: int) -> int:
    """This rank's GPU among the `visible` ones: its local rank, or the one GPU a task sees of its
    own (srun --gpus-per-task=1, no torchrun). More local ranks than GPUs is refused: NCCL would
    find two ranks on one GPU at the first collective, far from the cause."""
    if visible == 1 and env.launcher == "srun":
        return 0
    if env.local_rank >= visible:
        raise ArgsError(f"local rank {env.local_rank} but {visible} GPU(s) visible to this process: start at "
                        f"most one process per GPU (torchrun --nproc-per-node, srun --gpus-per-task)")
    return env.local_rank


def _deterministic(args):
    torch.use_deterministic_algorithms(True)
    if args.device_type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NCCL_ALGO", "Ring")  # tree/NVLS reductions change the summation order


def rank_order(args) -> str:
    return "tp-cp-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-dp-pp"


def device_of(args) -> torch.device:
    if args.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
