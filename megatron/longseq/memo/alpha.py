"""MEMO's swap fraction alpha (section 4.1): the paper's LP, solved exactly.

    max alpha
    s.t. (S_input + S_attn + alpha S_others) / B <= T_layer            offload hides behind a layer
         (n - 2) (S_input + S_attn + alpha S_others) x in_flight <= M_cpu   host memory
         0 <= alpha <= 1

S_* are one layer's skeletal bytes (input, attention output, the rest), B the device-to-host
bandwidth, T_layer one layer's forward time, n the layers (the last two keep their activations),
in_flight how many units (micro-batches, or Seq1F1B segments) a stage holds at once (1, or the
pipeline warm-up).
With one variable the LP's optimum is the smallest of the constraints' bounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class HostMemoryError(ValueError):
    """The plan needs more host memory than the budget; raised before training starts."""


@dataclass(frozen=True)
class LayerProfile:
    input_bytes: int
    attention_bytes: int
    other_bytes: int
    forward_seconds: float


@dataclass(frozen=True)
class AlphaPlan:
    alpha: float
    bound_by: str  # "bandwidth", "host memory", "all tokens" or "forced"
    offload_seconds: float  # per layer at this alpha
    overlap: float  # fraction of the offload hidden behind the layer's forward (1 = fully)
    host_bytes: int  # pinned host memory this alpha needs


def _size(nbytes: float) -> str:
    """Bytes in GiB, or in MiB below a tenth of a GiB (a tiny budget must not read as 0.00 GiB)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 0.1 * 2**30 else f"{nbytes / 2**20:.3f} MiB"


def _host_bytes(p: LayerProfile, alpha: float, layers: int, in_flight: int) -> int:
    per_layer = p.input_bytes + p.attention_bytes + alpha * p.other_bytes
    return int(max(layers - 2, 0) * per_layer * in_flight)


def solve_alpha(p: LayerProfile, bandwidth: float, layers: int, host_budget: float, in_flight: int = 1,
                forced: Optional[float] = None) -> AlphaPlan:
    """The LP's optimum (or a forced alpha), checked against the host budget."""
    fixed = p.input_bytes + p.attention_bytes
    managed = max(layers - 2, 0) * in_flight
    if managed and fixed * managed > host_budget:
        raise HostMemoryError(
            f"MEMO needs {_size(fixed * managed)} of host memory even at alpha = 0 "
            f"({layers - 2} layers x {in_flight} unit(s) in flight x {_size(fixed)} of layer inputs "
            f"and attention outputs) but --memo-host-memory-gb allows {_size(host_budget)}")
    if forced is not None:
        alpha, bound = forced, "forced"
        need = _host_bytes(p, alpha, layers, in_flight)
        if need > host_budget:
            raise HostMemoryError(
                f"--memo-swap-fraction {forced} needs {_size(need)} of host memory; "
                f"--memo-host-memory-gb allows {_size(host_budget)}")
    else:
        bounds = {"all tokens": 1.0}
        if p.other_bytes > 0:
            bounds["bandwidth"] = (bandwidth * p.forward_seconds - fixed) / p.other_bytes
            if managed:
                bounds["host memory"] = (host_budget / managed - fixed) / p.other_bytes
        bound = min(bounds, key=bounds.get)
        alpha = min(1.0, max(0.0, bounds[bound]))
    offload = (fixed + alpha * p.other_bytes) / bandwidth
    overlap = min(1.0, p.forward_seconds / offload) if offload > 0 else 1.0
    return AlphaPlan(alpha, bound, offload, overlap, _host_bytes(p, alpha, layers, in_flight))
