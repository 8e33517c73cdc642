"""Which transfers one double-ring call makes: a block travels only as far as a query needs it.

Block x (ring position x's keys and values) is held at outer step o, inner step t by position
    h_x(o, t) = W * ((i + o) mod O) + (p + t) mod W,        x = W * i + p
(ring.py's schedule). Without packed documents every holder's queries meet every block and the
route is the plain double ring. With them, a holder whose queries share no document with the block
skips it (ring.py), and where no later holder needs it either, it is not sent on:
  - KV goes along the inner ring up to the last holder of this outer step that needs it, and on to
    the next inner ring while a later outer step needs it;
  - its dK/dV accumulator follows the same holders and then returns straight from the last one that
    needs it to where the block entered this inner ring (the ring's start holder), and after the
    last outer step that needs it straight to its owner -- instead of completing the circle.
The owner always holds its own block at (0, 0). Every rank works the route out from the same
`meets` matrix (the micro-batch's documents), so both ends of every transfer agree without asking.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

Recv = Tuple[int, int]  # (block, ring offset of the sender)


class Route:
    """The transfers of one ring call, from ring position `rc.ring_index`'s view. `meets` [R, R]
    bool: queries of position j meet keys of position src (None: all of them, the plain ring)."""

    def __init__(self, rc, meets: Optional[torch.Tensor] = None):
        self.rc, W, O = rc, rc.inner_size, rc.outer_size
        # (block, o) -> the last inner step whose holder needs it (-1: none); block -> the last
        # outer step that needs it
        self.last_inner: Dict[Tuple[int, int], int] = {(x, o): W - 1 for x in range(W * O) for o in range(O)}
        self.last_outer: Dict[int, int] = {x: O - 1 for x in range(W * O)}
        if meets is not None:
            self._limit(meets.tolist())

    def _limit(self, meets: List[List[bool]]) -> None:
        W, O = self.rc.inner_size, self.rc.outer_size
        for x in range(W * O):
            self.last_outer[x] = 0
            for o in range(O):
                need = [t for t in range(W) if (o, t) == (0, 0) or meets[self.holder(x, o, t)][x]]
                self.last_inner[x, o] = need[-1] if need else -1
                if need:
                    self.last_outer[x] = o

    def holder(self, x: int, o: int, t: int) -> int:
        W, O = self.rc.inner_size, self.rc.outer_size
        i, p = divmod(x, W)
        return W * ((i + o) % O) + (p + t) % W

    def _src(self, o: int, t: int) -> int:
        return self.rc.source(o, t)

    # ---- keys and values ---------------------------------------------------------------------
    def kv_inner(self, o: int, t: int) -> Tuple[bool, bool]:
        """(send the block in hand to the next position, receive the next step's block)."""
        if t + 1 >= self.rc.inner_size:
            return False, False
        return t < self.last_inner[self._src(o, t), o], t < self.last_inner[self._src(o, t + 1), o]

    def kv_outer(self, o: int) -> Tuple[bool, bool]:
        """(send this outer step's block to the next inner ring, receive the next outer block)."""
        if o + 1 >= self.rc.outer_size:
            return False, False
        return o < self.last_outer[self._src(o, 0)], o < self.last_outer[self._src(o + 1, 0)]

    # ---- dK/dV accumulators --------------------------------------------------------------------
    def acc_inner(self, o: int, t: int) -> Tuple[Optional[int], List[Recv]]:
        """After step (o, t): the offset to send the held block's accumulator to (None: keep or
        none held), and the accumulators to receive."""
        last = self.last_inner[self._src(o, t), o]
        send = None
        if t < last:
            send = 1
        elif t == last and t > 0:
            send = -t  # from the last holder that needs it back to the ring's start holder
        recvs = []
        if t + 1 < self.rc.inner_size and t < self.last_inner[self._src(o, t + 1), o]:
            recvs.append((self._src(o, t + 1), -1))
        start = self._src(o, 0)
        if t > 0 and t == self.last_inner[start, o]:
            recvs.append((start, t))
        return send, recvs

    def acc_outer(self, o: int) -> Tuple[Optional[int], List[Recv]]:
        """After outer step o: the same for the block that entered this inner ring at step o."""
        last = self.last_outer[self._src(o, 0)]
        send = None
        if o < last:
            send = 1
        elif o == last and o > 0:
            send = -o  # home to the owner
        recvs = []
        if o + 1 < self.rc.outer_size and o < self.last_outer[self._src(o + 1, 0)]:
            recvs.append((self._src(o + 1, 0), -1))
        me = self.rc.ring_index
        if o > 0 and o == self.last_outer[me]:
            recvs.append((me, o))
        return send, recvs
