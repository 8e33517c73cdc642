"""Run functional cases through torchrun and read their loss curves; regenerate golden files.

    python -m tests.functional_tests.run gpt_base_tp2      # run one case, print its curve
    python -m tests.functional_tests.run --generate        # regenerate every single-rank golden file

A regeneration runs in a fresh directory (a new corpus from make_corpus), prints each metric's
largest relative change against the file it replaces, and refuses a loss curve that moved beyond
GOLDEN_RTOL (or one that does not fall) unless --accept-change says the move is intended. The
machine's time and memory are kept from the old file unless --record-machine asks for this one's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from tests.functional_tests.cases import BY_NAME, CASES, COMMON, TRAIN_ITERS, Case
from tests.unit_tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")
# Megatron-LM's golden-value metrics, read as its test harness reads them: tensorboard scalars of
# the run, values rounded to 5 decimals. Loss and zero count are properties of the numerics; time
# and memory are the machine's, kept for the record.
METRICS = ("lm loss", "num-zeros", "mem-allocated-bytes", "mem-max-allocated-bytes", "iteration-time")
MACHINE_METRICS = ("mem-allocated-bytes", "mem-max-allocated-bytes", "iteration-time")
GOLDEN_DECIMALS = 5
# Golden files may come from another machine than the one testing: fp32 GEMM blocking differs between CPU ISAs
# (~1e-7 relative per op) and Adam amplifies small relative gradient changes over 30 steps, so
# allow 1e-4, still ~3000x smaller than the 25-30% the loss falls in these runs. bf16 rounds at
# 2^-8 per op (its curve sits 1.2e-4 away from fp32's here): 2e-3.
GOLDEN_RTOL = {"fp32": 1e-4, "bf16": 2e-3, "fp16": 5e-4}  # fp16 rounds at 2^-11, 8x finer than bf16
# Read besides them: layouts compare their gradient norms too (an AdamW loss curve barely moves when
# a gradient is scaled wrong, say by a missing 1/dp on some parameters: clipping aside, Adam divides
# the scale out), in full precision (the log prints 3 decimals).
COMPARED = ("grad-norm",)
# What makes a run write them (the log only; the numerics are the same without).
METRIC_FLAGS = ["--log-num-zeros-in-grad", "--log-memory-to-tensorboard", "--log-timers-to-tensorboard"]


def make_corpus(directory: Path) -> str:
    """A deterministic corpus of token ids with documents of varied length, preprocessed into an
    indexed dataset with tools/preprocess_data.py. Returns the --data-path prefix."""
    prefix = directory / "corpus"
    if not Path(f"{prefix}_text_document.idx").exists():
        directory.mkdir(parents=True, exist_ok=True)
        rng = random.Random(1234)
        with open(directory / "corpus.jsonl", "w") as f:
            for _ in range(400):
                start = rng.randrange(0, 900)
                ids = [(start + i) % 999 for i in range(rng.randint(10, 150))]  # learnable: next = id + 1
                f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
        subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                        str(directory / "corpus.jsonl"), "--output-prefix", str(prefix),
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "999", "--append-eod"],
                       check=True, capture_output=True)
    return f"{prefix}_text_document"


def command(case: Case, extra: List[str], data_prefix: Optional[str]) -> List[str]:
    flags = list(COMMON) + case.flags + extra
    if case.data:
        i = flags.index("--mock-data")
        flags[i : i + 1] = ["--data-path", data_prefix, "--split", "100,0,0"]
    port = str(free_port())
    script = ROOT / "pretrain_gpt.py"
    if "--sequence-parallel" in flags:  # a GPU-only flag, run on CPU ranks by its launcher
        script = ROOT / "tests" / "functional_tests" / "sequence_parallel_on_host.py"
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(case.nproc),
            "--master-port", port, str(script)] + flags


class Curve(dict):
    """{iteration: lm loss} of a run, each iteration's own as tensorboard has it (a printed line
    averages its interval, and the second line of a process also the first iteration, as
    Megatron's), with the run's standard output as `.log` and its tensorboard scalars of METRICS
    and COMPARED as `.metrics` ({metric: {iteration: value}})."""

    log = ""
    metrics: Dict[str, Dict[int, float]] = {}


def read_metrics(tensorboard_dir: Path) -> Dict[str, Dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    present = set(events.Tags()["scalars"])
    return {m: {e.step: e.value for e in events.Scalars(m)} for m in METRICS + COMPARED if m in present}


def run_case(case: Case, workdir: Path, extra: List[str] = (), timeout: int = 600) -> Curve:
    """Run `case`; return {iteration: lm loss} (and its log). Raises with the output tail on failure."""
    data = make_corpus(workdir / "corpus") if case.data else None
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    tensorboard = Path(tempfile.mkdtemp(prefix=f"tb-{case.name}-", dir=workdir))
    # the caller's flags last: a test's own --tensorboard-dir wins
    flags = METRIC_FLAGS + ["--tensorboard-dir", str(tensorboard)] + list(extra)
    proc = subprocess.run(command(case, flags, data), cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    metrics = read_metrics(Path(last_value(flags, "--tensorboard-dir")))
    curve = Curve(metrics.get("lm loss", {}))
    curve.log, curve.metrics = proc.stdout, metrics
    return curve


def last_value(flags: List[str], name: str) -> str:
    """The value argparse keeps for `name`: its last one."""
    return flags[max(i for i, f in enumerate(flags) if f == name) + 1]


def printed(log: str) -> Dict[int, float]:
    """{iteration: lm loss} of the printed lines (each its interval's mean)."""
    return {int(m.group(1)): float(m.group(2)) for m in LINE.finditer(log)}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def load_golden(name: str, metric: str = "lm loss") -> Dict[int, float]:
    """The steps that have a value ("nan" marks a step the run wrote none for)."""
    blob = json.loads(golden_path(name).read_text())[metric]
    return {int(k): float(v) for k, v in blob["values"].items() if v != "nan"}


def golden_blob(metrics: Dict[str, Dict[int, float]], train_iters: int = TRAIN_ITERS) -> dict:
    """Megatron's golden-values layout: per metric every step from 1, with "nan" where the run wrote
    no value (iteration-time at step 1, num-zeros at a skipped fp16 step), as its harness fills them."""
    blob = {}
    for metric in METRICS:
        values = metrics[metric]
        blob[metric] = {"start_step": 1, "end_step": train_iters, "step_interval": 1,
                        "values": {str(s): round(float(values[s]), GOLDEN_DECIMALS) if s in values else "nan"
                                   for s in range(1, train_iters + 1)}}
    return blob


def precision(case: Case) -> str:
    return "bf16" if "--bf16" in case.flags else "fp16" if "--fp16" in case.flags else "fp32"


def _change(a, b) -> float:
    """Relative change of one step's value ("nan": none; inf where a value appears or goes)."""
    if a == b:
        return 0.0
    return math.inf if "nan" in (a, b) or a == 0 else abs(b - a) / abs(a)


def golden_changes(old: dict, new: dict) -> Dict[str, float]:
    """{metric: largest relative change of a step} from the `old` golden blob to the `new` one."""
    return {metric: max(_change(old.get(metric, {}).get("values", {}).get(step, "nan"), value)
                        for step, value in entry["values"].items())
            for metric, entry in new.items()}


def write_golden(case: Case, curve: Curve, accept_change: bool = False, record_machine: bool = False) -> None:
    """Write `case`'s golden file from `curve`; refuses a loss that does not fall, or one that moved
    beyond GOLDEN_RTOL from the file it replaces, unless `accept_change`."""
    new, path = golden_blob(curve.metrics), golden_path(case.name)
    if curve[TRAIN_ITERS] >= 0.9 * curve[1]:
        raise SystemExit(f"{case.name}: the loss went {curve[1]:.4f} -> {curve[TRAIN_ITERS]:.4f}; not written")
    old = json.loads(path.read_text()) if path.exists() else {}
    changes = golden_changes(old, new) if old else {}
    for metric, change in changes.items():
        print(f"{case.name} {metric}: largest relative change {change:.2e}")
    moved, rtol = changes.get("lm loss", 0.0), GOLDEN_RTOL[precision(case)]
    if moved > rtol and not accept_change:
        raise SystemExit(f"{case.name}: the lm loss moved {moved:.2e} from {path} (beyond {rtol:.0e}): "
                         "rerun with --accept-change if that is intended")
    if old and not record_machine:
        new.update({metric: old[metric] for metric in MACHINE_METRICS if metric in old})
    path.write_text(json.dumps(new, indent=4) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cases", nargs="*", help="case names (default: all)")
    p.add_argument("--generate", action="store_true", help="write golden files of the defining cases")
    p.add_argument("--accept-change", action="store_true", help="write a loss curve that moved beyond GOLDEN_RTOL")
    p.add_argument("--record-machine", action="store_true", help="write this machine's time and memory too")
    p.add_argument("--workdir", help="where runs write (default: a fresh directory; a given one keeps its corpus)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="functional-"))
    workdir.mkdir(parents=True, exist_ok=True)
    names = args.cases or [c.name for c in CASES if not args.generate or c.golden_name == c.name]
    for name in names:
        case = BY_NAME[name]
        curve = run_case(case, workdir)
        if args.generate:
            assert case.golden_name == case.name, f"{name} does not define a golden curve"
            write_golden(case, curve, args.accept_change, args.record_machine)
            print(f"wrote {golden_path(name)}")
        else:
            print(name, " ".join(f"{curve[s]:.6E}" for s in sorted(curve)))


if __name__ == "__main__":
    main()
