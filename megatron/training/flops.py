"""Model FLOPs per iteration (Megatron's formula, causal attention halved) and device peaks for MFU.

Forward FLOPs per token and layer (2 per multiply-add), with q = heads x kv_channels, g/n the ratio
of KV groups to heads, ffn the MLP width, s the sequence length:
  Q and output projections   2*h*q + 2*q*h          = 4*h*q
  K and V projections        2*h*(2*q*g/n)          = 4*h*q * g/n
  scores and weighted values 2*s*q + 2*s*q, halved  = 4*h*q * s/(2h)   (causal: half the matrix)
  MLP fc1 and fc2            2*2*h*ffn (x 3/2 when SwiGLU doubles fc1)
plus the logits 2*h*V once per token. Training is 3x forward (forward, data and weight gradients),
which gives Megatron's 12 * B * s * L * h^2 * (attention + mlp + logits) below. Recompute is not
counted: these are model FLOPs (MFU), not hardware FLOPs.
"""
from __future__ import annotations

from typing import Optional

import torch


def num_floating_point_operations(args, batch_size: int) -> float:
    h, s, L = args.hidden_size, args.seq_length, args.num_layers
    q_ratio = args.kv_channels * args.num_attention_heads / h  # query projection size / h
    gqa_ratio = args.num_query_groups / args.num_attention_heads  # K and V relative to Q
    gated = 1.5 if args.swiglu else 1.0
    attention = (1 + gqa_ratio + s / h / 2) * q_ratio  # q & proj (1), k & v (gqa), causal scores
    mlp = args.ffn_hidden_size / h * gated
    logits = args.padded_vocab_size / (2 * L * h)
    return 12.0 * batch_size * s * L * h * h * (attention + mlp + logits)


# Dense bf16 peak TFLOP/s (vendor data sheets) for the devices we know by name.
PEAK_TFLOPS_BF16 = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM; checked after the PCIe and NVL cards
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
}


def default_peak_tflops() -> Optional[float]:
    """The device's dense bf16 peak, or None when unknown (MFU is then not reported)."""
    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name())


def peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a device by its name (the first key it contains), or None."""
    return next((value for key, value in PEAK_TFLOPS_BF16.items() if key in device_name), None)
