"""MEMO on one GPU: the longest sequence and its MFU under MEMO, full recomputation and no
recomputation, and the allocator's fragmentation with and without the planned allocator.

    python tools/benchmark_memo.py                          # 7B-shaped layers, 6 of them, bf16
    python tools/benchmark_memo.py --modes memo --budget 540 --log-dir logs   # one mode per call
    python tools/benchmark_memo.py --bandwidth              # pinned host <-> device copies only

The model has Llama-2-7B's layer shape (h 4096, 32 heads, SwiGLU 11008, RMSNorm, RoPE) and
--num-layers of them, so that parameters and optimizer state fit beside the activations. For every
mode the sequence lengths are tried in increasing order until one runs out of memory (or its time);
each run is pretrain_gpt.py on mock data, micro-batch 1, --iters iterations of which --warmup (at least two) are
dropped. What fits at a length, roughly: 18 bytes of model and optimizer state per parameter (1.5 G
parameters at 6 layers: 27 GB); the logits, s x vocab in bf16 and again in fp32 for the loss (25 GB
at 128K and vocabulary 32000) unless --loss-chunk makes them a chunk's (1.5 GB for 8192 tokens);
MEMO's two rounding buffers, each a layer's activations (about 20 GB at 128K), where the model's
last two layers stay as the paper has it: few layers leave MEMO little to manage.
Fragmentation is read from the memory line printed at the end of a run, whose maxima are the
training iterations' (set-up excluded): max reserved minus max allocated -- what the allocator held
beyond the tensors at the peak -- and the allocator's retries, for MEMO with torch's caching
allocator and with the planned one. MEMO's memory plan is made with the greedy planner (the plan is
only printed with the caching allocator; a solver's time would be each run's).
Prints markdown tables with device, date and the exact command of every row. A mode's search ends
at its first length out of memory or out of its time, which is its finding; any other row without
a measurement (failed, stopped by the budget, no iteration left) makes the exit status 1.
"""
from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpt import UNMEASURED, Runs, add_run_limits, device_name, parse, refusal, shown  # noqa: E402

from tools import cli  # noqa: E402  (benchmark_gpt put the repository on the path)

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ("--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights")
SHAPES = {
    "7b": f"--hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --vocab-size 32000 {LLAMA}",
    "tiny": f"--hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 344 --vocab-size 1000 {LLAMA}",  # a CPU check
}
MODES = {
    "none": "",
    "full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "memo": "--memo --memo-swap-fraction auto --memo-planner greedy",
    "memo-planned": "--memo --memo-swap-fraction auto --memo-planner greedy --memo-allocator planned",
}
# where a mode's search for its longest sequence is meant to stop: the length that does not fit
FOUND_THE_LIMIT = ("out of memory", "timeout")
ALPHA = re.compile(r"MEMO: alpha ([0-9.]+)")
MEMORY = re.compile(r"memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+) \| "
                    r"reserved: ([0-9.]+) \| max reserved: ([0-9.]+) \| alloc retries: (\d+)")


def command(args, mode: str, seq: int):
    flags = (f"{SHAPES[args.shape]} --num-layers {args.num_layers} --seq-length {seq} --max-position-embeddings {seq} "
             f"--micro-batch-size 1 --global-batch-size 1 --train-iters {args.iters} --lr 1e-4 "
             f"--lr-warmup-iters 0 --hidden-dropout 0 --attention-dropout 0 --mock-data "
             f"--tokenizer-type NullTokenizer --log-interval 1 --log-throughput --eval-iters 0 "
             f"--timing-log-level 1 --cross-entropy-chunk-tokens {args.loss_chunk} {MODES[mode]}").split()
    if args.bf16:
        flags.append("--bf16")
    # torch's caching allocator mapping its blocks into growable segments: its own answer to fragmentation
    env = ["env", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"] if args.expandable_segments else []
    return env + [sys.executable, str(ROOT / "pretrain_gpt.py")] + flags + args.extra


def run(args, mode: str, seq: int, runs: Runs):
    """(metrics or None, status, fragmentation dict or None, command); the metrics carry MEMO's
    alpha (None without MEMO): the overlap it was chosen for is what the row's time tests."""
    cmd = command(args, mode, seq)
    status, text = runs(cmd, f"{mode}_{seq}")
    if status != "ok":
        return None, status, None, cmd
    ends = MEMORY.findall(text)
    frag = None
    if ends:  # the end of the run: its maxima are the training iterations'
        allocated, max_allocated, reserved, max_reserved, retries = ends[-1]
        frag = {"allocated": float(allocated), "max allocated": float(max_allocated), "reserved": float(reserved),
                "max reserved": float(max_reserved), "retries": int(retries)}
    res = parse(text, args.warmup)
    if res:
        alpha = ALPHA.search(text)
        res["alpha"] = float(alpha.group(1)) if alpha else None
    return res, "ok" if res else "no iteration after the warm-up", frag, cmd


def bandwidth_table() -> None:
    """Pinned host <-> device copy rates, as MEMO's set-up measures them for its LP (the rates it
    then assumes), at three copy sizes."""
    import torch

    from megatron.longseq.memo.profiler import copy_rate
    from megatron.longseq.memo.streams import host_empty

    if not torch.cuda.is_available():
        raise cli.ToolError("--bandwidth: pinned copies are measured to and from a CUDA device; none is visible")
    dev = torch.device("cuda", 0)
    print(f"device: {torch.cuda.get_device_name(dev)} | date: {datetime.date.today()}")
    print("| bytes per copy | host to device GB/s | device to host GB/s |")
    print("| --- | --- | --- |")
    for mib in (64, 256, 1024):
        d, h = torch.empty(mib * 2**20, dtype=torch.uint8, device=dev), host_empty(mib * 2**20, pin=True)
        print(f"| {mib} MiB | {copy_rate(d, h, dev) / 1e9:.1f} | {copy_rate(h, d, dev) / 1e9:.1f} |", flush=True)


def arguments(argv):
    p = cli.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b", help="the layers' shape")
    p.add_argument("--num-layers", type=cli.positive_int, default=6, help="layers of the model")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="run in fp32")
    p.add_argument("--seq-lengths", type=cli.positive_int, nargs="+", default=[16384, 32768, 65536, 131072],
                   help="lengths tried in increasing order, per mode")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["none", "full", "memo", "memo-planned"],
                   help="recomputation / MEMO modes, each searched on its own")
    p.add_argument("--loss-chunk", type=cli.nonnegative_int, default=8192,
                   help="--cross-entropy-chunk-tokens of every run: the logits of this many tokens at a time "
                        "(0: whole, as the rows measured before it existed)")
    p.add_argument("--expandable-segments", action="store_true",
                   help="every run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the caching allocator's "
                        "growable segments: the baseline for the planned allocator's fragmentation)")
    p.add_argument("--iters", type=cli.positive_int, default=6, help="iterations of a run, more than max(--warmup, 2)")
    p.add_argument("--warmup", type=cli.nonnegative_int, default=2,
                   help="iterations left out of the means (at least two are)")
    p.add_argument("--bandwidth", action="store_true", help="measure pinned host <-> device copies (CUDA) and stop")
    add_run_limits(p)
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    args = p.parse_args(argv)
    refused = "" if args.bandwidth else refusal(args, command(args, args.modes[0], args.seq_lengths[0]))
    if refused:
        p.error(refused)
    return args


def search(args, mode: str, runs: Runs, longest: dict) -> bool:
    """Print the rows of one mode's lengths, up to the first that does not run; whether the search
    ended as it should (every length measured, or the limit found)."""
    for seq in sorted(args.seq_lengths):
        res, status, frag, cmd = run(args, mode, seq, runs)
        if res is None:
            print(f"| {mode} | {seq} | {status} | | | | | | `{shown(cmd)}` |", flush=True)
            return status in FOUND_THE_LIMIT
        longest[mode] = seq
        mfu = f"{res['mfu']:.1f}%" if res["mfu"] is not None else "n/a"
        gap = f"{frag['max reserved'] - frag['max allocated']:.0f}" if frag else "n/a"
        retries = frag["retries"] if frag else "n/a"
        alpha = "" if res["alpha"] is None else f"{res['alpha']:.3f}"
        print(f"| {mode} | {seq} | {mfu} | {res['tflops']:.1f} | {res['ms']:.0f} | {alpha} | {gap} | {retries} | "
              f"`{shown(cmd)}` |", flush=True)
    return True


def main(argv=None):
    args = arguments(argv)
    if args.bandwidth:
        return bandwidth_table()
    runs = Runs(args, "memo")
    print(f"device: {device_name()} | date: {datetime.date.today()} | {args.num_layers} layers of {args.shape} shape | "
          f"{'bf16' if args.bf16 else 'fp32'}{' | expandable segments' if args.expandable_segments else ''}")
    print("| mode | seq | MFU | TFLOP/s/GPU | ms/iter | alpha | max reserved - max allocated (MB) | alloc retries | "
          "command |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    longest = {}
    unfinished = [mode for mode in args.modes if not search(args, mode, runs, longest)]
    print(flush=True)
    print("Longest sequence per mode:")  # a heading: the GPU suite keeps the two tables apart
    print("| mode | longest sequence that ran |")
    print("| --- | --- |")
    for mode in args.modes:
        print(f"| {mode} | {longest.get(mode, 'none')} |")
    if unfinished:  # the tables are the record; the status tells a caller they are not whole
        print(f"modes whose search did not end at a limit: {' '.join(unfinished)}", file=sys.stderr, flush=True)
    return UNMEASURED if unfinished else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
