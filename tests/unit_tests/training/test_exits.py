"""Exit conditions (exits.py): every rank stops after the same iteration, whichever rank's clock
ran out or got the signal; an interval alone costs no collective; the handler is put back."""
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron.training.exits import ExitWatch
from tests.unit_tests.dist_utils import run_ranks


def watch(interval=None, minutes=None, handler=False, sig="SIGUSR1", start=None):
    args = SimpleNamespace(exit_interval=interval, exit_duration_in_mins=minutes, exit_signal_handler=handler,
                           exit_signal=sig)
    return ExitWatch(args, time.perf_counter() if start is None else start)


def _signal_to_one_rank():
    """Rank 1 alone gets the signal during iteration 3: both ranks go on after 1 and 2 and stop
    after 3, and the signal does not kill the process."""
    exits = watch(handler=True)
    exits.install()
    try:
        reasons = []
        for iteration in (1, 2, 3):
            if iteration == 3 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            reasons.append(exits.reason(iteration))
        assert reasons == [None, None, "on SIGUSR1 at iteration 3"], reasons
    finally:
        exits.uninstall()


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_iteration():
    run_ranks(_signal_to_one_rank, 2)


def _one_clock_late():
    """Rank 0 started 10 minutes ago (a slow start-up on one node), rank 1 just now: with a
    5-minute limit both stop."""
    start = time.perf_counter() - (600 if dist.get_rank() == 0 else 0)
    assert watch(minutes=5.0, start=start).reason(1) == "after 5 minutes (--exit-duration-in-mins) at iteration 1"
    assert watch(minutes=60.0, start=start).reason(1) is None


def test_one_rank_past_the_duration_stops_every_rank():
    run_ranks(_one_clock_late, 2)


def test_an_interval_alone_needs_no_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was run")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    exits = watch(interval=5)
    assert [exits.reason(i) for i in (4, 5)] == [None, "at iteration 5"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR2"])
def test_the_handler_is_put_back(sig):
    signum = getattr(signal, sig)
    before = signal.getsignal(signum)
    exits = watch(handler=True, sig=sig)
    exits.install()
    assert signal.getsignal(signum) == exits._note
    exits.uninstall()
    assert signal.getsignal(signum) is before


def test_sigterm_to_the_whole_job_saves_and_exits_with_loader_workers(tmp_path):
    """Slurm signals every process of a step, torchrun a rank's process group: the loader workers
    get the signal too. They leave it to the rank (torch's handler in them would die of it, and the
    rank with it, mid-save), which finishes its iteration, saves and exits 0."""
    import subprocess
    import sys

    from tests.functional_tests.run import ROOT
    from tests.unit_tests.dist_utils import child_env

    flags = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
             "--mock-data --tokenizer-type NullTokenizer --vocab-size 200 --distributed-backend gloo --lr 1e-3 "
             f"--train-iters 100000 --eval-iters 0 --log-interval 1 --num-workers 2 --exit-signal-handler "
             f"--save {tmp_path}").split()
    run = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py")] + flags, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=child_env(), start_new_session=True)
    lines = []
    for line in run.stdout:  # until training is under way, with its workers up
        lines.append(line)
        if "iteration        3/" in line:
            break
    os.killpg(run.pid, signal.SIGTERM)  # the rank and its loader workers, as Slurm and torchrun signal
    rest, _ = run.communicate(timeout=120)
    assert run.returncode == 0, "".join(lines) + rest
    assert "exiting program on SIGTERM" in rest and (tmp_path / "latest_checkpointed_iteration.txt").is_file()
