"""Where each token lives under context parallelism, and how heads are split: pure arithmetic.

Sequence (S tokens) -> 2R chunks of S/(2R) (R = ring size). Ring position j owns chunks j and
2R-1-j (Megatron's causal load balance: every position gets one early and one late chunk, so every
ring step does the same work). Before the head-parallel all-to-all those S/R tokens are spread over
the hp ranks of the position: hp rank i holds the i-th contiguous 1/hp of [chunk j ; chunk 2R-1-j].
After the all-to-all gathers the sequence in hp order, every rank of ring position j holds exactly
[chunk j ; chunk 2R-1-j] for its share of the heads. The data loader applies these indices to every
per-token tensor (tokens, labels, loss mask, position ids), so no QKV is ever reshuffled at run time
and RoPE rotates each token by its true position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch


def ring_chunks(seq_len: int, ring: int, ring_index: int) -> torch.Tensor:
    """Token indices of ring position `ring_index`: [chunk j ; chunk 2R-1-j] in sequence order."""
    chunk = seq_len // (2 * ring)
    first = torch.arange(ring_index * chunk, (ring_index + 1) * chunk)
    last = torch.arange((2 * ring - 1 - ring_index) * chunk, (2 * ring - ring_index) * chunk)
    return torch.cat([first, last])


def local_token_indices(seq_len: int, hp: int, ring: int, hp_index: int, ring_index: int) -> torch.Tensor:
    """Indices (into 0..S-1) of the tokens rank (hp_index, ring_index) holds, in its local order."""
    if seq_len % (2 * hp * ring):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context parallel size "
                         f"{hp * ring} = {2 * hp * ring}")
    tokens = ring_chunks(seq_len, ring, ring_index)
    per_rank = tokens.numel() // hp
    return tokens[hp_index * per_rank : (hp_index + 1) * per_rank]


def segmented_token_indices(lengths: List[int], hp: int, ring: int, hp_index: int, ring_index: int) -> torch.Tensor:
    """With Seq1F1B segments every segment is placed on its own (each needs the whole ring), so a
    rank holds its share of segment 0, then of segment 1, ... One segment: local_token_indices."""
    pieces, offset = [], 0
    for n in lengths:
        pieces.append(offset + local_token_indices(n, hp, ring, hp_index, ring_index))
        offset += n
    return torch.cat(pieces)


class RankTokens(torch.utils.data.Dataset):
    """A GPT dataset seen by one context-parallel rank: every per-token tensor of a sample
    ([s] tokens, labels, loss mask, position ids) reduced to this rank's indices, in order."""

    def __init__(self, dataset, indices: torch.Tensor):
        self.dataset, self.indices = dataset, indices

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        sample = self.dataset[i]
        if "attention_mask" in sample:
            raise ValueError("document attention masks are not supported with context parallelism")
        return {key: value[self.indices] for key, value in sample.items()}


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
