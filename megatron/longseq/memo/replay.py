"""MEMO's recompute of a layer's dropped tokens (runtime.py's LayerState drives it): the layer's
ops run again on those tokens alone, and what they save is matched to the forward's token-wise
tensors by order."""
from __future__ import annotations

from typing import Dict

import torch


class TokenReplay:
    """The recompute of the dropped tokens: the same ops, attention answered from its kept output
    (its q, k, v recorded as the forward's attention saved them); saved tensors are matched to
    the forward's token-wise ones by order."""

    phase = "replay"

    def __init__(self, state, x, out_rows):  # state: runtime.LayerState
        self.state, self.x, self.out_rows = state, x, out_rows
        self.parts: Dict[int, torch.Tensor] = {}
        self.skip = {x.untyped_storage().data_ptr()}  # and the output rows', once they exist
        if out_rows is not None:
            self.skip.add(out_rows.untyped_storage().data_ptr())
        self.order: Dict[tuple, int] = {}
        self.token_items = [k for k, item in enumerate(state.items) if not item.whole]

    def attention_rows(self, query, key, value, attend):
        """The attention output rows of the replayed tokens; `attend()` gives (out, lse) anew."""
        if self.state.attention_saved_qkv:
            for t in (query, key, value):  # what the kept attention saved token-wise, in its order
                self.pack(t)
        if self.out_rows is None:  # measuring
            self.out_rows = self.state.attend_again(attend)
            self.skip.add(self.out_rows.untyped_storage().data_ptr())
        return self.out_rows

    def pack(self, t: torch.Tensor) -> None:
        """Records t and keeps nothing: the replay's graph never runs backward. Returning t would
        tie each node that saves its own output (rsqrt of RMSNorm, sigmoid, exp) to itself
        through autograd's C++ graph, where Python's gc cannot see the cycle: the replay's
        tensors, its hooks and this layer's state would never be freed."""
        ptr = t.untyped_storage().data_ptr()
        tokens = self.state.tokens - self.state.n_off
        if ptr in self.state.memo.param_storages or ptr in self.skip:
            return
        if t.dim() >= 1 and t.shape[0] == tokens:
            key = (ptr, tuple(t.shape), t.stride(), t.storage_offset())
            if key not in self.order:
                self._match(len(self.order), t)
                self.order[key] = len(self.order)

    def _match(self, k: int, t: torch.Tensor) -> None:
        items = self.token_items
        if k >= len(items) or tuple(t.shape[1:]) != self.state.items[items[k]].shape[1:]:
            raise RuntimeError(f"MEMO layer {self.state.index}: the recompute saved a different tensor "
                               f"sequence than the forward (tensor {k}, shape {tuple(t.shape)})")
        self.parts[items[k]] = t.detach()
