"""Pretrain a GPT model with Megatron's command line (megatron-core GPTModel, long-sequence extensions).

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --num-layers 2 ...

Same shape as Megatron-LM's script: model provider, batch, loss, forward step, datasets provider.
"""
from __future__ import annotations

import os
from functools import partial

if __name__ == "__main__" and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
    print("> loading torch and megatron-core ...", flush=True)  # seconds of silence otherwise

import torch  # noqa: E402

import megatron.longseq  # noqa: E402,F401  (first: it quiets megatron-core's import-time fallback warnings)
from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.longseq.attention.core import AttentionInputs  # noqa: E402
from megatron.longseq.attention.placement import DOCUMENT_STARTS, SEGMENT_LENGTHS  # noqa: E402
from megatron.training.data import build_datasets, to_device  # noqa: E402
from megatron.training.model import build_model_chunks  # noqa: E402
from megatron.training.bad_input import run_main  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402


def model_provider(args, pgs, device):
    """This rank's model chunks (one per virtual pipeline stage)."""
    return build_model_chunks(args, pgs, device)


def get_batch(data_iterator, device):
    """tokens, labels, loss_mask, position_ids, and the attention's metadata: the Seq1F1B segment
    slot and the packed documents' starts (None without segments or documents)."""
    batch = next(data_iterator)
    segment = batch.pop("segment", None)
    starts = batch.pop(DOCUMENT_STARTS, None)  # read on the host: which tokens meet which
    lengths = batch.pop(SEGMENT_LENGTHS, None)  # the segments these documents chose (None: the run's)
    batch = to_device(batch, device)
    inputs = AttentionInputs(position_ids=batch["position_ids"], segment=segment, document_starts=starts,
                             segment_lengths=None if lengths is None else lengths.tolist())
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"], inputs


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses, the token count, and the same pair for the report (the
    trainer reduces reports once per iteration, over micro-batches and data-parallel ranks).

    Context parallelism: each rank holds part of every sequence. The token count is the whole
    sequence's (summed over the cp group) and the loss is scaled by cp, because gradients are
    averaged over dp x cp: the average of cp x local sums / all tokens is the sequence's mean."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])
    num_tokens = mask.sum().to(torch.int64)
    cp_group = mpu.get_context_parallel_group()
    cp = torch.distributed.get_world_size(cp_group)
    if cp > 1:
        torch.distributed.all_reduce(num_tokens, group=cp_group)
    return loss_sum * cp, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    device = next(model.parameters()).device
    tokens, labels, loss_mask, position_ids, inputs = get_batch(data_iterator, device)
    output = model(tokens, position_ids, None, labels=labels, packed_seq_params=inputs)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(args, tokenizer, num_samples):
    return build_datasets(args, tokenizer, num_samples)


def main(argv=None):
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv)


if __name__ == "__main__":
    run_main(main)
