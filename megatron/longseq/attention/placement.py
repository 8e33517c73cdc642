"""Where each token lives under context parallelism, and how heads are split: pure arithmetic.

Sequence (S tokens) -> 2R chunks of S/(2R) (R = ring size). Ring position j owns chunks j and
2R-1-j (Megatron's causal load balance: every position gets one early and one late chunk, so every
ring step does the same work). Before the head-parallel all-to-all those S/R tokens are spread over
the hp ranks of the position: hp rank i holds the i-th contiguous 1/hp of [chunk j ; chunk 2R-1-j].
After the all-to-all gathers the sequence in hp order, every rank of ring position j holds exactly
[chunk j ; chunk 2R-1-j] for its share of the heads. The data loader applies these indices to every
per-token tensor (tokens, labels, loss mask, position ids), so no QKV is ever reshuffled at run time
and RoPE rotates each token by its true position. Packed documents (--reset-attention-mask) are
placed document by document instead (documents.py), same counts per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron.longseq.attention.documents import (Piece, Pieces, balanced_ring_tokens, block_pieces, document_ids,
                                                   document_starts)

DOCUMENT_STARTS = "document_starts"  # the batch key of the whole samples' document starts [b, S]
SEGMENT_LENGTHS = "segment_lengths"  # the batch key of its Seq1F1B segments [k], when documents choose them


def ring_chunks(seq_len: int, ring: int, ring_index: int) -> torch.Tensor:
    """Token indices of ring position `ring_index`: [chunk j ; chunk 2R-1-j] in sequence order."""
    chunk = seq_len // (2 * ring)
    first = torch.arange(ring_index * chunk, (ring_index + 1) * chunk)
    last = torch.arange((2 * ring - 1 - ring_index) * chunk, (2 * ring - ring_index) * chunk)
    return torch.cat([first, last])


def ring_tokens(seq_len: int, ring: int, starts: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Every ring position's token indices in sequence order: Megatron's chunks, or with packed
    documents (`starts` [S]) each document's balanced pieces (documents.py)."""
    if starts is None:
        return [ring_chunks(seq_len, ring, j) for j in range(ring)]
    return balanced_ring_tokens(starts, ring)


def local_token_indices(seq_len: int, hp: int, ring: int, hp_index: int, ring_index: int,
                        starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices (into 0..S-1) of the tokens rank (hp_index, ring_index) holds, in its local order."""
    if hp * ring == 1:  # the whole sequence in order: any length (a packed micro-batch's segments are)
        return torch.arange(seq_len)
    if seq_len % (2 * hp * ring):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context parallel size "
                         f"{hp * ring} = {2 * hp * ring}")
    tokens = ring_tokens(seq_len, ring, starts)[ring_index]
    per_rank = tokens.numel() // hp
    return tokens[hp_index * per_rank : (hp_index + 1) * per_rank]


def segmented_token_indices(lengths: List[int], hp: int, ring: int, hp_index: int, ring_index: int,
                            starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """With Seq1F1B segments every segment is placed on its own (each needs the whole ring), so a
    rank holds its share of segment 0, then of segment 1, ... One segment: local_token_indices."""
    pieces, offset = [], 0
    for n in lengths:
        part = None if starts is None else starts[offset : offset + n]
        pieces.append(offset + local_token_indices(n, hp, ring, hp_index, ring_index, part))
        offset += n
    return torch.cat(pieces)


@dataclass(frozen=True)
class TokenPlacement:
    """Which tokens of a sample one rank holds: its share of every Seq1F1B segment (`lengths`),
    and with packed documents a share that depends on the sample's documents."""

    lengths: Sequence[int]
    hp: int
    ring: int
    hp_index: int
    ring_index: int

    def indices(self, starts: Optional[torch.Tensor] = None) -> torch.Tensor:
        return segmented_token_indices(list(self.lengths), self.hp, self.ring, self.hp_index, self.ring_index, starts)


class RankTokens(torch.utils.data.Dataset):
    """A GPT dataset seen by one context-parallel rank: every per-token tensor of a sample
    ([s] tokens, labels, loss mask, position ids) reduced to this rank's indices, in order.

    With packed documents (`eod` given: --reset-attention-mask) the sample also carries its
    document starts [S], whole: they choose this rank's tokens here, and the attention derives
    every other rank's from them. No dense [S, S] mask is ever made.

    `partitioner` ([b, S] starts -> segment lengths): the micro-batch's documents choose its
    Seq1F1B segments (partition.document_partition), so its samples are placed together, in
    `collate` (the loader's collate_fn), and the batch carries the lengths [k] (SEGMENT_LENGTHS)."""

    def __init__(self, dataset, placement: TokenPlacement, eod: Optional[int] = None,
                 partitioner: Optional[Callable[[torch.Tensor], List[int]]] = None):
        if partitioner is not None and eod is None:
            raise ValueError("a per-micro-batch partition needs packed documents (eod)")
        self.dataset, self.placement, self.eod, self.partitioner = dataset, placement, eod, partitioner
        self.fixed = placement.indices() if eod is None else None

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        sample = self.dataset[i]
        if "attention_mask" in sample:
            raise ValueError("the dataset made a dense attention mask; document masks come from the EOD tokens")
        if self.eod is None:
            return {key: value[self.fixed] for key, value in sample.items()}
        starts = document_starts(sample["tokens"], self.eod)
        if self.partitioner is not None:  # placed with the rest of its micro-batch, in collate
            return {**sample, DOCUMENT_STARTS: starts}
        idx = self.placement.indices(starts)
        return {**{key: value[idx] for key, value in sample.items()}, DOCUMENT_STARTS: starts}

    def collate(self, samples: List[dict]) -> dict:
        """The loader's batch; with a partitioner, each sample reduced to this rank's tokens of the
        segments its micro-batch's documents choose."""
        batch = torch.utils.data.default_collate(samples)
        if self.partitioner is None:
            return batch
        starts = batch.pop(DOCUMENT_STARTS)  # [b, S]
        lengths = self.partitioner(starts)
        placement = replace(self.placement, lengths=tuple(lengths))
        idx = torch.stack([placement.indices(s) for s in starts])  # [b, S / cp]
        return {**{key: value.gather(1, idx) for key, value in batch.items()},
                DOCUMENT_STARTS: starts, SEGMENT_LENGTHS: torch.tensor(lengths)}


class DocumentLayout:
    """One micro-batch's packed documents as the ring sees them, from the samples' document
    starts [b, S]: the tokens every ring position holds in every Seq1F1B segment (the placement
    the data loader applied), and the pieces of every ring block. Built once per micro-batch and
    shared by all layers, which ask for the same blocks."""

    def __init__(self, starts: torch.Tensor, ring: int, segment_lengths: Optional[Sequence[int]] = None):
        self.starts = starts.cpu()
        self.doc_of = document_ids(self.starts)  # [b, S]
        lengths = list(segment_lengths) if segment_lengths else [self.starts.shape[1]]
        if sum(lengths) != self.starts.shape[1]:
            raise ValueError(f"segments {lengths} do not add up to the sample's {self.starts.shape[1]} tokens")
        self.offsets = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        self.ring = ring
        self._tokens: Dict[tuple, List[torch.Tensor]] = {}
        self._pieces: Dict[tuple, Pieces] = {}
        self.routes: Dict[tuple, object] = {}  # ring.py's transfer routes, by segment pair

    def tokens(self, sample: int, segment: int, position: int) -> torch.Tensor:
        """Sorted indices (into the sample) of the tokens ring position `position` holds of `segment`."""
        key = (sample, segment)
        if key not in self._tokens:
            a, b = self.offsets[segment], self.offsets[segment + 1]
            self._tokens[key] = [a + t for t in ring_tokens(b - a, self.ring, self.starts[sample, a:b])]
        return self._tokens[key][position]

    def pieces(self, q_segment: int, k_segment: int, j: int, src: int) -> List[Piece]:
        """Pieces of the block: position j's queries of q_segment against position src's keys of
        k_segment, for every sample of the micro-batch."""
        key = (q_segment, k_segment, j, src)
        if key not in self._pieces:
            self._pieces[key] = Pieces(
                replace(p, sample=b) for b in range(self.starts.shape[0])
                for p in block_pieces(self.tokens(b, q_segment, j), self.tokens(b, k_segment, src), self.doc_of[b]))
        return self._pieces[key]

    def meeting(self, q_segment: int, k_segment: int) -> torch.Tensor:
        """[R, R] bool: whether position j's queries of q_segment see any of position src's keys of
        k_segment (a document on both sides with a key no later than a query, in any sample): the
        blocks that have pieces, for every pair at once."""
        met = torch.zeros(self.ring, self.ring, dtype=torch.bool)
        for b in range(self.starts.shape[0]):
            last_query = self._extreme(b, q_segment, "amax", -1)  # [R, docs]: -1 where none
            first_key = self._extreme(b, k_segment, "amin", self.starts.shape[1])
            met |= (first_key[None, :, :] <= last_query[:, None, :]).any(-1)  # [j, src]
        return met

    def _extreme(self, sample: int, segment: int, reduce: str, none: int) -> torch.Tensor:
        """[R, documents] the first or last token each position holds of each document of the
        sample in the segment (`none` where it holds none)."""
        out = torch.full((self.ring, int(self.doc_of[sample, -1]) + 1), none, dtype=torch.long)
        for r in range(self.ring):
            tokens = self.tokens(sample, segment, r)
            out[r].scatter_reduce_(0, self.doc_of[sample, tokens], tokens, reduce)
        return out

    def meet(self, q_segment: int, k_segment: int) -> bool:
        """Whether a document has tokens in both segments, in any sample (every rank gets the same
        answer). Documents are contiguous: one that reaches a later segment from an earlier one
        holds the earlier one's last token and the later one's first."""
        last, first = self.offsets[k_segment + 1] - 1, self.offsets[q_segment]
        return bool((self.doc_of[:, last] == self.doc_of[:, first]).any())


@dataclass(frozen=True)
class HeadSplit:
    """How this tp rank's heads are divided over the hp ranks.

    q_counts[i]: query heads on hp rank i. KV heads are either split (kv_counts) or, when there are
    fewer KV heads than hp ranks, each is repeated `kv_repeat` times first (LoongTrain 4.2) so that
    every hp rank receives the one KV head its query heads use."""

    q_counts: List[int]
    kv_counts: List[int]
    kv_repeat: int


def split_heads(num_heads: int, num_kv: int, hp: int) -> HeadSplit:
    """Query heads contiguous per hp rank, as even as possible (uneven only for MHA, where a query
    head and its KV head always move together)."""
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not divisible by {num_kv} KV heads")
    if num_heads % hp == 0:
        q_counts = [num_heads // hp] * hp
    elif num_kv == num_heads and num_heads >= hp:
        base, extra = divmod(num_heads, hp)
        q_counts = [base + (i < extra) for i in range(hp)]
    else:
        raise ValueError(f"{num_heads} query heads per tensor-parallel rank cannot be split over "
                         f"head-parallel size {hp} (uneven splits need MHA and heads >= hp)")
    if num_kv == num_heads:
        return HeadSplit(q_counts, list(q_counts), 1)
    if num_kv % hp == 0:
        return HeadSplit(q_counts, [num_kv // hp] * hp, 1)
    if hp % num_kv == 0:
        return HeadSplit(q_counts, [1] * hp, hp // num_kv)  # replicate KV to one head per hp rank
    raise ValueError(f"{num_kv} KV heads per tensor-parallel rank and head-parallel size {hp}: one must "
                     f"divide the other")
