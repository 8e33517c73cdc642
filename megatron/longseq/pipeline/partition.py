"""Cutting a sequence into Seq1F1B segments (pure): `average` or `uniform_comp` (section 3.5).

uniform_comp makes every segment cost the same (Eq. 7) under Eq. 8's estimate
    FLOPs(S_i) = 2 n_i P + 2 L n_i (n_1 + ... + n_i) d
(P parameters, L layers, hidden d): later segments attend to more keys, so they get fewer tokens.
For a target cost T each n_i solves 2 L d n^2 + (2 P + 2 L d c_{i-1}) n - T = 0 (c = tokens before
it); T is found by bisection so the lengths add up to the sequence. Lengths are then rounded at
the segment boundaries to multiples of `granularity` (2 x context-parallel size, and the tensor-
parallel size under sequence parallelism), each segment keeping at least one granule.

Packed documents (--reset-attention-mask) change the attention term: a query sees only its own
document, so a segment's cost depends on where the micro-batch's documents lie, and the partition
is made per micro-batch (`document_partition`). Eq. 8 with each token's keys limited to its own
document -- the keys of its document before the segment's end -- gives the cost of segment [a, b)
    2 (b - a) P + 2 L d  sum_{t in [a, b)} (min(end(t), b) - start(t))
(start/end: t's document; one document is Eq. 8 itself). It grows with b and shrinks with a, so
greedy segments under a cost bound reach furthest (a search in the vector of a segment's costs at
every end) and a bisection on the bound finds the partition whose costliest segment is cheapest
(over boundaries on granules): ~0.1 s for a 128K sample on one CPU core. No segment is longer than
`max_length` (the static partition's longest): activation memory per segment stays what the
static partition plans for (buffers, MEMO's profile), whatever the documents.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

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
    """Segments of equal Eq.-8 FLOPs (Eq. 7) as boundaries on granules allow: the costliest
    segment as cheap as it can be. The exact lengths' common cost is a lower bound and rounding
    them gives a feasible bound; a bisection between the two with the greedy partition (each
    segment as long as the bound allows) finds the best. Rounding each boundary on its own could
    move two neighbours apart by a granule: 10% over the optimum at 4K tokens in 8 segments."""
    granules = _check(seq_length, k, granularity)
    dense, attn = 2.0 * num_params, 2.0 * num_layers * hidden
    if attn == 0:  # no attention term: every token costs the same
        return average(seq_length, k, granularity)
    lo, hi = 0.0, dense * seq_length + attn * seq_length * seq_length  # costs of no / all tokens
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(_lengths_for_cost(mid, k, dense, attn)) < seq_length:
            lo = mid
        else:
            hi = mid
    best = _rounded(_lengths_for_cost(hi, k, dense, attn), granularity, granules)
    top = max(segment_flops(best, num_params, num_layers, hidden))
    while top - lo > 1e-12 * top:
        mid = (lo + top) / 2
        found = _greedy_on_granules(mid, k, seq_length, granularity, dense, attn)
        lo, top, best = (lo, mid, found) if found else (mid, top, best)
    return best


def _rounded(exact: List[float], granularity: int, granules: int) -> List[int]:
    """The exact lengths' boundaries rounded to granules, every segment at least one long."""
    bounds, acc, k = [0], 0.0, len(exact)
    for i, n in enumerate(exact[:-1]):
        acc += n
        b = round(acc / granularity)
        bounds.append(min(max(b, bounds[-1] + 1), granules - (k - 1 - i)))
    bounds.append(granules)
    return [(b - a) * granularity for a, b in zip(bounds, bounds[1:])]


def _greedy_on_granules(bound: float, k: int, seq_length: int, g: int, dense: float, attn: float):
    """k segment lengths (granule multiples) each costing at most `bound` under Eq. 8, each as long
    as it may be while leaving a granule to every later one; None when they do not reach the end."""
    cost = lambda a, b: dense * (b - a) + attn * (b - a) * b  # noqa: E731  (segment [a, b) of one sequence)
    lengths, a = [], 0
    for i in range(k):
        last = seq_length - (k - 1 - i) * g
        # the largest b with attn b^2 + (dense - attn a) b - (dense a + bound) <= 0, on granules
        lin = dense - attn * a
        b = min(last, int((-lin + math.sqrt(lin * lin + 4 * attn * (dense * a + bound))) / (2 * attn)) // g * g)
        while b > a and cost(a, b) > bound:  # the root's rounding
            b -= g
        if b <= a or (i == k - 1 and b < seq_length):
            return None
        lengths.append(b - a)
        a = b
    return lengths


def segment_flops(lengths: List[int], num_params: int, num_layers: int, hidden: int) -> List[float]:
    """Eq. 8 for each segment."""
    out, before = [], 0
    for n in lengths:
        out.append(2.0 * n * num_params + 2.0 * num_layers * n * (before + n) * hidden)
        before += n
    return out


class DocumentCost:
    """Eq. 8 within documents for one micro-batch's document starts [b, S] (summed over its
    samples), from prefix sums: one segment's cost, or every end's on the granules at once."""

    def __init__(self, starts: torch.Tensor, num_params: int, num_layers: int, hidden: int):
        b, S = starts.shape
        index = torch.arange(S).expand(b, S)
        self.first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values  # [b, S] start(t)
        # end(t): the next document's start, S for the last (reversed running minimum of starts)
        nxt = torch.where(starts, index, torch.full_like(index, S))
        end = torch.cat([nxt[:, 1:], torch.full((b, 1), S)], 1).flip(1).cummin(1).values.flip(1)
        zero = torch.zeros(b, 1, dtype=torch.long)
        self.sum_first = torch.cat([zero, self.first.cumsum(1)], 1)  # [b, S + 1]
        self.sum_end = torch.cat([zero, end.cumsum(1)], 1)
        self.starts, self.samples, self.length = starts, b, S
        self.dense, self.attn = 2.0 * num_params, 2.0 * num_layers * hidden
        self._rows: Dict[tuple, torch.Tensor] = {}

    def ends(self, a: int, ends: torch.Tensor) -> torch.Tensor:
        """[n] costs of the segments [a, e) for the ends e [n] (long, > a)."""
        m = self.first[:, ends - 1].clamp(min=a)  # [b, n]: from m on, e-1's document: keys end at e
        pairs = (self.sum_end.gather(1, m) - self.sum_end[:, a : a + 1] + ends * (ends - m)
                 - (self.sum_first[:, ends] - self.sum_first[:, a : a + 1]))  # [b, n]
        return self.dense * (ends - a).double() * self.samples + self.attn * pairs.sum(0).double()

    def __call__(self, a: int, b: int) -> float:
        """The cost of segment [a, b): each query's keys are its document's before b."""
        return float(self.ends(a, torch.tensor([b]))[0])

    def row(self, a: int, granularity: int) -> torch.Tensor:
        """[G - a/g] costs of [a, e) for every granule end e after a (rising with e); kept, as the
        bisection asks again for the same starts."""
        if (a, granularity) not in self._rows:
            self._rows[(a, granularity)] = self.ends(a, torch.arange(a + granularity, self.length + 1, granularity))
        return self._rows[(a, granularity)]


def _greedy(cost: DocumentCost, k: int, granularity: int, cap: int, bound: float) -> Optional[List[int]]:
    """Boundaries (in granules) of k segments each as long as `bound` allows, or None when they
    do not reach the end. Each keeps one granule and leaves one to every later segment."""
    granules, bounds = cost.length // granularity, [0]
    for i in range(k):
        a = bounds[-1]
        furthest = min(granules - (k - 1 - i), a + cap) - a  # in granules after a
        within = int(torch.searchsorted(cost.row(a * granularity, granularity)[:furthest], bound, right=True))
        if within == 0:
            return None
        bounds.append(a + within)
    return bounds if bounds[-1] == granules else None


def segment_costs(cost: DocumentCost, lengths: List[int]) -> List[float]:
    """The cost of each segment of `lengths`, in order."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return [cost(a, b) for a, b in zip(bounds, bounds[1:])]


def document_partition(starts: torch.Tensor, k: int, num_params: int, num_layers: int, hidden: int,
                       granularity: int = 1, max_length: Optional[int] = None) -> List[int]:
    """Segment lengths for the micro-batch whose document starts are [b, S]: the costliest segment
    as cheap as boundaries on granules allow, none longer than max_length."""
    granules = _check(starts.shape[1], k, granularity)
    cap = granules if max_length is None else max_length // granularity
    if cap * k < granules:
        raise PartitionError(f"{k} segments of at most {max_length} tokens cannot hold {starts.shape[1]}")
    cost = DocumentCost(starts, num_params, num_layers, hidden)
    lo, hi = 0.0, cost(0, starts.shape[1])  # hi is feasible: every segment costs at most the whole
    while hi - lo > 1e-9 * hi:  # hi stays feasible: it ends within a billionth of the optimum
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _greedy(cost, k, granularity, cap, mid) else (mid, hi)
    bounds = _greedy(cost, k, granularity, cap, hi)
    return [(b - a) * granularity for a, b in zip(bounds, bounds[1:])]


def partition(seq_length: int, k: int, strategy: str, granularity: int = 1, num_params: int = 0,
              num_layers: int = 1, hidden: int = 1) -> List[int]:
    if strategy == "average":
        return average(seq_length, k, granularity)
    if strategy == "uniform_comp":
        return uniform_comp(seq_length, k, num_params, num_layers, hidden, granularity)
    raise PartitionError(f"--pipe-sp-strategy must be one of {STRATEGIES}, got {strategy!r}")
