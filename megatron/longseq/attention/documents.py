"""Packed documents: where their tokens live under context parallelism, and which pieces of a
ring block attend to each other. Pure arithmetic on token indices.

A packed sample of S tokens holds documents back to back. With --reset-attention-mask a token
sees only the earlier tokens of its own document; the EOD that closes a document belongs to it
(Megatron's `_get_ltor_masks_and_position_ids`). `starts` [S] bool marks each document's first
token; it travels with the batch whole (never reduced to a rank's tokens), so every rank can
work out what every other rank holds without exchanging anything.

Placement. Megatron's causal balance (chunks j and 2R-1-j of the sample) balances plain causal
attention, where a query's work grows with its position. In a packed sample work grows with the
position inside the document, so the balance is applied to every document instead: each is cut
into 2R pieces and ring position j takes pieces j and 2R-1-j (the scheme Transformer Engine uses
for THD, where every document length must be a multiple of 2R). Here lengths are arbitrary: a
document of L = 2R*base + rem tokens has pieces of base tokens, and its rem extra tokens go one
each to the positions holding the fewest tokens so far (a second round takes the rest). That
keeps the positions' counts within one token of each other after every document, so at the end,
where the total is a multiple of R, they are equal -- every position holds S/R tokens, as the
ring and the all-to-all need. Causal work per position stays within a token's row of even for
every document, whatever the lengths (`tools/plan_context_parallel.py --documents` measures it).

Pieces. A ring block pairs the queries of one position with the keys of another. Both token
lists are sorted, so each document's tokens are one contiguous range of rows on either side.
Per document met on both sides: the same tokens on both sides attend causally (one square
kernel call); otherwise the block splits into runs of consecutive tokens and every pair of runs
gives at most a full rectangle (keys all earlier) and a causal square (shared tokens). Adjacent
rectangles are joined, so a balanced block costs one kernel call per document. A block with no
document in common has no pieces and is skipped.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


def document_starts(tokens: Tensor, eod: int) -> Tensor:
    """[..., S] tokens -> [..., S] bool: True at the first token of every document (position 0,
    and every token after an EOD)."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = tokens[..., :-1] == eod
    return starts


def document_ids(starts: Tensor) -> Tensor:
    """[..., S] starts -> [..., S] long: the index of each token's document."""
    return starts.long().cumsum(-1) - 1


def document_bounds(starts: Tensor) -> List[int]:
    """[n] starts of one range -> its documents' boundaries [0, ..., n]. A range that begins
    inside a document (a Seq1F1B segment) starts a piece of it."""
    inner = starts[1:].nonzero().flatten() + 1
    return [0] + inner.tolist() + [starts.numel()]


# ---- placement --------------------------------------------------------------------------------

def _piece_sizes(length: int, ring: int, counts: List[int]) -> List[int]:
    """Sizes of one document's 2R pieces (position r owns pieces r and 2R-1-r); updates `counts`,
    the tokens each position holds so far. Extra tokens go to the emptiest positions first."""
    base, rem = divmod(length, 2 * ring)
    sizes = [base] * (2 * ring)
    for piece_of in (lambda r: r, lambda r: 2 * ring - 1 - r):  # two rounds: first pieces, then second
        take = min(rem, ring)
        for r in sorted(range(ring), key=lambda r: (counts[r] + sizes[r] + sizes[2 * ring - 1 - r], r))[:take]:
            sizes[piece_of(r)] += 1
        rem -= take
    for r in range(ring):
        counts[r] += sizes[r] + sizes[2 * ring - 1 - r]
    return sizes


def balanced_ring_tokens(starts: Tensor, ring: int) -> List[Tensor]:
    """[n] starts of one sample range -> for each of the R ring positions the sorted indices
    (into 0..n-1) of its tokens: pieces r and 2R-1-r of every document."""
    bounds, counts = document_bounds(starts), [0] * ring
    piece_starts, owners = [], []
    for a, b in zip(bounds, bounds[1:]):
        offset = a
        for p, size in enumerate(_piece_sizes(b - a, ring, counts)):
            piece_starts.append(offset)
            owners.append(min(p, 2 * ring - 1 - p))
            offset += size
    # each token's piece is the last one starting at or before it (empty pieces are passed over)
    piece = torch.searchsorted(torch.tensor(piece_starts), torch.arange(starts.numel()), right=True) - 1
    owner = torch.tensor(owners)[piece]
    return [(owner == r).nonzero().flatten() for r in range(ring)]


# ---- pieces of a block ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """Query rows [q0, q1) attend key rows [k0, k1) of one block: causally (the same tokens on
    both sides, a square) or fully (every key precedes every query). `sample`: which sample of
    the micro-batch (None: all of them alike)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    sample: Optional[int] = None


class Pieces(list):
    """A block's pieces, with what a kernel makes of them kept beside (varlen.py's plans, by
    shape and device): a layout hands every layer the same list, so they are made once a batch."""

    def __init__(self, pieces=()):
        super().__init__(pieces)
        self.plans: dict = {}


@dataclass(frozen=True)
class _Run:
    """Consecutive tokens [start, end) of one document, at rows [row, row + end - start)."""

    doc: int
    start: int
    end: int
    row: int

    def rows(self, a: int, b: int) -> Tuple[int, int]:
        return self.row + a - self.start, self.row + b - self.start


def _runs(tokens: Tensor, doc_of: Tensor) -> Dict[int, List[_Run]]:
    """Sorted token indices -> their maximal runs of consecutive tokens, by document."""
    by_doc: Dict[int, List[_Run]] = defaultdict(list)
    if tokens.numel() == 0:
        return by_doc
    docs = doc_of[tokens]
    cut = ((tokens[1:] != tokens[:-1] + 1) | (docs[1:] != docs[:-1])).nonzero().flatten() + 1
    first = [0] + cut.tolist()
    last = cut.tolist() + [tokens.numel()]
    for d, g, a, b in zip(docs[first].tolist(), tokens[first].tolist(), first, last):
        by_doc[d].append(_Run(d, g, g + b - a, a))
    return by_doc


def _run_pieces(q: _Run, k: _Run) -> List[Piece]:
    """What queries of run q see of run k (same document): the keys before the shared tokens in
    full and the shared tokens causally; queries after all of k see all of k."""
    pieces = []
    lo, hi = max(q.start, k.start), min(q.end, k.end)
    if lo < hi:
        if k.start < lo:
            pieces.append(Piece(*q.rows(lo, hi), *k.rows(k.start, lo), False))
        pieces.append(Piece(*q.rows(lo, hi), *k.rows(lo, hi), True))
    tail = max(q.start, k.end)
    if tail < q.end:
        pieces.append(Piece(*q.rows(tail, q.end), *k.rows(k.start, k.end), False))
    return pieces


def _join(pieces: List[Piece], along: str) -> List[Piece]:
    """Join full pieces that are adjacent along 'k' (same query rows) or 'q' (same key rows)."""
    out: List[Piece] = []
    for p in sorted(pieces, key=lambda p: (p.q0, p.k0) if along == "k" else (p.k0, p.k1, p.q0)):
        last = out[-1] if out else None
        if last is not None and not (last.causal or p.causal):
            if along == "k" and (last.q0, last.q1, last.k1) == (p.q0, p.q1, p.k0):
                out[-1] = replace(last, k1=p.k1)
                continue
            if along == "q" and (last.k0, last.k1, last.q1) == (p.k0, p.k1, p.q0):
                out[-1] = replace(last, q1=p.q1)
                continue
        out.append(p)
    return out


def block_pieces(q_tokens: Tensor, k_tokens: Tensor, doc_of: Tensor) -> List[Piece]:
    """The pieces of the block whose query rows hold tokens `q_tokens` and key rows `k_tokens`
    (sorted indices into one sample whose token -> document map is `doc_of` [S])."""
    q_docs, k_docs = _runs(q_tokens, doc_of), _runs(k_tokens, doc_of)
    pieces: List[Piece] = []
    for doc, q_runs in q_docs.items():
        k_runs = k_docs.get(doc)
        if not k_runs:
            continue
        if [(r.start, r.end) for r in q_runs] == [(r.start, r.end) for r in k_runs]:
            # the same tokens: one causal square over the document's rows on either side
            pieces.append(Piece(q_runs[0].row, _end_row(q_runs), k_runs[0].row, _end_row(k_runs), True))
            continue
        pieces += _join(_join([p for qr in q_runs for kr in k_runs for p in _run_pieces(qr, kr)], "k"), "q")
    return sorted(pieces, key=lambda p: (p.q0, p.k0))


def _end_row(runs: Sequence[_Run]) -> int:
    return runs[-1].row + runs[-1].end - runs[-1].start


# ---- balance ---------------------------------------------------------------------------------------

def causal_work(starts: Tensor, tokens: Tensor) -> int:
    """(query, key) pairs the queries `tokens` attend in a sample with document starts [S]:
    each query sees its document's tokens up to itself. Attention FLOPs are proportional."""
    index = torch.arange(starts.numel())
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(0).values  # each token's document start
    return int((index - first + 1)[tokens].sum())


def work_imbalance(starts: Tensor, tokens: List[Tensor]) -> float:
    """max / mean causal work over the ring positions holding `tokens` (1.0: perfectly even; a
    ring step waits for its slowest position)."""
    work = [causal_work(starts, t) for t in tokens]
    return max(work) * len(work) / sum(work)


def lognormal_starts(seq: int, mean: float, sigma: float, generator: torch.Generator) -> Tensor:
    """[seq] starts of a sample packed with documents of log-normal lengths (mean `mean`, shape
    `sigma`), the last one cut where the sample ends."""
    mu = torch.log(torch.tensor(mean)) - sigma ** 2 / 2  # E[exp(N(mu, sigma^2))] = mean
    starts, at = torch.zeros(seq, dtype=torch.bool), 0
    while at < seq:
        starts[at] = True
        at += max(1, int(torch.exp(mu + sigma * torch.randn((), generator=generator))))
    return starts
