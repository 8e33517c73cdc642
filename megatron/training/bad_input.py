"""A bad command line (or a MEMO plan over the host budget) ends the run as one line on stderr,
printed once however many ranks the launcher started."""
from __future__ import annotations

import os
import sys
import time

from megatron.longseq.memo.alpha import HostMemoryError
from megatron.training.arguments import ArgsError


def run_main(main) -> None:
    """Run `main`; a bad command line (or a MEMO plan over the host budget) is one line on stderr
    and exit status 2."""
    try:
        main()
    except (ArgsError, HostMemoryError) as err:
        if _is_first_process():
            print(f"pretrain_gpt.py: error: {err}", file=sys.stderr, flush=True)
        else:
            # Every rank raises the same error (validation is the same everywhere; a MEMO budget
            # error is agreed across ranks). If another rank exited first, torchrun would tear down
            # rank 0 before it printed the line; so the others wait for that teardown, bounded
            # for launchers (srun) that let each task run out.
            time.sleep(REPORT_GRACE_S)
        _leave_process_group()
        sys.exit(2)


def _leave_process_group() -> None:
    """A run refused after start-up (MEMO's host budget) has its process group and store up; left
    to interpreter teardown, a thread of theirs may still be joinable when its object is destroyed,
    and the process aborts (`terminate called without an active exception`, status -6) instead
    of exiting with 2."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


REPORT_GRACE_S = 30.0


def _is_first_process() -> bool:
    """The launcher's rank 0: torchrun's RANK where it is set (under srun, torchrun numbers nodes
    by hostname, not in Slurm's order), else Slurm's task id. A process whose rank is no rank of
    its world (not a number, or outside it) reports too: then no process may be rank 0, and the
    launch error would go unsaid."""
    env = os.environ
    rank_name, world_name = ("RANK", "WORLD_SIZE") if "RANK" in env else ("SLURM_PROCID", "SLURM_NTASKS")
    try:
        rank = int(env.get(rank_name, "0"))
        world = int(env.get(world_name, rank + 1))
    except ValueError:
        return True
    return rank == 0 or not 0 <= rank < world
