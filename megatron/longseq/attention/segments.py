"""Seq1F1B cross-segment state of one micro-batch: per layer, the keys and values of the segments
already forwarded, and the gradients later segments send back to them.

Segment s attends to the keys/values of segments < s (kept here, detached: each segment is its own
autograd graph). Its backward computes those earlier keys' and values' gradients and adds them
here; the partially ordered queue runs segment s's backward before any earlier one's (LIFO), so by
the time segment j's backward runs its gradient sum is complete and it takes it. Exact gradients.
Segment j's keys and values are read by later segments only, forward and backward: they are let go
at segment j's backward (every later one's is over), and the last segment's are never kept.

The gradients are fp32, as the ring's accumulators are: a sum over up to k - 1 later segments,
each added once, rounded once when segment j's backward casts its dK/dV to the keys' dtype. In a
bf16 run they take twice the bytes of the kept keys and values (for a 7B-shaped stage of 8 layers,
32K tokens and k = 4, about 6 GiB); `held_bytes` counts them, with the keys and values kept where
autograd keeps nothing, for the pipeline's memory line: autograd's saved tensors do not include them.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch


class SegmentState:
    def __init__(self, segments: int = 0):
        self.segments = segments  # how many the micro-batch has (0: not said, every one is kept)
        self.kv: Dict[int, List[Optional[Tuple[torch.Tensor, torch.Tensor]]]] = defaultdict(list)
        self.grads: Dict[Tuple[int, int], torch.Tensor] = {}
        # (layer, segment) -> bytes of keys and values only this state holds (kept with `own`)
        self.copies: Dict[Tuple[int, int], int] = {}

    def release(self) -> None:
        self.kv.clear()
        self.grads.clear()
        self.copies.clear()

    def held_bytes(self) -> int:
        """What this state holds beyond autograd's saved tensors: the gradients, and the keys and
        values kept where autograd keeps nothing (recompute, MEMO)."""
        return sum(g.nbytes for g in self.grads.values()) + sum(self.copies.values())


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

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor, own: bool = False) -> None:
        """Keep this segment's keys and values for the later ones: as given, or with `own` as
        tensors of their own (a view of a larger tensor would keep all of it alive)."""
        kept = self.state.kv[layer]
        if self.index == self.state.segments - 1:  # the last segment: no later one reads it
            return
        if len(kept) == self.index:  # a recompute of this segment finds it kept already
            kept.append((_own(k), _own(v)) if own else (k, v))
            if own:
                self.state.copies[(layer, self.index)] = sum(x.nbytes for x in kept[-1])

    def add_grad(self, layer: int, segment: int, dkv: torch.Tensor) -> None:
        """Add a later segment's dK/dV (fp32, [2, b, g, s_j, d]) of segment `segment`'s keys and
        values; the first is kept as given (the ring's own new tensor), the next added into it."""
        key = (layer, segment)
        if key in self.state.grads:
            self.state.grads[key].add_(dkv)
        else:
            self.state.grads[key] = dkv

    def take_grad(self, layer: int):
        """This segment's keys' and values' gradients from the later segments, whose backwards are
        over: its keys and values are let go (all of the layer's at segment 0, the last backward)."""
        grad = self.state.grads.pop((layer, self.index), None)
        self.state.copies.pop((layer, self.index), None)
        kept = self.state.kv[layer]
        if self.index == 0:
            self.state.kv.pop(layer, None)
        elif self.index < len(kept):
            kept[self.index] = None
        return grad


def _own(x: torch.Tensor) -> torch.Tensor:
    """x alone when its storage holds more, laid out in memory in x's dimension order (the kernels
    get the same strides as from x: [b, h, s, d] views of [s, b, h, d] memory)."""
    if x.untyped_storage().nbytes() <= x.numel() * x.element_size():
        return x
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost in memory first
    back = sorted(range(x.dim()), key=order.__getitem__)  # the inverse permutation
    return x.permute(order).contiguous().permute(back)
