"""A tiny GPT built through the real argument path, for model-level tests."""
from __future__ import annotations

import torch

from megatron.longseq.attention.core import AttentionInputs
from megatron.training.arguments import parse_args
from megatron.training.model import build_gpt_model
from megatron.training.validate import validate_args

# gloo: these are CPU tests also on a GPU machine, where validation would pick nccl and so build the
# model on the GPU with megatron-core's fusions on, beside batches and MEMO runtimes made on the CPU
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 10 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 200 "
        "--hidden-dropout 0 --attention-dropout 0 --distributed-backend gloo")


def sequence_parallel_on_host() -> None:
    """--sequence-parallel on CPU ranks, for exactness tests: megatron-core 0.16 places the
    sequence-parallel all-gather and reduce-scatter buffers at torch.cuda.current_device(); pointed
    at host memory, the same collectives run over gloo (which has both). Validation, which refuses
    the flag on CPU (it saves nothing there), lets it through. For this process only: call it in
    a rank process."""
    from megatron.training import validate

    torch.cuda.current_device = lambda: "cpu"
    validate.sequence_parallel_device = lambda args: None


def tiny_args(extra: str = "", world_size: int = 1):
    return validate_args(parse_args((TINY + " " + extra).split()), world_size)  # sizes the vocabulary too


def tiny_gpt(args, pgs, seed: int = 1234):
    from megatron.longseq.random import seed_everything

    seed_everything(seed, pgs.index("tp"), torch.device("cpu"))
    return build_gpt_model(args, pgs, torch.device("cpu"))


def tiny_batch(args, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
    positions = torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
    return tokens[:, :-1], tokens[:, 1:], positions


def lm_loss(model, args, seed: int = 0):
    """Mean per-token loss of one tiny batch (packed documents with --reset-attention-mask)."""
    tokens, labels, positions = tiny_batch(args, seed)
    starts = tiny_documents(args, seed) if args.reset_attention_mask else None
    losses = model(tokens, positions, None, labels=labels,
                   packed_seq_params=AttentionInputs(position_ids=positions, document_starts=starts))
    return losses.float().mean()


def tiny_documents(args, seed: int = 0):
    """[b, s] document starts: documents of random lengths (about 1 in 6 tokens starts one)."""
    g = torch.Generator().manual_seed(seed + 1)
    starts = torch.rand(args.micro_batch_size, args.seq_length, generator=g) < 1 / 6
    starts[:, 0] = True
    return starts
