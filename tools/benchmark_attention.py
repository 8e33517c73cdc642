"""Attention forward+backward on one device: the bare kernel against our local step.

    python tools/benchmark_attention.py --seq-lengths 32768 65536 131072 --heads 32 --kv-heads 8

"kernel": the selected AttentionKernel's forward and backward called directly on [b, h, s, d].
"ours":   LongSeqCoreAttention on megatron-core's [s, b, h, d] layout (layout views, the 2D path at
          degree 1, the autograd function), without RoPE -- the per-step cost our code adds.
TFLOP/s counts causal attention as Megatron does: forward 4 b h s^2 d / 2, backward 2.5x forward.
Prints a markdown table with device, date and command.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.transformer.enums import AttnBackend  # noqa: E402
from megatron.longseq.attention.core import LongSeqCoreAttention  # noqa: E402
from megatron.longseq.attention.kernels import default_scale, select_kernel  # noqa: E402
from megatron.longseq.config import LongSeqConfig  # noqa: E402


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
    return forward * 3.5  # forward + backward (2.5x)


def bench(seq, args, device, dtype):
    b, h, g, d = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(b, h, seq, d, device=device, dtype=dtype)
    k = torch.randn(b, g, seq, d, device=device, dtype=dtype)
    v = torch.randn(b, g, seq, d, device=device, dtype=dtype)
    dout = torch.randn_like(q)
    kernel = select_kernel(args.backend, device, dtype, d)
    scale = default_scale(d, None)

    def bare():  # the kernel itself, without even the contract checks
        out, lse = kernel._forward(q, k, v, True, scale)
        kernel._backward(dout, q, k, v, out, lse, True, scale)

    config = LongSeqConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=g,
                           kv_channels=d, attention_dropout=0.0, attention_backend=AttnBackend[args.backend])
    module = LongSeqCoreAttention(config, layer_number=1, attn_mask_type=None).to(device)
    # megatron-core's layout: [s, b, h, d]
    qs, ks, vs = (x.permute(2, 0, 1, 3).detach().requires_grad_() for x in (q, k, v))
    douts = dout.permute(2, 0, 1, 3).reshape(seq, b, h * d)

    def ours():
        module(qs, ks, vs, None).backward(douts)

    t_kernel = timed(bare, device, args.warmup, args.iters)
    t_ours = timed(ours, device, args.warmup, args.iters)
    flops = attention_flops(b, h, seq, d)
    return kernel.name, t_kernel, t_ours, flops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--backend", default="auto")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name} | date: {datetime.date.today()} | {args.dtype} | b={args.batch} h={args.heads} "
          f"h_kv={args.kv_heads} d={args.head_dim} | command: python tools/benchmark_attention.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    print("| seq | kernel | kernel fwd+bwd ms | ours fwd+bwd ms | overhead | kernel TFLOP/s | ours TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in args.seq_lengths:
        kname, tk, to, flops = bench(seq, args, device, dtype)
        print(f"| {seq} | {kname} | {tk * 1e3:.2f} | {to * 1e3:.2f} | {100 * (to - tk) / tk:+.1f}% | "
              f"{flops / tk / 1e12:.2f} | {flops / to / 1e12:.2f} |", flush=True)


if __name__ == "__main__":
    main()
