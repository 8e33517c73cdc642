"""pretrain_gpt.py, killed (SIGKILL, its whole process group: the trainer and its checkpoint writers)
while the N-th --async-save is being written: once the writer has put a first data file on disk,
before the save is finished. Used by test_functional.py as a node failure would strike.

    python tests/functional_tests/kill_during_save.py N <pretrain_gpt.py flags>
"""
import glob
import os
import runpy
import signal
import sys
import time
from pathlib import Path

from megatron.training import dist_ckpt

ROOT = Path(__file__).resolve().parents[2]


def killing_start(nth: int):
    real_start = dist_ckpt.CheckpointSaver._start
    started = []

    def start(self, request, iteration, on_done):
        real_start(self, request, iteration, on_done)
        started.append(iteration)
        if len(started) == nth:
            tmp = dist_ckpt.iteration_dir(self.args.save, iteration) + ".tmp"
            deadline = time.time() + 60
            while not glob.glob(os.path.join(tmp, "*.distcp")) and time.time() < deadline:
                time.sleep(0.001)
            os.killpg(0, signal.SIGKILL)

    return start


if __name__ == "__main__":
    dist_ckpt.CheckpointSaver._start = killing_start(int(sys.argv[1]))
    sys.argv = [str(ROOT / "pretrain_gpt.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
