"""Attention forward+backward on one device: the bare kernel against our local step.

    python tools/benchmark_attention.py --seq-lengths 32768 65536 131072 --heads 32 --kv-heads 8

"kernel": the selected AttentionKernel's forward and backward called directly on [b, h, s, d]
          views of megatron-core's [s, b, h, d] tensors, as training hands them to it.
"ours":   LongSeqCoreAttention on those [s, b, h, d] tensors (layout views, the 2D path at degree 1,
          the autograd function), without RoPE -- the per-step cost our code adds. Its gradients
          are returned, not accumulated into .grad: training adds none either.
TFLOP/s counts causal attention as FlashAttention's benchmarks do: forward 4 b h s^2 d / 2,
backward 2.5x forward (it computes the scores again). Megatron's MFU (flops.py) counts 3x in all:
its TFLOP/s for the same time are 3/3.5 of these.
A length that runs out of device memory gets a row saying so; the next one still runs.
Prints a markdown table with device, date and command.

With --documents MEAN a second table compares a packed sample (log-normal documents of that mean
length, sigma 1, as --reset-attention-mask attends them) with the unpacked one of the same length:
fwd+bwd time, the causal work the documents leave, and the kernel calls of one forward (varlen
calls where the kernel has a variable-length entry, one dense call per piece where not). The
document layout and its plans are made by the first call and reused, as every layer after the
first of a micro-batch reuses them; their one-off host time is reported beside.

With --ring R [R ...] a third table times the load-balanced ring's blocks: the forward and
backward of all R ring positions (each position's chunks j and 2R-1-j, Megatron's placement) run
one after another on this device -- threads joined by loopback groups (attention/loopback.py),
the trainer's ring_forward/ring_backward, fp32 merges and accumulators included, communication
replaced by device copies -- against the bare kernel over the whole sequence; every length must
then be divisible by 2 x R.
"""
from __future__ import annotations

import datetime
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron.longseq  # noqa: E402,F401  (quiet megatron-core's import-time warnings first)
from megatron.core.transformer.enums import AttnBackend  # noqa: E402
from megatron.longseq.attention import varlen  # noqa: E402
from megatron.longseq.attention.core import AttentionInputs, LongSeqCoreAttention  # noqa: E402
from megatron.longseq.attention.documents import causal_work, lognormal_starts  # noqa: E402
from megatron.longseq.attention.placement import DocumentLayout  # noqa: E402
from megatron.longseq.attention.context_parallel import ContextParallel  # noqa: E402
from megatron.longseq.attention.kernel_choice import BACKENDS, select_kernel  # noqa: E402
from megatron.longseq.attention.kernels import default_scale, grad_like  # noqa: E402
from megatron.longseq.attention.loopback import RankThreads  # noqa: E402
from megatron.longseq.attention.placement import local_token_indices  # noqa: E402
from megatron.longseq.attention.ring import ring_backward, ring_forward  # noqa: E402
from megatron.longseq.config import LongSeqConfig  # noqa: E402
from megatron.longseq.parallel_state import RankGrid  # noqa: E402
from tools import cli  # noqa: E402
from tools.benchmark_gpt import OOM  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def attention_flops(b, h, s, d) -> float:
    forward = 4 * b * h * s * s * d / 2
    return forward * 3.5  # forward + backward (2.5x: FlashAttention's convention)


def inputs(seq, args, device, dtype):
    """megatron-core's layout as training hands it over: q [s, b, h, d], k and v [s, b, g, d]
    leaves, and dout [s, b, h*d] (the gradient of the layer's output)."""
    b, h, g, d = args.batch, args.heads, args.kv_heads, args.head_dim
    leaves = [torch.randn(seq, b, n, d, device=device, dtype=dtype).requires_grad_() for n in (h, g, g)]
    return leaves, torch.randn(seq, b, h * d, device=device, dtype=dtype)


def kernel_views(leaves, dout):
    """[s, b, h, d] -> the kernel's [b, h, s, d], views (no copy), dout's too."""
    q, k, v = (x.detach().permute(1, 2, 0, 3) for x in leaves)
    seq, b = dout.shape[:2]
    return q, k, v, dout.view(seq, b, q.shape[1], -1).permute(1, 2, 0, 3)  # [s, b, h*d] -> [b, h, s, d]


def core_attention(args, device):
    h, g, d = args.heads, args.kv_heads, args.head_dim
    config = LongSeqConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=g,
                           kv_channels=d, attention_dropout=0.0, attention_backend=AttnBackend[args.backend])
    return LongSeqCoreAttention(config, layer_number=1, attn_mask_type=None).to(device)


def bare_step(kernel, q, k, v, dout, scale):
    """Causal forward and backward of the kernel itself, without even the contract checks."""
    def bare():
        out, lse = kernel._forward(q, k, v, True, scale)
        kernel._backward(dout, q, k, v, out, lse, True, scale)

    return bare


def steps(seq, args, device, dtype):
    """(the kernel, its bare forward+backward, ours, the FLOPs of one)."""
    leaves, dout = inputs(seq, args, device, dtype)
    q, k, v, dout_k = kernel_views(leaves, dout)
    kernel = select_kernel(args.backend, device, dtype, args.head_dim)
    bare = bare_step(kernel, q, k, v, dout_k, default_scale(args.head_dim, None))
    module = core_attention(args, device)

    def ours():
        torch.autograd.grad(module(*leaves, None), leaves, dout)

    return kernel, bare, ours, attention_flops(args.batch, args.heads, seq, args.head_dim)


def bench(seq, args, device, dtype):
    kernel, bare, ours, flops = steps(seq, args, device, dtype)
    t_kernel, t_ours = (timed(step, device, args.warmup, args.iters) for step in (bare, ours))
    return kernel.name, t_kernel, t_ours, flops


def counted(kernel) -> dict:
    """Count the kernel's forward calls from now on, dense and varlen (instance attributes)."""
    counts = {"dense": 0, "varlen": 0}
    for method, kind in (("forward", "dense"), ("forward_varlen", "varlen")):
        def call(*a, _inner=getattr(kernel, method), _kind=kind, **kw):
            counts[_kind] += 1
            return _inner(*a, **kw)
        setattr(kernel, method, call)
    return counts


def bench_packed(seq, args, device, dtype):
    """(unpacked ms, packed ms, causal work left, calls of one packed forward, layout+plan ms)."""
    g = torch.Generator().manual_seed(0)
    starts = torch.stack([lognormal_starts(seq, args.documents, 1.0, g) for _ in range(args.batch)])
    leaves, dout = inputs(seq, args, device, dtype)
    module = core_attention(args, device)
    params = AttentionInputs(document_starts=starts)
    t_unpacked = timed(lambda: torch.autograd.grad(module(*leaves, None), leaves, dout), device, args.warmup,
                       args.iters)
    t_packed = timed(lambda: torch.autograd.grad(module(*leaves, None, packed_seq_params=params), leaves, dout),
                     device, max(args.warmup, 1), args.iters)  # the first call makes the layout and plans
    calls = counted(module._kernel)
    module(*leaves, None, packed_seq_params=params)
    work = sum(causal_work(s, torch.arange(seq)) for s in starts) / (args.batch * seq * (seq + 1) / 2)
    return t_unpacked, t_packed, work, calls, layout_seconds(starts, module._kernel, leaves[0], device)


def layout_seconds(starts, kernel, q, device) -> float:
    """Host time to make a micro-batch's layout, pieces and (varlen kernels) plans at degree 1."""
    start = time.perf_counter()
    pieces = DocumentLayout(starts, ring=1).pieces(0, 0, 0, 0)
    if varlen.uses_varlen(kernel, pieces):
        varlen.plan(pieces, q.shape[1], q.shape[0], q.shape[0], device)
    sync(device)
    return time.perf_counter() - start


def out_of_memory_row(measure, seq, args, device, dtype):
    """measure(...)'s result, or None with a row saying the length ran out of memory (freed)."""
    try:
        return measure(seq, args, device, dtype)
    except RuntimeError as err:  # torch.OutOfMemoryError, or cuDNN's and cuBLAS's ALLOC_FAILED
        if not OOM.search(str(err)):
            raise
    # the frames holding the tensors are gone once out of the handler
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"| {seq} | out of memory |", flush=True)
    return None


def packed_table(args, device, dtype) -> None:
    print(f"\npacked samples: log-normal documents, mean {args.documents:g} tokens (sigma 1)")
    print("| seq | unpacked fwd+bwd ms | packed fwd+bwd ms | packed / unpacked | causal work left | "
          "kernel calls per forward | layout + plans ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in args.seq_lengths:
        measured = out_of_memory_row(bench_packed, seq, args, device, dtype)
        if measured is None:
            continue
        tu, tp, work, calls, layout = measured
        print(f"| {seq} | {tu * 1e3:.2f} | {tp * 1e3:.2f} | {tp / tu:.3f} | {work:.3f} | "
              f"{calls['varlen']} varlen, {calls['dense']} dense | {layout * 1e3:.1f} |", flush=True)


def position_inputs(leaves, dout, ring: int) -> list:
    """Each ring position's q, k, v, dout as the kernels get them: [b, h, s/R, d] views of its
    chunks' [s/R, b, h, d] tensors, contiguous as after the all-to-all (made before any timing)."""
    out = []
    for j in range(ring):
        idx = local_token_indices(leaves[0].shape[0], 1, ring, 0, j)
        out.append(kernel_views([x.detach()[idx] for x in leaves], dout[idx]))
    return out


def ring_position(pgs, positions, kernel, scale):
    """One ring position's forward and backward of its chunks, as the trainer's ring runs them."""
    rc = ContextParallel.from_process_groups(pgs).ring
    q, k, v, dout_k = positions[rc.ring_index]
    # what the ring's autograd function does around the two (called directly: autograd runs CUDA
    # backwards on one thread, where these positions would wait for each other)
    out, lse = ring_forward(q, k, v, rc, kernel, scale)
    out = out.to(q.dtype)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dkv = ring_backward(grad_like(dout_k, out), q, k, v, out, lse, rc, kernel, scale, dq=dq)
    return dq.to(q.dtype), dkv.to(k.dtype)


def bench_ring(seq, args, device, dtype):
    """{R: seconds of R positions' fwd+bwd, one after another}, and the bare kernel's seconds."""
    leaves, dout = inputs(seq, args, device, dtype)
    kernel = select_kernel(args.backend, device, dtype, args.head_dim)
    scale = default_scale(args.head_dim, None)
    times = {}
    for r in args.ring:
        # the same thread for a position in every call: cuDNN keeps its graphs per thread
        threads, positions = RankThreads(RankGrid(world_size=r, cp=r)), position_inputs(leaves, dout, r)
        try:
            times[r] = timed(lambda: threads.run(ring_position, positions, kernel, scale), device,
                             max(args.warmup, 1), args.iters)
        finally:
            threads.close()
    return times, timed(bare_step(kernel, *kernel_views(leaves, dout), scale), device, args.warmup, args.iters)


def ring_table(args, device, dtype) -> None:
    print("\nload-balanced ring blocks, all positions on this device, against the whole-sequence kernel")
    print("| seq | kernel fwd+bwd ms | " + " | ".join(f"R={r} ms | R={r} / kernel" for r in args.ring) + " |")
    print("| --- | --- | " + " | ".join("--- | ---" for _ in args.ring) + " |")
    for seq in args.seq_lengths:
        measured = out_of_memory_row(bench_ring, seq, args, device, dtype)
        if measured is None:
            continue
        times, whole = measured
        cells = " | ".join(f"{times[r] * 1e3:.2f} | {times[r] / whole:.3f}" for r in args.ring)
        print(f"| {seq} | {whole * 1e3:.2f} | {cells} |", flush=True)


def arguments(argv):
    p = cli.parser(__doc__)
    p.add_argument("--seq-lengths", type=cli.positive_int, nargs="+", default=[32768, 65536, 131072],
                   help="tokens per sample, one row each")
    p.add_argument("--batch", type=cli.positive_int, default=1, help="samples b")
    p.add_argument("--heads", type=cli.positive_int, default=32, help="query heads h")
    p.add_argument("--kv-heads", type=cli.positive_int, default=8, help="key/value heads, dividing --heads")
    p.add_argument("--head-dim", type=cli.positive_int, default=128, help="channels per head d")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the tensors' type")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="--attention-backend of the kernel")
    p.add_argument("--warmup", type=cli.nonnegative_int, default=2, help="untimed calls before the timed ones")
    p.add_argument("--iters", type=cli.positive_int, default=5, help="timed calls, averaged")
    p.add_argument("--documents", type=cli.positive_float, metavar="MEAN",
                   help="also time packed samples of log-normal documents of this mean length")
    p.add_argument("--ring", type=cli.positive_int, nargs="+", metavar="R", default=[],
                   help="also time the load-balanced blocks of rings of R positions")
    args = p.parse_args(argv)
    args.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    args.torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    refused = refusal(args)
    if refused:
        p.error(refused)
    return args


def refusal(args) -> str:
    """Why the sizes cannot be timed (empty if they can), before the first length is."""
    if args.heads % args.kv_heads:
        return f"--kv-heads {args.kv_heads} does not divide --heads {args.heads}"
    odd = [(s, r) for r in args.ring for s in args.seq_lengths if s % (2 * r)]
    if odd:  # each ring position holds two chunks of the sequence
        return f"--seq-lengths {odd[0][0]} is not divisible by 2 x --ring {odd[0][1]}"
    try:  # the kernel this machine has for the backend, dtype and head size (a probe, no tensors)
        select_kernel(args.backend, args.device, args.torch_dtype, args.head_dim)
    except ValueError as err:
        return str(err)
    return ""


def main(argv=None):
    args = arguments(argv)
    device, dtype = args.device, args.torch_dtype
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name} | date: {datetime.date.today()} | {args.dtype} | b={args.batch} h={args.heads} "
          f"h_kv={args.kv_heads} d={args.head_dim} | command: python tools/benchmark_attention.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    print("| seq | kernel | kernel fwd+bwd ms | ours fwd+bwd ms | overhead | kernel TFLOP/s | ours TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in args.seq_lengths:
        measured = out_of_memory_row(bench, seq, args, device, dtype)
        if measured is None:
            continue
        kname, tk, to, flops = measured
        print(f"| {seq} | {kname} | {tk * 1e3:.2f} | {to * 1e3:.2f} | {100 * (to - tk) / tk:+.1f}% | "
              f"{flops / tk / 1e12:.2f} | {flops / to / 1e12:.2f} |", flush=True)
    if args.documents is not None:
        packed_table(args, device, dtype)
    if args.ring:
        ring_table(args, device, dtype)


if __name__ == "__main__":
    sys.exit(cli.run(main))
