"""Passkey retrieval: a synthetic long-range task (--passkey-data).

Every sample is random filler with a key planted early and asked for at the very end:

    filler ... KEY_START k_1..k_n filler ... filler QUERY k_1..k_n
    ^ key position uniform in the first quarter          ^ the last n+1 tokens
      (--passkey-depth: the first fraction of the sequence where the key may be; 0.25 by default)

Key tokens come from ten ids that never occur as filler, and the loss counts only the answer
(the key after QUERY), so its chance level is ln(10) = 2.303 per token. Predicting the key needs
the query to attend across the whole sequence -- a model whose attention stops short of the start
cannot beat chance. With depth 1 the key may be anywhere, so the distance to it varies from a few
tokens to the whole sequence, and a model must find the key by its marker rather than by a fixed
distance: the setting of a context-extension test. Samples are a pure function of (seed, index),
like Megatron's mock data.
"""
from __future__ import annotations

import numpy as np
import torch

KEY_START, QUERY = 1, 2
KEY_IDS = range(10, 20)  # the ten key "digits"
FILLER_START = 20  # filler ids: 20 .. vocab-1
CHANCE_LOSS = float(np.log(len(KEY_IDS)))


class PasskeyDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, key_length: int = 1, seed: int = 0,
                 depth: float = 0.25):
        if vocab_size <= FILLER_START + 10:
            raise ValueError(f"passkey data needs a vocabulary size > {FILLER_START + 10}, got {vocab_size}")
        if key_length < 1:  # no key: an all-zero loss mask, a loss of 0 that says nothing
            raise ValueError(f"a passkey needs at least one token, got a key length of {key_length}")
        if seq_length < 8 * (key_length + 2):
            raise ValueError(f"a sequence length of {seq_length} is too short for a key of {key_length} tokens "
                             f"(at least {8 * (key_length + 2)} needed)")
        if not 0 < depth <= 1:
            raise ValueError(f"passkey depth must be in (0, 1], got {depth}")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.key_length, self.seed, self.depth = key_length, seed, depth

    def __len__(self):
        return self.num_samples

    def sequence(self, idx: int) -> np.ndarray:
        """The S+1 token ids of sample `idx`."""
        rng = np.random.default_rng([self.seed, idx])
        n, length = self.key_length, self.seq_length + 1
        seq = rng.integers(FILLER_START, self.vocab_size, size=length)
        key = rng.integers(KEY_IDS.start, KEY_IDS.stop, size=n)
        at = int(rng.integers(0, self.key_positions()))
        seq[at], seq[at + 1 : at + 1 + n] = KEY_START, key
        seq[length - n - 1], seq[length - n :] = QUERY, key
        return seq

    def key_positions(self) -> int:
        """How many positions the key marker may take: the first `depth` of the sequence, and never
        so late that the key (at+1 .. at+n) would reach the query at S-n."""
        return max(1, min(int(self.seq_length * self.depth), self.seq_length - 2 * self.key_length))

    def __getitem__(self, idx: int):
        seq = torch.from_numpy(self.sequence(idx)).long()
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        loss_mask[self.seq_length - self.key_length :] = 1.0  # the labels that are the key
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq_length)}


def build_passkey_datasets(args, num_samples):
    """Train, validation and test splits: disjoint seeds, Megatron's sample counts."""
    return [PasskeyDataset(n, args.seq_length, args.vocab_size, args.passkey_length, seed=args.seed + 1000 * i,
                           depth=args.passkey_depth)
            if n > 0 else None for i, n in enumerate(num_samples)]
