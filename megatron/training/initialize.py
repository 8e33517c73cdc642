"""Process start-up: ranks from torchrun or Slurm, the process group, the rank grid, the seeds."""
from __future__ import annotations

import os
import re
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
    """torchrun exports RANK/WORLD_SIZE/LOCAL_RANK; an srun task SLURM_PROCID/SLURM_LOCALID and the
    step's SLURM_STEP_NUM_TASKS. A batch script itself has SLURM_PROCID 0 and the job's SLURM_NTASKS
    but no step: a plain `python pretrain_gpt.py` there is one rank, not rank 0 of a world that
    never starts. Inconsistent variables are one line here, not a hang at the rendezvous."""
    env = os.environ
    if "RANK" in env:
        _require_env(("RANK", "WORLD_SIZE"), "RANK and WORLD_SIZE come together (start with torchrun, or set both)")
        return _checked(LaunchEnv(_int_env("RANK"), _int_env("WORLD_SIZE"), _int_env("LOCAL_RANK", 0)))
    if "SLURM_STEP_NUM_TASKS" in env or "SLURM_STEP_ID" in env:
        world = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        _require_env(("SLURM_PROCID", world), f"an srun task has SLURM_PROCID and {world}")
        return _checked(LaunchEnv(_int_env("SLURM_PROCID"), _int_env(world), _int_env("SLURM_LOCALID", 0), "srun"))
    return LaunchEnv(0, 1, 0, "none")


def _require_env(names, why: str) -> None:
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise ArgsError(f"{' and '.join(missing)} unset: {why}")


def _int_env(name: str, default: int | None = None) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ArgsError(f"the environment's {name}={text!r} is not a whole number") from None


def _checked(env: LaunchEnv) -> LaunchEnv:
    if not 0 <= env.rank < env.world_size:
        raise ArgsError(f"this process's rank {env.rank} is outside a world of {env.world_size} "
                        f"(from {env.launcher}'s variables): no rank would host the rendezvous")
    return env


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'gpu[07-09,12]-ib,cpu3' -> 'gpu07-ib'."""
    first = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist)[0]  # up to the first comma outside []
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m[1])[0], first)


def _srun_rendezvous() -> None:
    """srun starts the ranks itself (no torchrun): unless the script exported them, the first
    host of the step hosts the store, on a port from the job id (10000-29999, below Linux's
    ephemeral range; two jobs sharing a node get different ports unless their ids are 20000 apart)."""
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if nodes:
        os.environ.setdefault("MASTER_ADDR", first_host(nodes))
    if "SLURM_JOB_ID" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(10000 + _int_env("SLURM_JOB_ID") % 20000))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous(env: LaunchEnv) -> None:
    if env.world_size == 1:  # a plain `python pretrain_gpt.py` run
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    elif env.launcher == "srun":
        _srun_rendezvous()
    _require_env(("MASTER_ADDR", "MASTER_PORT"), f"{env.world_size} ranks need the rank-0 host's address and port "
                                                  "(torchrun sets them, srun's come from its node list and job id; "
                                                  "export them otherwise)")


def initialize_distributed(args) -> ProcessGroups:
    """Init the default group on the backend chosen in validation, then every grid group."""
    env = launch_env()
    _rendezvous(env)
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
    """This rank's GPU among the `visible` ones: its local rank; a task srun started with GPUs of
    its own (--gpus-per-task, which srun exports as SLURM_GPUS_PER_TASK, or a single one) sees them
    numbered from 0 whatever its local rank, so its local rank modulo them. Otherwise more local
    ranks than GPUs is refused: NCCL would find two ranks on one GPU at the first collective, far
    from the cause."""
    own = "SLURM_GPUS_PER_TASK" in os.environ or visible == 1
    if env.launcher == "srun" and own:
        return env.local_rank % visible
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
