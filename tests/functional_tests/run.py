"""Run functional cases through torchrun and read their loss curves; regenerate golden files.

    python -m tests.functional_tests.run --generate        # rewrite every single-rank golden file
    python -m tests.functional_tests.run gpt_base_tp2      # run one case, print its curve
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from tests.functional_tests.cases import BY_NAME, CASES, COMMON, Case
from tests.unit_tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.E+-]+) \|")


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
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(case.nproc),
            "--master-port", port, str(ROOT / "pretrain_gpt.py")] + flags


class Curve(dict):
    """{iteration: lm loss} of a run, with the run's standard output as `.log`."""

    log = ""


def run_case(case: Case, workdir: Path, extra: List[str] = (), timeout: int = 600) -> Curve:
    """Run `case`; return {iteration: lm loss} (and its log). Raises with the output tail on failure."""
    data = make_corpus(workdir / "corpus") if case.data else None
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(command(case, list(extra), data), cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    curve = Curve((int(m.group(1)), float(m.group(2))) for m in LINE.finditer(proc.stdout))
    curve.log = proc.stdout
    return curve


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def load_golden(name: str) -> Dict[int, float]:
    blob = json.loads(golden_path(name).read_text())["lm loss"]
    return {int(k): float(v) for k, v in blob["values"].items()}


def write_golden(name: str, curve: Dict[int, float]) -> None:
    steps = sorted(curve)
    blob = {"lm loss": {"start_step": steps[0], "end_step": steps[-1], "step_interval": 1,
                        "values": {str(s): curve[s] for s in steps}}}
    golden_path(name).write_text(json.dumps(blob, indent=2) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cases", nargs="*", help="case names (default: all)")
    p.add_argument("--generate", action="store_true", help="write golden files of the defining cases")
    p.add_argument("--workdir", default=str(ROOT / "runs" / "functional"))
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    names = args.cases or [c.name for c in CASES if not args.generate or c.golden_name == c.name]
    for name in names:
        case = BY_NAME[name]
        curve = run_case(case, workdir)
        if args.generate:
            assert case.golden_name == case.name, f"{name} does not define a golden curve"
            write_golden(name, curve)
            print(f"wrote {golden_path(name)}")
        else:
            print(name, " ".join(f"{curve[s]:.6E}" for s in sorted(curve)))


if __name__ == "__main__":
    main()
