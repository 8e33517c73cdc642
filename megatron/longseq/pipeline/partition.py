"""Cutting a sequence into Seq1F1B segments (pure): `average` or `uniform_comp` (section 3.5).

uniform_comp makes every segment cost the same (Eq. 7) under Eq. 8's estimate
    FLOPs(S_i) = 2 n_i P + 2 L n_i (n_1 + ... + n_i) d
(P parameters, L layers, hidden d): later segments attend to more keys, so they get fewer tokens.
For a target cost T each n_i solves 2 L d n^2 + (2 P + 2 L d c_{i-1}) n - T = 0 (c = tokens before
it); T is found by bisection so the lengths add up to the sequence. Lengths are then rounded at
the segment boundaries to multiples of `granularity` (2 x context-parallel size, and the tensor-
parallel size under sequence parallelism), each segment keeping at least one granule.
"""
from __future__ import annotations

import math
from typing import List

STRATEGIES = ("average", "uniform_comp")


class PartitionError(ValueError):
    pass


def _check(seq_length: int, k: int, granularity: int) -> int:
    if k < 1:
        raise PartitionError(f"--pipe-sp-splits must be >= 1, got {k}")
    if seq_length % granularity:
        raise PartitionError(f"--seq-length {seq_length} is not a multiple of the segment granularity "
                             f"{granularity} (2 x context parallel size, x tp with sequence parallel)")
    granules = seq_length // granularity
    if granules < k:
        raise PartitionError(f"--pipe-sp-splits {k} does not fit --seq-length {seq_length}: at most "
                             f"{granules} segments of {granularity} tokens")
    return granules


def average(seq_length: int, k: int, granularity: int = 1) -> List[int]:
    """As equal as the granularity allows; the longer segments first."""
    granules = _check(seq_length, k, granularity)
    base, extra = divmod(granules, k)
    return [(base + (i < extra)) * granularity for i in range(k)]


def _lengths_for_cost(target: float, k: int, dense: float, attn: float) -> List[float]:
    lengths, before = [], 0.0
    for _ in range(k):
        b = dense + attn * before
        n = (-b + math.sqrt(b * b + 4 * attn * target)) / (2 * attn)
        lengths.append(n)
        before += n
    return lengths


def uniform_comp(seq_length: int, k: int, num_params: int, num_layers: int, hidden: int,
                 granularity: int = 1) -> List[int]:
    """Segments of equal Eq.-8 FLOPs, rounded to the granularity."""
    granules = _check(seq_length, k, granularity)
    dense, attn = 2.0 * num_params, 2.0 * num_layers * hidden
    lo, hi = 0.0, dense * seq_length + attn * seq_length * seq_length  # costs of no / all tokens
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(_lengths_for_cost(mid, k, dense, attn)) < seq_length:
            lo = mid
        else:
            hi = mid
    exact = _lengths_for_cost(hi, k, dense, attn)
    # Round the boundaries (in granules), keeping every segment at least one granule long.
    bounds, acc = [0], 0.0
    for i, n in enumerate(exact[:-1]):
        acc += n
        b = round(acc / granularity)
        bounds.append(min(max(b, bounds[-1] + 1), granules - (k - 1 - i)))
    bounds.append(granules)
    return [(b - a) * granularity for a, b in zip(bounds, bounds[1:])]


def segment_flops(lengths: List[int], num_params: int, num_layers: int, hidden: int) -> List[float]:
    """Eq. 8 for each segment."""
    out, before = [], 0
    for n in lengths:
        out.append(2.0 * n * num_params + 2.0 * num_layers * n * (before + n) * hidden)
        before += n
    return out


def partition(seq_length: int, k: int, strategy: str, granularity: int = 1, num_params: int = 0,
              num_layers: int = 1, hidden: int = 1) -> List[int]:
    if strategy == "average":
        return average(seq_length, k, granularity)
    if strategy == "uniform_comp":
        return uniform_comp(seq_length, k, num_params, num_layers, hidden, granularity)
    raise PartitionError(f"--pipe-sp-strategy must be one of {STRATEGIES}, got {strategy!r}")
