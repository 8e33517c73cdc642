"""Collectives of small host values (timings, byte counts, flags, peaks) on any process group.

NCCL reads only CUDA memory and rejects a CPU tensor; gloo reads host memory. Every collective of a
few Python numbers goes through here: the values are placed on the device the group's backend
needs, reduced or gathered there, and handed back as Python floats.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


def backend_device(group=None) -> torch.device:
    """Where a collective on `group` needs its tensors: the current CUDA device for NCCL, host
    memory for gloo and for a mixed backend that has a CPU side ("cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _values(values: Sequence[float], group) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64, device=backend_device(group))


def all_reduce_values(values: Sequence[float], op=dist.ReduceOp.SUM, group=None) -> List[float]:
    """`values` reduced elementwise over `group` (fp64: integers up to 2^53 stay exact)."""
    t = _values(values, group)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_gather_values(values: Sequence[float], group=None) -> List[List[float]]:
    """Every member's `values`, in group rank order."""
    mine = _values(values, group)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [p.tolist() for p in parts]
