"""Seq1F1B cross-segment state of one micro-batch: per layer, the keys and values of the segments
already forwarded, and the gradients later segments send back to them.

Segment s attends to the keys/values of segments < s (kept here, detached: each segment is its own
autograd graph). Its backward computes those earlier keys' and values' gradients and adds them
here; the partially ordered queue runs segment s's backward before any earlier one's (LIFO), so by
the time segment j's backward runs its gradient sum is complete and it takes it. Exact gradients.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch


class SegmentState:
    def __init__(self):
        self.kv: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self.grads: Dict[Tuple[int, int], torch.Tensor] = {}

    def release(self) -> None:
        self.kv.clear()
        self.grads.clear()


@dataclass
class SegmentSlot:
    """Segment `index` of the micro-batch whose state is `state` (what the attention sees)."""

    state: SegmentState
    index: int

    def prefix(self, layer: int):
        kept = self.state.kv[layer]
        if len(kept) < self.index:
            raise RuntimeError(f"layer {layer}: segment {self.index} runs before segment {len(kept)} "
                               f"was forwarded")
        return kept[: self.index]

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kept = self.state.kv[layer]
        if len(kept) == self.index:  # a recompute of this segment finds it kept already
            kept.append((k, v))

    def add_grad(self, layer: int, segment: int, dkv: torch.Tensor) -> None:
        key = (layer, segment)
        self.state.grads[key] = dkv if key not in self.state.grads else self.state.grads[key] + dkv

    def take_grad(self, layer: int):
        grad = self.state.grads.pop((layer, self.index), None)
        if self.index == 0:  # the micro-batch's last backward in this layer: free its keys/values
            self.state.kv.pop(layer, None)
        return grad
