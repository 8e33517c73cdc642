"""The memory MEMO's runtime moves activations through, sized once from the profile and never
grown: two rounding buffers on the device (section 4.1, Fig. 5) and one pool of host memory.

Every slot in both is 512-byte aligned (as torch's own allocations are), so a slot can be viewed
as any dtype and handed to any kernel.
"""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch

from megatron.longseq.memo.streams import Event, host_empty

ALIGN = 512


def aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN


class MemoCapacityError(RuntimeError):
    """A layer needs more than the profile planned (its shapes changed since): a bug, not a tuning."""


class RoundingBuffers:
    """Layer i's skeletal activations are staged in buffer i % 2 on their way to host memory and
    rebuilt in it on their way back; a resident (kept) layer's stay in it until its backward. `offloaded[b]` is the event after the offload copies of what
    the last forward staged in buffer b: the next writer waits for it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = aligned(nbytes)
        self.memory = [torch.empty(self.nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.offloaded: List[Optional[Event]] = [None, None]
        self.resident: List[Optional[weakref.ref]] = [None, None]  # a resident layer's state (runtime.py)

    def check(self, need: int, layer: int) -> None:
        if need > self.nbytes:
            raise MemoCapacityError(f"MEMO layer {layer}: needs a {need}-byte rounding buffer, the profile "
                                    f"planned {self.nbytes} (were the shapes of the profile run different?)")

    def view(self, which: int, offset: int, nbytes: int) -> torch.Tensor:
        return self.memory[which][offset : offset + nbytes]


class HostPool:
    """Host memory for the offloaded bytes (pinned on a GPU): `blocks` blocks of `block_bytes`,
    one taken by each managed layer's forward and given back when its prefetch has read it.
    `released` is the event after the newest such prefetch: prefetches run in order on one
    stream, so an offload that waits for it may write any block given back. Newest by issue order:
    a block whose backward never ran is given back late, with an older prefetch's event."""

    def __init__(self, blocks: int, block_bytes: int, pin: bool):
        self.blocks, self.block_bytes = blocks, aligned(block_bytes)
        self.memory = host_empty(blocks * self.block_bytes, pin)
        self.free = list(range(blocks - 1, -1, -1))
        self.released: Optional[Event] = None
        self.prefetches, self._released_at = 0, 0  # prefetches issued; the order of `released`'s

    @property
    def in_use(self) -> int:
        return (self.blocks - len(self.free)) * self.block_bytes

    def take(self, need: int, layer: int) -> int:
        if need > self.block_bytes or not self.free:
            raise MemoCapacityError(
                f"MEMO layer {layer}: host pool exhausted ({need} bytes wanted, {len(self.free)} of {self.blocks} "
                f"blocks of {self.block_bytes} free); the profile planned for fewer layers in flight")
        return self.free.pop()

    def prefetched(self, event: Event) -> tuple:
        """(its issue order, event): what a block's prefetch gives back with the block."""
        self.prefetches += 1
        return self.prefetches, event

    def give_back(self, block: int, read: Optional[tuple]) -> None:
        """`read`: prefetched()'s value for the block, None when it was never read back."""
        self.free.append(block)
        if read is not None and read[0] > self._released_at:
            self._released_at, self.released = read

    def view(self, block: int, offset: int, nbytes: int) -> torch.Tensor:
        start = block * self.block_bytes + offset
        return self.memory[start : start + nbytes]
