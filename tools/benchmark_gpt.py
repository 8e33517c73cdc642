"""Throughput benchmark: tokens/s/GPU and MFU of pretrain_gpt.py over a range of sequence lengths.

    python tools/benchmark_gpt.py                      # GPT 1.3B shape, bf16, 4K..32K, one GPU
    python tools/benchmark_gpt.py --seq-lengths 8192 --model 1.3b --iters 20 -- --recompute-granularity full ...

Each sequence length is one pretrain_gpt.py run on mock data with --log-throughput; the first
--warmup iterations are dropped and the rest averaged. Every iteration holds --tokens-per-iter tokens
(micro-batch 1, gradient accumulation up to it), so short and long sequences do the same work per
step. A run that runs out of memory is retried with full recompute, and the table says so.
Prints a markdown table with device, date and the exact command of each row.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]

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
    flags = (f"{MODELS[args.model]} --seq-length {seq} --max-position-embeddings {seq} "
             f"--position-embedding-type rope --micro-batch-size 1 --global-batch-size {gbs} "
             f"--train-iters {args.iters} --lr 1e-4 --lr-warmup-iters 0 --hidden-dropout 0 "
             f"--attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --log-interval 1 "
             f"--log-throughput --eval-iters 0 --num-workers 2").split()
    if args.bf16:
        flags.append("--bf16")
    if recompute:
        flags += "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
    return [sys.executable, str(ROOT / "pretrain_gpt.py")] + flags + args.extra


def parse(stdout: str, warmup: int):
    rows = [line for line in stdout.splitlines() if "iteration" in line and "lm loss" in line][warmup:]
    if not rows:
        return None
    out = {}
    for key, pattern in FIELDS.items():
        values = [float(m.group(1)) for m in (re.search(pattern, r) for r in rows) if m]
        out[key] = mean(values) if values else None
    return out


def run(args, seq: int):
    for recompute in (False, True):
        cmd = command(args, seq, recompute)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
        text = proc.stdout + proc.stderr
        if proc.returncode == 0:
            return parse(proc.stdout, args.warmup), recompute, cmd
        if "out of memory" not in text.lower() or recompute:
            print(text[-3000:], file=sys.stderr)
            return None, recompute, cmd
    return None, True, cmd


def shown(cmd) -> str:
    """The command of a table row: the script and its flags, paths relative to the repository."""
    return " ".join(shlex.quote(c) for c in cmd[1:]).replace(str(ROOT) + "/", "")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--tokens-per-iter", type=int, default=32768)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = p.parse_args(argv)
    print(f"device: {device_name()} | date: {datetime.date.today()} | model: {args.model} | "
          f"{'bf16' if args.bf16 else 'fp32'} | {args.tokens_per_iter} tokens per iteration")
    print("| seq | tokens/s/GPU | TFLOP/s/GPU | MFU | ms/iter | recompute | command |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in args.seq_lengths:
        res, recompute, cmd = run(args, seq)
        if res is None:
            print(f"| {seq} | failed | | | | {'full' if recompute else 'none'} | `{shown(cmd)}` |")
            continue
        mfu = f"{res['mfu']:.1f}%" if res["mfu"] is not None else "n/a"
        print(f"| {seq} | {res['tokens']:.0f} | {res['tflops']:.1f} | {mfu} | {res['ms']:.0f} | "
              f"{'full' if recompute else 'none'} | `{shown(cmd)}` |", flush=True)


if __name__ == "__main__":
    main()
