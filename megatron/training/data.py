"""Datasets (megatron-core's GPTDataset / MockGPTDataset), Megatron's sample order, the batch.

Sample order is Megatron's pretraining sampler: the global stream of sample indices is consumed in
steps of micro_batch_size x dp; data-parallel rank r takes slice r of each step. A run resumed
from `consumed_samples` continues the stream exactly where it stopped.
"""
from __future__ import annotations

import signal
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.longseq.attention.placement import RankTokens, TokenPlacement
from megatron.longseq.pipeline.partition import document_partition
from megatron.training.passkey import build_passkey_datasets
from megatron.training.validate import num_parameters, train_samples


def train_valid_test_num_samples(args):
    """Megatron's sizes: the training samples, every evaluation (+1 at the end), one test pass."""
    periodic = args.train_iters // args.eval_interval if args.eval_interval else 0
    evals = (periodic + 1) * args.eval_iters if args.eval_iters > 0 else 0
    return [train_samples(args), evals * args.global_batch_size, args.eval_iters * args.global_batch_size]


def build_datasets(args, tokenizer, num_samples):
    if getattr(args, "passkey_data", False):
        return build_passkey_datasets(args, num_samples)
    per_split = _blend_per_split(args, num_samples)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path) if args.data_path else None,
        blend_per_split=per_split,
        split=None if per_split else args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # never a dense [S, S] mask: document masks come from the EOD tokens (placement.RankTokens)
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    # A split no evaluation reads is not built (its share of the documents stays out of training):
    # megatron-core would loop forever on one that received no documents.
    for i in (1, 2):
        if not num_samples[i] and not per_split:
            config.split_matrix[i] = None
    cls = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, num_samples, lambda: True, config).build()


def _blend_per_split(args, num_samples) -> Optional[list]:
    """Megatron's --train/valid/test-data-path as megatron-core's blend_per_split (None without
    them): a split no evaluation reads is not built, as with --split."""
    paths = [getattr(args, f"{name}_data_path", None) for name in ("train", "valid", "test")]
    if not any(paths):
        return None
    return [get_blend_from_list(path) if path and n else None for path, n in zip(paths, num_samples)]


class PretrainingSampler:
    """Yields this data-parallel rank's micro-batch indices, starting at `consumed_samples`."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the dataset's {total_samples}")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self):
        return (self.total - self.consumed) // (self.mbs * self.dp_size)

    def __iter__(self):
        step = self.mbs * self.dp_size
        lo = self.dp_rank * self.mbs
        for start in range(self.consumed, self.total - step + 1, step):
            yield list(range(start + lo, start + lo + self.mbs))


# What a batch carries: the sample's per-token tensors, each [S]. A blend of datasets (--data-path
# with several prefixes or weights) adds `dataset_id`, a scalar naming the sample's source, which no
# per-token slice can take; Megatron reads its batch by name and never meets it.
PER_TOKEN = ("tokens", "labels", "loss_mask", "position_ids")


class PerToken(torch.utils.data.Dataset):
    """A dataset's samples reduced to their PER_TOKEN tensors."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return {key: value for key, value in self.dataset[i].items() if key in PER_TOKEN}


def build_loader(dataset, consumed_samples: int, args, pgs, eod: Optional[int] = None) -> Optional[Iterator]:
    """This data-parallel rank's micro-batches from `consumed_samples` on; `eod` (the tokenizer's)
    finds the packed documents under --reset-attention-mask."""
    if dataset is None or len(dataset) == 0:
        return None
    dataset, collate = PerToken(dataset), None
    if pgs.size("cp") > 1 or args.reset_attention_mask:  # this rank's tokens, in its attention mode's order
        dataset = RankTokens(dataset, token_placement(args, pgs), eod if args.reset_attention_mask else None,
                             segment_partitioner(args))
        collate = dataset.collate
    dp_rank, dp_size = pgs.index("dp"), pgs.size("dp")
    sampler = PretrainingSampler(len(dataset), consumed_samples, args.micro_batch_size, dp_rank, dp_size)
    # The loader draws its workers' base seed when an iterator is made; from its own generator,
    # so the training streams (dropout) are the same whether or not the run was resumed.
    generator = torch.Generator().manual_seed(args.seed)
    signum = signal.Signals[args.exit_signal] if args.exit_signal_handler else None
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=args.num_workers, generator=generator, collate_fn=collate,
        pin_memory=args.device_type == "cuda", persistent_workers=args.num_workers > 0,
        worker_init_fn=None if signum is None else partial(_leave_signal_to_the_rank, signum),
    )
    return iter(loader)


def _leave_signal_to_the_rank(signum: int, worker_id: int) -> None:
    """In a loader worker, under --exit-signal-handler: the exit signal is ignored. Slurm signals
    every process of a job step and torchrun a rank's whole process group; torch's own handler in
    the worker would die of it, and the rank with it, mid-iteration or mid-save ('DataLoader worker
    killed'), where the rank was to finish its iteration, save and exit. The worker ends when its
    loader is shut down, or when it finds its rank gone."""
    signal.signal(signum, signal.SIG_IGN)


def token_placement(args, pgs) -> TokenPlacement:
    return TokenPlacement(args.segment_lengths, pgs.size("hp"), pgs.size("ring"), pgs.index("hp"), pgs.index("ring"))


def segment_partitioner(args) -> Optional[Callable[[torch.Tensor], List[int]]]:
    """Packed documents cut into uniform_comp segments: each micro-batch's own, by its documents'
    FLOPs (partition.document_partition), none longer than the static partition's longest."""
    if not (args.reset_attention_mask and args.pipe_sp_splits > 1 and args.pipe_sp_strategy == "uniform_comp"):
        return None
    return partial(document_partition, k=args.pipe_sp_splits, num_params=num_parameters(args),
                   num_layers=args.num_layers, hidden=args.hidden_size, granularity=args.segment_granularity,
                   max_length=max(args.segment_lengths))


def random_batches(args, pgs, seed: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless micro-batches of random tokens with the run's shapes, each rank holding its share
    of every segment in its attention mode's order: for profiling and tests, from its own
    generator so the run's data position and RNG streams stay untouched."""
    g = torch.Generator().manual_seed(seed)
    idx = None
    if pgs.size("cp") > 1:
        idx = token_placement(args, pgs).indices()
    while True:
        # [b, s + 1]: inputs and next-token labels from one draw
        tokens = torch.randint(0, args.padded_vocab_size - 1, (args.micro_batch_size, args.seq_length + 1), generator=g)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                 "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
                 "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1)}
        yield batch if idx is None else {k: v[:, idx] for k, v in batch.items()}


def to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
