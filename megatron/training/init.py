"""Layout-independent initialisation: the same model for every (tp, pp, virtual pp) layout.

megatron-core draws parameters in construction order, so a pipeline stage that builds only its
own layers draws different numbers than a one-stage model. Here every parameter's full
(unpartitioned) tensor is drawn from a generator seeded by the run's seed and the parameter's
global name -- layer index as in the whole model, the last stage's copy of tied embeddings named
as the first stage's -- with Megatron's rules, and each tensor-parallel rank keeps its partition:
  weights              N(0, init_method_std)
  linear_proj, fc2     N(0, init_method_std / sqrt(2 num_layers))   (Megatron's scaled init)
  biases               0;  norm weights 1 (0 when they hold gamma - 1: --apply-layernorm-1p)
Names and shapes tell them apart, Transformer Engine's fused norms (`layer_norm_weight`,
`layer_norm_bias`) included: every 1-D weight of a GPT model is a norm's.
"""
from __future__ import annotations

import math
import re
import zlib

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(model, name: str) -> str:
    """The parameter's name in the whole (unsplit) model."""
    match = _LAYER.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        return f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    return name


def _full_value(gname: str, shape, seed: int, std: float, num_layers: int, zero_centered: bool) -> torch.Tensor:
    if gname.endswith("bias"):  # ".bias", and TE's "layer_norm_bias"
        return torch.zeros(shape)
    if len(shape) == 1:  # LayerNorm / RMSNorm weights
        return torch.zeros(shape) if zero_centered else torch.ones(shape)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(gname.encode())) % 2**63)
    scaled = gname.endswith("linear_proj.weight") or gname.endswith("linear_fc2.weight")
    sigma = std / math.sqrt(2.0 * num_layers) if scaled else std
    return torch.empty(shape).normal_(0.0, sigma, generator=generator)


def partition(full: torch.Tensor, dim: int, stride: int, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's slice, as megatron-core splits its CPU master weights: the partition dim cut
    into tp * stride pieces, rank r keeping pieces r, r + tp, ... (stride 2: SwiGLU's fc1)."""
    pieces = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp], dim=dim)


def unpartition(slices, dim: int, stride: int) -> torch.Tensor:
    """The inverse of `partition` over every rank's slice (in rank order)."""
    pieces = [torch.chunk(s, stride, dim=dim) for s in slices]  # [tp][stride]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(slices))], dim=dim)


def _partition(full: torch.Tensor, param, tp_rank: int, tp: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    return partition(full, param.partition_dim, getattr(param, "partition_stride", 1), tp_rank, tp)


@torch.no_grad()
def initialize_parameters(chunks, seed: int, std: float, num_layers: int, tp_rank: int, tp: int,
                          zero_centered: bool = False) -> None:
    """zero_centered: --apply-layernorm-1p, which every norm of the model follows."""
    for model in chunks:
        for name, param in model.named_parameters():
            gname = global_name(model, name)
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= tp
            full = _full_value(gname, shape, seed, std, num_layers, zero_centered)
            param.copy_(_partition(full, param, tp_rank, tp))
