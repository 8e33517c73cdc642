"""Count the tensors aten ops create (outputs on storage that no input of the op had): the CPU-side
measure of what a GPU step would allocate from the caching allocator. Views and in-place ops
create none; `pause()` leaves out what a kernel allocates inside itself."""
from __future__ import annotations

import contextlib
from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> set:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class CreatedTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.created: List[tuple] = []  # (op name, numel, dtype)
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            inputs = _storages((args, kwargs))
            self.created += [(str(func), t.numel(), t.dtype) for t in tree_flatten(out)[0]
                             if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                             and t.numel() > 0]
        return out

    @contextlib.contextmanager
    def pause(self):
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous

    def at_least(self, numel: int) -> List[tuple]:
        """The created tensors of `numel` elements or more."""
        return [c for c in self.created if c[1] >= numel]
