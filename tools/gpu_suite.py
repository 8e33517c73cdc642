"""The GPU battery in one command: tests, benchmarks and feature runs, every result under OUT.

    python tools/gpu_suite.py OUT                                  # every part, in order
    python tools/gpu_suite.py OUT --parts tests attention smoke --budget 540   # one device command

Parts, with their seconds on one H100 (estimates where marked ~):
  tests      the GPU unit tests: kernels, varlen, GPU contracts, the one-device context-parallel
             harness (ring, double ring, Ulysses, 2D: fp32 vs float64, bf16 vs fp32, packed
             documents through varlen), MEMO and its planned allocator, GPU paths [~250; 199 before
             the harness's tests]
  attention  our attention step against the bare kernel at 32K-128K, packed 128K documents, and the
             load-balanced ring's blocks (R = 2, 4, 8) against one kernel [~150; 80 without the ring]
  bandwidth  pinned host <-> device copies, MEMO's LP input [~10]
  smoke      pretrain_gpt.py in bf16 with each feature at degree 1 (recompute, Selective
             Checkpoint++, MEMO, Seq1F1B segments, packed documents, cross-entropy chunks): its
             loss curve against the plain run's [~400]
  gpt        GPT 1.3B tokens/s and MFU at 4K-32K, and where each length's step spends its device
             time (one profiled iteration after the measured ones) [~400; one length ~75-110]
  memo-none, memo-full, memo, memo-planned
             7B-shaped layers: the longest sequence and its MFU with no / full recomputation, MEMO
             with torch's caching allocator and with the planned one, and fragmentation [~540 each]
  memo-expandable
             full recomputation and MEMO at 64K and 128K with the caching allocator's expandable
             segments (PYTORCH_CUDA_ALLOC_CONF), the fragmentation baseline the planned allocator
             has to beat [~480]
A device command has 10 minutes: give each call the parts that fit; --budget (540 s unless given)
is when no command starts and a running one is stopped. Writes OUT/suite.md (every table, each part
with its device, date and commands), OUT/suite.json (each part's status, seconds and commands) and
OUT/suite.log (every command's whole output), all three again after every command, and the running
command's output to OUT/running.log as it comes: a suite stopped from outside keeps what it did.
Without CUDA each part runs its dry version on CPU (tiny shapes: does everything run end to end)
or, where it has none, says in one line that it needs CUDA.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpt import device_name, run_pretrain, run_status, shown  # noqa: E402

from tools import cli  # noqa: E402  (benchmark_gpt put the repository on the path)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

GPU_TESTS = ["tests/unit_tests/attention/test_kernels.py", "tests/unit_tests/attention/test_varlen.py",
             "tests/unit_tests/attention/test_gpu_contract.py", "tests/unit_tests/attention/test_loopback.py",
             "tests/unit_tests/memo", "tests/unit_tests/training/test_gpu_paths.py",
             "tests/unit_tests/test_random.py", "tests/unit_tests/pipeline/test_p2p.py",
             "tests/unit_tests/test_chunked_loss.py", "tests/unit_tests/training/test_profiling.py"]

# pretrain_gpt.py's runs of the smoke part: a small Llama-shaped GPT on mock data (its samples
# hold several documents: --reset-attention-mask has something to do)
SMOKE_MODEL = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --group-query-attention "
               "--num-query-groups 4 --swiglu --normalization RMSNorm --position-embedding-type rope "
               "--disable-bias-linear --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 "
               "--global-batch-size 4 --train-iters 20 --lr 3e-4 --lr-warmup-iters 2 --hidden-dropout 0 "
               "--attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 "
               "--log-interval 1 --eval-iters 0 --seed 1234 --bf16")
SMOKE_MODEL_CPU = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
                   "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
                   "--disable-bias-linear --seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 "
                   "--global-batch-size 4 --train-iters 4 --lr 3e-4 --lr-warmup-iters 2 --hidden-dropout 0 "
                   "--attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 "
                   "--log-interval 1 --eval-iters 0 --seed 1234 --num-workers 0")
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
FEATURES = {  # name: (flags, whether its loss curve must be the plain run's)
    "plain": ("", True),
    "full recompute": (FULL, True),
    "selective recompute": ("--recompute-granularity selective", True),
    "Selective Checkpoint++": (f"{FULL} --selective-checkpoint-pp", True),
    "MEMO": ("--memo --memo-swap-fraction auto --memo-planner greedy", True),
    "Seq1F1B K=2": ("--pipe-sp-splits 2 --pipe-sp-strategy uniform_comp", True),
    "cross-entropy chunks": ("--cross-entropy-chunk-tokens 1000", True),
    "packed documents": ("--reset-attention-mask --reset-position-ids", False),  # attends within documents
}


def tool(name, *flags) -> list:
    return [PY, str(ROOT / "tools" / name), *flags]


def _tests(cuda: bool):
    if not cuda:
        return None
    return [("pytest", [PY, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider", *GPU_TESTS], 400)]


def _attention(cuda: bool):
    if cuda:
        return [("bench", tool("benchmark_attention.py", "--documents", "4096", "--ring", "2", "4", "8"), 300)]
    tiny = ["--seq-lengths", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32",
            "--iters", "1", "--warmup", "1"]
    return [("bench", tool("benchmark_attention.py", *tiny, "--documents", "64", "--ring", "2", "4"), 300)]


def _bandwidth(cuda: bool):
    if not cuda:
        return None
    return [("copies", tool("benchmark_memo.py", "--bandwidth"), 60)]


def _smoke(cuda: bool):
    model = SMOKE_MODEL if cuda else SMOKE_MODEL_CPU
    return [(name, [PY, str(ROOT / "pretrain_gpt.py"), *model.split(), *flags.split()], 240)
            for name, (flags, _) in FEATURES.items()]


def _gpt(cuda: bool):
    if cuda:
        return [("bench", tool("benchmark_gpt.py", "--profile", "--timeout", "150", "--log-dir", "/tmp/gpu_suite_gpt"),
                 600)]
    return [("bench", tool("benchmark_gpt.py", "--model", "tiny", "--seq-lengths", "128", "--iters", "3",
                           "--warmup", "1", "--no-bf16", "--profile", "--", "--num-workers", "0"), 300)]


def _expandable(cuda: bool):
    """Full recomputation and MEMO at 64K and 128K on the caching allocator's expandable segments."""
    if not cuda:
        return None
    return [("expandable", tool("benchmark_memo.py", "--expandable-segments", "--modes", "full", "memo",
                                "--seq-lengths", "65536", "131072", "--iters", "4", "--warmup", "2", "--timeout", "170",
                                "--log-dir", "/tmp/gpu_suite_memo"), 600)]


# The lengths each mode tries, until one does not run. Measured on an H100 (docs/benchmarks.md):
# no recomputation ran 32K and not 64K, full recomputation 64K and not 128K (fragmentation, before
# the chunked loss); a length past the last one that runs is what tells two modes apart.
MEMO_LENGTHS = {"none": [16384, 32768, 49152, 65536], "full": [65536, 98304, 131072, 163840, 196608]}


def _memo(mode: str, cuda: bool):
    """One MEMO benchmark mode (one device command each: a mode's lengths take up to ~540 s)."""
    if cuda:
        lengths = [str(n) for n in MEMO_LENGTHS.get(mode, MEMO_LENGTHS["full"])]
        return [(mode, tool("benchmark_memo.py", "--modes", mode, "--seq-lengths", *lengths, "--iters", "4",
                            "--warmup", "2", "--timeout", "170", "--log-dir", "/tmp/gpu_suite_memo"), 600)]
    if mode == "memo-planned":  # the planned allocator is CUDA's
        return None
    return [(mode, tool("benchmark_memo.py", "--shape", "tiny", "--num-layers", "4", "--no-bf16", "--modes", mode,
                        "--seq-lengths", "128", "--iters", "3", "--warmup", "1"), 300)]


PARTS = {"tests": _tests, "attention": _attention, "bandwidth": _bandwidth, "smoke": _smoke, "gpt": _gpt,
         "memo-none": functools.partial(_memo, "none"), "memo-full": functools.partial(_memo, "full"),
         "memo": functools.partial(_memo, "memo"), "memo-planned": functools.partial(_memo, "memo-planned"),
         "memo-expandable": _expandable}


def is_tool(cmd: list) -> bool:
    """Whether `cmd` runs one of tools/ (a benchmark), not pretrain_gpt.py or pytest."""
    return len(cmd) > 1 and Path(cmd[1]).parent == ROOT / "tools"


def table_lines(text: str) -> list:
    """The tables a tool printed: lines starting with '|' or 'device:', and each table's heading."""
    lines = text.splitlines()
    keep = []
    for i, line in enumerate(lines):
        follows = i + 1 < len(lines) and lines[i + 1].startswith("|")
        if follows and line.strip() and not line.startswith("|"):  # a heading, apart from the table before
            keep += [""] if keep else []
        if line.startswith(("|", "device:")) or (follows and line.strip() and not line.startswith("|")):
            keep.append(line)
    return keep


LOSS = re.compile(r"lm loss: ([-+0-9.eE]+|nan|inf)")
MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def smoke_table(results: dict) -> list:
    """Each feature's loss curve against the plain run's (the same seed, data and model)."""
    rows = ["| feature | status | iterations | last lm loss | max abs loss diff vs plain | ms/iter after 2 |",
            "| --- | --- | --- | --- | --- | --- |"]
    plain = [float(x) for x in LOSS.findall(results.get("plain", ("", ""))[1])]
    for name, (status, text) in results.items():
        losses = [float(x) for x in LOSS.findall(text)]
        ms = [float(x) for x in MS.findall(text)][2:]
        diffs = [abs(a - b) for a, b in zip(losses, plain)]
        diff = f"{max(diffs):.3g}" if diffs and FEATURES[name][1] else "n/a" if diffs else ""
        last = f"{losses[-1]:.6f}" if losses else ""
        speed = f"{sum(ms) / len(ms):.1f}" if ms else ""
        rows.append(f"| {name} | {status} | {len(losses)} | {last} | {diff} | {speed} |")
    return rows


class Suite:
    def __init__(self, out: Path, budget: float, cuda: bool, invoked: str = ""):
        self.out, self.end, self.cuda = out, time.monotonic() + budget, cuda
        self.report = {"device": device_name(), "date": str(datetime.date.today()), "cuda": cuda,
                       "command": invoked, "parts": {}}
        self.md = [f"# GPU suite: {self.report['device']}, {self.report['date']}", "", f"`{invoked}`", ""]
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "suite.log", "w")

    def command(self, label: str, cmd: list, timeout: float) -> tuple:
        """(status, output, seconds) of one command, within its timeout and the budget."""
        left = self.end - time.monotonic()
        if left <= 0:
            return "not run (budget)", "", 0.0
        start = time.monotonic()
        code, text = run_pretrain(cmd, min(timeout, left), self.out / "running.log")
        seconds = time.monotonic() - start
        status = run_status(code, text, timeout <= left)
        if code not in (0, None) and (status == "failed" or is_tool(cmd)):
            # a benchmark tool's table says which rows ran out of memory; its status says whether
            # every row was measured (1: not), not whether some run's output mentions memory
            status = f"failed (exit {code})"
        self.log.write(f"\n#### {label}: {shown(cmd)}\n#### {status} in {seconds:.0f} s\n{text}")
        self.log.flush()
        (self.out / "running.log").unlink()  # in suite.log now
        return status, text, seconds

    def part(self, name: str) -> bool:
        """Run one part; False if a command of it did not end well."""
        commands = PARTS[name](self.cuda)
        print(f"== {name}", flush=True)
        if commands is None:
            print(f"{name}: needs CUDA, skipped", flush=True)
            self.md += [f"## {name}", "", "needs CUDA, skipped", ""]
            self.report["parts"][name] = {"status": "skipped (needs CUDA)"}
            return True
        self.md += [f"## {name}", ""]
        runs, results = [], {}
        for label, cmd, timeout in commands:
            status, text, seconds = self.command(f"{name}/{label}", cmd, timeout)
            print(f"{name}/{label}: {status} in {seconds:.0f} s", flush=True)
            runs.append({"label": label, "command": shown(cmd), "status": status, "seconds": round(seconds, 1)})
            results[label] = (status, text)
            if name != "smoke":
                self.md += [f"`{shown(cmd)}`: {status}, {seconds:.0f} s", ""] + self._tables(name, text) + [""]
            self.report["parts"][name] = {"status": "running", "commands": runs}
            self.save()
        if name == "smoke":
            commands = [f"- {r['label']}: `{r['command']}`" for r in runs]
            self.md += smoke_table(results) + ["", "Commands:", ""] + commands
            self.md.append("")
        ok = all(r["status"] == "ok" for r in runs)
        self.report["parts"][name] = {"status": "ok" if ok else "not all ok", "commands": runs}
        self.save()
        return ok

    @staticmethod
    def _tables(name: str, text: str) -> list:
        if name == "tests":
            return [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))] + text.splitlines()[-1:]
        return table_lines(text)

    def save(self) -> None:
        """suite.md and suite.json as they stand, each replaced whole (never half written)."""
        texts = {"suite.md": "\n".join(self.md) + "\n", "suite.json": json.dumps(self.report, indent=1) + "\n"}
        for name, text in texts.items():
            (self.out / f".{name}").write_text(text)
            os.replace(self.out / f".{name}", self.out / name)

    def close(self) -> None:
        self.save()
        self.log.close()


def main(argv=None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("out", type=Path, help="directory for suite.md, suite.json and suite.log")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="the parts to run, in order")
    p.add_argument("--budget", type=cli.positive_float, default=540.0,
                   help="seconds after which no command starts and a running one is stopped (a device "
                        "command's 10 minutes less a minute for installing and copying back)")
    args = p.parse_args(argv)
    unusable = cli.make_directory(args.out)  # before the device is asked its name: the record needs a place
    if unusable:
        p.error(f"argument out: {unusable}")
    invoked = shown([__file__, *(sys.argv[1:] if argv is None else argv)])
    # nvidia-smi, not torch: this process stays off the GPU its commands use
    suite = Suite(args.out, args.budget, device_name() != "CPU", invoked)
    ok = True
    try:
        for name in args.parts:
            ok = suite.part(name) and ok
    finally:
        suite.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
