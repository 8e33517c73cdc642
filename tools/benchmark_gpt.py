"""Throughput benchmark: tokens/s/GPU and MFU of pretrain_gpt.py over a range of sequence lengths.

    python tools/benchmark_gpt.py                      # GPT 1.3B shape, bf16, 4K..32K, one GPU
    python tools/benchmark_gpt.py --seq-lengths 8192 --model 1.3b --iters 20 -- --recompute-granularity full ...

Each sequence length is one pretrain_gpt.py run on mock data with --log-throughput; the first
--warmup iterations (at least two) are dropped and the rest averaged. Every iteration holds --tokens-per-iter tokens
(micro-batch 1, gradient accumulation up to it), so short and long sequences do the same work per
step. A run that runs out of memory is retried with full recompute, and the table says so.
Prints a markdown table with device, date and the exact command of each row. Every run is stopped
after --timeout seconds, and none starts once --budget seconds have gone (a row says so); with
--log-dir each run's whole output is kept there as it runs. Exits with status 1 when a row has no
measurement (out of memory even with full recompute, failed, stopped): the table is still printed.
"""
from __future__ import annotations

import ctypes
import datetime
import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import cli  # noqa: E402

UNMEASURED = 1  # the exit status of a benchmark with a row that has no measurement

MODELS = {
    # GPT-3 XL (1.3B): 24 layers, h 2048, 16 heads, GPT-2 vocabulary.
    "1.3b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --vocab-size 50257",
    "tiny": "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --vocab-size 1000",
}

FIELDS = {
    "ms": r"elapsed time per iteration \(ms\): ([0-9.]+)",
    "tflops": r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.e+-]+)",
    "tokens": r"tokens per second per GPU: ([0-9.]+)",
    "mfu": r"MFU: ([0-9.]+)%",
}


def command(args, seq: int, recompute: bool):
    gbs = max(1, args.tokens_per_iter // seq)
    # --profile: one more iteration under torch's profiler, and one after it that pays for writing it
    iters = args.iters + 2 if args.profile else args.iters
    flags = (f"{MODELS[args.model]} --seq-length {seq} --max-position-embeddings {seq} "
             f"--position-embedding-type rope --micro-batch-size 1 --global-batch-size {gbs} "
             f"--train-iters {iters} --lr 1e-4 --lr-warmup-iters 0 --hidden-dropout 0 "
             f"--attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --log-interval 1 "
             f"--log-throughput --eval-iters 0 --num-workers 2").split()
    if args.bf16:
        flags.append("--bf16")
    if recompute:
        flags += "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
    if args.profile:
        flags += (f"--profile --use-pytorch-profiler --profile-step-start {args.iters} "
                  f"--profile-step-end {args.iters + 1}").split()
    return [sys.executable, str(ROOT / "pretrain_gpt.py")] + flags + args.extra


def parse(stdout: str, warmup: int, upto: int = None):
    """Means over the logged iterations after the first `warmup` (at least two: as Megatron's, the
    trainer's second line averages the first two iterations, start-up included), up to the
    `upto`-th."""
    rows = [line for line in stdout.splitlines() if "iteration" in line and "lm loss" in line][max(warmup, 2):upto]
    if not rows:
        return None
    out = {}
    for key, pattern in FIELDS.items():
        values = [float(m.group(1)) for m in (re.search(pattern, r) for r in rows) if m]
        out[key] = mean(values) if values else None
    return out


# torch's "CUDA out of memory", the planned allocator's "out of device memory", cuDNN's and
# cuBLAS's *_STATUS_ALLOC_FAILED, and NCCL's "Failed to CUDA calloc async 24 bytes" (on an H100 a
# collective after a full device failed so, not the tensor allocation)
OOM = re.compile(r"out of (device )?memory|OutOfMemoryError|ALLOC_FAILED|Failed to CUDA [cm]alloc", re.IGNORECASE)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """In a run's process, before it starts: SIGKILL when the process that started it ends (Linux).
    A run has a session of its own (its data-loader workers go with it when it is stopped), out of
    reach of a kill of the starter's process group: without this, a tool stopped at its own time
    limit -- the GPU suite stopping a benchmark, the device command stopping the suite -- would
    leave its run on the GPU, beside the next one."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the starter ended before the request was made
        os._exit(1)


def run_pretrain(cmd, timeout: float, log_path=None):
    """(exit code, or None when stopped after `timeout` seconds; everything it printed). The
    output goes to a file as it runs (`log_path`, or a temporary one): a stopped run keeps it."""
    with open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                preexec_fn=functools.partial(_die_with_parent, os.getpid()),
                                env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1"))
        try:
            code = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its data-loader workers too
            proc.wait()
            code = None
        log.seek(0)
        return code, log.read()


def run_status(code, text: str, own_timeout: bool) -> str:
    """A run's status from run_pretrain's exit code (None: stopped at its time limit, which was
    its own --timeout when `own_timeout`, else the budget's end) and its output."""
    if code == 0:
        return "ok"
    if code is None:
        return "timeout" if own_timeout else "stopped (budget)"
    return "out of memory" if OOM.search(text) else "failed"


class Runs:
    """The runs of one benchmark: each within --timeout, none started after --budget seconds."""

    def __init__(self, args, prefix: str):
        self.args, self.prefix, self.end = args, prefix, time.monotonic() + args.budget
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)

    def __call__(self, cmd, name: str):
        """(status: "ok", "out of memory", "timeout", "stopped (budget)", "failed" or "not run
        (budget)"; the output). A run still going when the budget ends is stopped there."""
        left = self.end - time.monotonic()
        if left <= 0:
            return "not run (budget)", ""
        log = os.path.join(self.args.log_dir, f"{self.prefix}_{name}.log") if self.args.log_dir else None
        code, text = run_pretrain(cmd, min(self.args.timeout, left), log)
        status = run_status(code, text, self.args.timeout <= left)
        if status != "ok":  # the evidence of a row that says failed, out of memory or timeout
            print(f"---- {name}: {status}; the end of its output:\n{text[-3000:]}", file=sys.stderr, flush=True)
        return status, text


def add_run_limits(p, timeout: float = 540.0) -> None:
    p.add_argument("--timeout", type=cli.positive_float, default=timeout, help="seconds one run may take")
    p.add_argument("--budget", type=cli.positive_float, default=float("inf"),
                   help="seconds after which no run starts and a running one is stopped")
    p.add_argument("--log-dir", help="keep each run's output here (made if missing)")


def measured_iterations(iters: int, warmup: int) -> int:
    """How many logged iterations the means average: parse() drops max(warmup, 2)."""
    return iters - max(warmup, 2)


def refusal(args, cmd) -> str:
    """Why the runs could not measure anything (empty if they can), before the first one starts:
    no iteration left after the dropped ones, a log directory that cannot be made or written, or
    pretrain_gpt.py flags (`cmd`, one row's command) its parser refuses."""
    if measured_iterations(args.iters, args.warmup) < 1:
        return (f"--iters {args.iters} leaves no iteration to measure: the means drop the first "
                f"max(--warmup, 2) = {max(args.warmup, 2)} logged iterations")
    unusable = cli.make_directory(args.log_dir) if args.log_dir else ""
    if unusable:
        return f"--log-dir: {unusable}"
    errors = trainer_flag_errors(cmd)
    return f"pretrain_gpt.py flags: {'; '.join(errors)}" if errors else ""


def trainer_flag_errors(cmd) -> list:
    """What pretrain_gpt.py's parser says of a run's flags (parsing only: no torch in this process)."""
    from megatron.training.arguments import ArgsError, parse

    flags = cmd[next(i for i, c in enumerate(cmd) if c.endswith("pretrain_gpt.py")) + 1:]
    try:
        return parse(flags)[1]
    except ArgsError as err:
        return [str(err)]


def profile_lines(text: str) -> list:
    """pretrain_gpt.py --profile's table (markdown) from a run's output."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "] profile of " in line), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def run(args, seq: int, runs: Runs):
    """(metrics or None, full recompute?, command, status, profile table lines): out of memory is
    retried with full recompute."""
    for recompute in (False, True):
        cmd = command(args, seq, recompute)
        status, text = runs(cmd, f"{seq}_{'full' if recompute else 'none'}")
        if status == "ok":
            res = parse(text, args.warmup, args.iters)
            return res, recompute, cmd, status if res else "no iteration after the warm-up", profile_lines(text)
        if status != "out of memory":
            break
    return None, recompute, cmd, status, []


def shown(cmd) -> str:
    """The command of a table row: environment settings, the script and its flags, paths relative
    to the repository (the `env` launcher and the interpreter left out)."""
    return " ".join(shlex.quote(c) for c in cmd if c not in ("env", sys.executable)).replace(str(ROOT) + "/", "")


def device_name() -> str:
    """The first visible GPU's name from nvidia-smi: torch would start CUDA in this process and hold
    a context's memory beside every run."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", visible],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "CPU"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "CPU"


def arguments(argv):
    p = cli.parser(__doc__)
    p.add_argument("--model", choices=sorted(MODELS), default="1.3b", help="the model's shape")
    p.add_argument("--seq-lengths", type=cli.positive_int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="one run per length")
    p.add_argument("--tokens-per-iter", type=cli.positive_int, default=32768,
                   help="tokens of one iteration (gradient accumulation up to it)")
    p.add_argument("--iters", type=cli.positive_int, default=12,
                   help="iterations of a run, more than max(--warmup, 2)")
    p.add_argument("--warmup", type=cli.nonnegative_int, default=4,
                   help="iterations left out of the means (at least two are)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="run in fp32")
    p.add_argument("--profile", action="store_true",
                   help="profile one more iteration after the measured ones (torch's profiler) and print its ops "
                        "by device time after the table; it and the next are not in the means")
    add_run_limits(p)
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = p.parse_args(argv)
    refused = refusal(args, command(args, args.seq_lengths[0], False))
    if refused:
        p.error(refused)
    return args


def main(argv=None):
    args = arguments(argv)
    runs = Runs(args, "gpt")
    profiles, unmeasured = [], 0
    print(f"device: {device_name()} | date: {datetime.date.today()} | model: {args.model} | "
          f"{'bf16' if args.bf16 else 'fp32'} | {args.tokens_per_iter} tokens per iteration")
    print("| seq | tokens/s/GPU | TFLOP/s/GPU | MFU | ms/iter | recompute | command |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in args.seq_lengths:
        res, recompute, cmd, status, profile = run(args, seq, runs)
        # the heading names the length: every length's profile is "of iteration N"
        profiles += [f"Profile at {seq}: {profile[0]}"] + profile[1:] + [""] if profile else []
        if res is None:
            unmeasured += 1
            print(f"| {seq} | {status} | | | | {'full' if recompute else 'none'} | `{shown(cmd)}` |", flush=True)
            continue
        mfu = f"{res['mfu']:.1f}%" if res["mfu"] is not None else "n/a"
        print(f"| {seq} | {res['tokens']:.0f} | {res['tflops']:.1f} | {mfu} | {res['ms']:.0f} | "
              f"{'full' if recompute else 'none'} | `{shown(cmd)}` |", flush=True)
    if profiles:
        print("\n" + "\n".join(profiles), flush=True)
    if unmeasured:  # the table is the record; the status tells a caller that it is not whole
        print(f"{unmeasured} of {len(args.seq_lengths)} lengths not measured", file=sys.stderr, flush=True)
    return UNMEASURED if unmeasured else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
