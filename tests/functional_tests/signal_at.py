"""pretrain_gpt.py, where one rank is sent a signal while it runs iteration N (after the step's
compute, before the end-of-iteration checks), as a scheduler's signal strikes one process. Used
by test_functional.py for --exit-signal-handler.

    python tests/functional_tests/signal_at.py SIGNAL N RANK <pretrain_gpt.py flags>    (per rank)
"""
import os
import runpy
import signal
import sys
from pathlib import Path

from megatron.training import training

ROOT = Path(__file__).resolve().parents[2]


def signalling_step(signum: int, nth: int, rank: int):
    real_step, steps = training.train_step, []

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        steps.append(None)
        if len(steps) == nth and int(os.environ["RANK"]) == rank:
            os.kill(os.getpid(), signum)
        return out

    return step


if __name__ == "__main__":
    training.train_step = signalling_step(signal.Signals[sys.argv[1]], int(sys.argv[2]), int(sys.argv[3]))
    sys.argv = [str(ROOT / "pretrain_gpt.py")] + sys.argv[4:]
    runpy.run_path(sys.argv[0], run_name="__main__")
