"""MEMO's swap fraction alpha (section 4.1): the paper's LP, solved exactly.

    max alpha
    s.t. (S_input + S_attn + alpha S_others) / B <= T_layer             offload hides behind a layer
         live x (S_input + S_attn + alpha S_others + slack) <= M_cpu    host memory
         0 <= alpha <= 1

S_* are one layer's skeletal bytes (input, attention output and lse, the rest), B the device-to-
host bandwidth, T_layer one layer's forward time, live the most managed layers holding host
memory at once (measured: n - 2 on one stage, times the units a pipeline stage holds), M_cpu the
host budget. slack bounds what the runtime's layout adds to the linear formula: each slot rounded
up to 512 bytes, and alpha x tokens rounded to whole tokens (at most one row per tensor). With one
variable the LP's optimum is the smallest of the constraints' bounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.longseq.memo.buffers import ALIGN, aligned


class HostMemoryError(ValueError):
    """The plan needs more host memory than the budget; raised before training starts."""


def offloaded_rows(alpha: float, tokens: int) -> int:
    """How many leading tokens of a token-wise tensor go to host memory."""
    return int(round(alpha * tokens))


@dataclass(frozen=True)
class LayerSizes:
    """What one managed layer saves, as the runtime lays it out: the bytes of each whole storage
    (input first, then the attention's), and (rows, bytes per row) of each token-wise tensor."""

    wholes: Tuple[int, ...]
    parts: Tuple[Tuple[int, int], ...]

    @property
    def input_bytes(self) -> int:
        return self.wholes[0] if self.wholes else 0

    @property
    def attention_bytes(self) -> int:
        return sum(self.wholes[1:])

    @property
    def other_bytes(self) -> int:
        return sum(rows * row for rows, row in self.parts)

    @property
    def slack_bytes(self) -> int:
        return ALIGN * (len(self.wholes) + len(self.parts)) + sum(row for _, row in self.parts)

    @property
    def buffer_bytes(self) -> int:
        """A rounding buffer's share: every tensor whole, each slot aligned."""
        return sum(aligned(w) for w in self.wholes) + sum(aligned(rows * row) for rows, row in self.parts)

    def host_bytes(self, alpha: float) -> int:
        """The host block this layer fills at `alpha`, slot by slot as the runtime lays it out."""
        return sum(aligned(w) for w in self.wholes) + sum(
            aligned(offloaded_rows(alpha, rows) * row) for rows, row in self.parts)


@dataclass(frozen=True)
class LayerProfile:
    input_bytes: int
    attention_bytes: int
    other_bytes: int
    forward_seconds: float
    slack_bytes: int = 0

    @classmethod
    def largest(cls, sizes, forward_seconds: float) -> "LayerProfile":
        """The profile that bounds every measured layer (Seq1F1B segments differ): each kind's
        largest bytes."""
        return cls(max(s.input_bytes for s in sizes), max(s.attention_bytes for s in sizes),
                   max(s.other_bytes for s in sizes), forward_seconds, max(s.slack_bytes for s in sizes))


@dataclass(frozen=True)
class AlphaPlan:
    alpha: float
    bound_by: str  # "bandwidth", "host memory", "all tokens" or "forced"
    offload_seconds: float  # per layer at this alpha
    overlap: float  # fraction of the offload hidden behind the layer's forward (1 = fully)
    block_bytes: int  # host memory one layer holds at this alpha (the linear bound, slack included)
    host_bytes: int  # pinned host memory this alpha needs: live x block_bytes


def _size(nbytes: float) -> str:
    """Bytes in GiB, or in MiB below a tenth of a GiB (a tiny budget must not read as 0.00 GiB)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 0.1 * 2**30 else f"{nbytes / 2**20:.3f} MiB"


def block_bytes(p: LayerProfile, alpha: float) -> int:
    return aligned(math.ceil(p.input_bytes + p.attention_bytes + p.slack_bytes + alpha * p.other_bytes))


def check_fixed(p: LayerProfile, live: int, host_budget: float) -> None:
    fixed = block_bytes(p, 0.0)
    if live and fixed * live > host_budget:
        raise HostMemoryError(
            f"MEMO needs {_size(fixed * live)} of host memory even at alpha = 0 ({live} layers held at once x "
            f"{_size(fixed)} of layer input and attention output) but --memo-host-memory-gb allows "
            f"{_size(host_budget)}")


def solve_alpha(p: LayerProfile, bandwidth: float, live: int, host_budget: float,
                forced: Optional[float] = None) -> AlphaPlan:
    """The LP's optimum (or a forced alpha), checked against the host budget; `live` is the most
    managed layers that hold host memory at once."""
    if not (math.isfinite(bandwidth) and bandwidth > 0 and math.isfinite(p.forward_seconds) and p.forward_seconds >= 0):
        # measurements: a broken timer or copy would otherwise give alpha 1 or divide by zero
        raise ValueError(f"MEMO: a measured host bandwidth of {bandwidth} B/s and layer time of "
                         f"{p.forward_seconds} s cannot size alpha")
    check_fixed(p, live, host_budget)
    fixed = p.input_bytes + p.attention_bytes
    if forced is not None:
        alpha, bound = forced, "forced"
        if live * block_bytes(p, alpha) > host_budget:
            raise HostMemoryError(
                f"--memo-swap-fraction {forced} needs {_size(live * block_bytes(p, alpha))} of host memory; "
                f"--memo-host-memory-gb allows {_size(host_budget)}")
    else:
        bounds = {"all tokens": 1.0}
        if p.other_bytes > 0:
            bounds["bandwidth"] = (bandwidth * p.forward_seconds - fixed) / p.other_bytes
            if live:
                room = (host_budget / live - ALIGN - (fixed + p.slack_bytes)) / p.other_bytes
                bounds["host memory"] = room  # ALIGN: the block is rounded up to a slot
        bound = min(bounds, key=bounds.get)
        alpha = min(1.0, max(0.0, bounds[bound]))
    offload = (fixed + alpha * p.other_bytes) / bandwidth
    overlap = min(1.0, p.forward_seconds / offload) if offload > 0 else 1.0
    block = block_bytes(p, alpha)
    return AlphaPlan(alpha, bound, offload, overlap, block, live * block)
