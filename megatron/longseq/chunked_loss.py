"""The output layer and the language-model loss together, a chunk of tokens at a time.

At long sequences the logits are the largest tensors of a training step: tokens x vocabulary in
the model's dtype, again in fp32 for the loss, and their gradient. At 128K tokens and a 32000
vocabulary that is 8 GiB in bf16 plus 16 GiB in fp32 on one GPU, more than a 7B-shaped layer's
activations; on an H100 the fp32 copy is what stopped no recomputation at 64K and full
recomputation at 128K (docs/benchmarks.md). Here only `chunk` tokens' logits exist at a time:
the forward keeps each token's log-sum-exp (4 bytes) and the backward recomputes a chunk's logits
from the hidden states the output layer saves anyway (under sequence parallelism this rank's share,
gathered again as megatron-core's output layer does), turns them into the softmax gradient and
folds it into the hidden-state and weight gradients. The price is the output layer's forward
GEMM once more per token: 2*h*V FLOPs beside the 6*h*V the logits cost in training.

Vocabulary-parallel as megatron-core's cross entropy: each tensor-parallel rank holds V/tp rows of
the output weight; the max and the two sums are reduced over the tp group (two all-reduces per
chunk). The arithmetic is megatron-core's: logits in the model's dtype, the loss in fp32.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)


def _gathered() -> None:
    """A weight no overlapped all-gather fills (no distributed optimizer, or not overlapped)."""


def _chunks(n: int, chunk: int) -> Iterator[slice]:
    return (slice(i, min(i + chunk, n)) for i in range(0, n, chunk))


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _local_labels(labels: torch.Tensor, weight: torch.Tensor, group):
    """Each label's index in this rank's slice of the vocabulary, clamped into it, and whether it
    falls there (megatron-core's vocab-parallel layout: rank r holds rows r*V/tp..)."""
    local = labels - dist.get_rank(group) * weight.shape[0]
    inside = (local >= 0) & (local < weight.shape[0])
    return local.clamp(0, weight.shape[0] - 1), inside


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[c, h] x [v, h] -> [c, v] fp32: the GEMM in the model's dtype, as the output layer runs it."""
    return torch.matmul(hidden, weight.t()).float()


def _lse_and_loss(logits, local, inside, group):
    """Per token: the log-sum-exp over the whole vocabulary and the loss lse - logit[label].
    `logits` [c, v/tp] fp32 is overwritten."""
    top = logits.max(dim=-1).values  # [c]
    _all_reduce(top, dist.ReduceOp.MAX, group)
    logits.sub_(top.unsqueeze(-1))
    target = torch.where(inside, logits.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)  # [c]
    sums = torch.stack([logits.exp_().sum(dim=-1), target])  # [2, c]: sum of exp, the label's logit
    _all_reduce(sums, dist.ReduceOp.SUM, group)
    log_sum = sums[0].log()
    return top + log_sum, log_sum - sums[1]


def _logit_grad(logits, lse, local, inside, grad_loss) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot(label)) * grad_loss, [c, v/tp] fp32, in `logits`.
    A scatter, not a boolean index: that would read the mask's count back to the host (a device
    synchronization per chunk on CUDA)."""
    probs = logits.sub_(lse.unsqueeze(-1)).exp_()
    probs.scatter_add_(-1, local.unsqueeze(-1), -inside.to(probs.dtype).unsqueeze(-1))
    return probs.mul_(grad_loss.unsqueeze(-1))


def _whole_rows(hidden: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Every rank's rows, in rank order, where each holds a share: [n/tp, h] -> [n, h]."""
    return gather_from_sequence_parallel_region(hidden, group=group) if sequence_parallel else hidden


class LinearCrossEntropy(torch.autograd.Function):
    """loss[n] = cross entropy of (hidden[n] @ weight^T) against labels[n], `chunk` rows at a time.
    hidden [n, h] (model dtype), weight [V/tp, h], labels [n] (global vocabulary ids) -> [n] fp32.
    The hidden-state gradient is this rank's partial sum over its vocabulary slice: the caller
    reduces it over tp, as the output layer's input region does. With `sequence_parallel`, hidden
    is this rank's [n/tp, h] share: the whole [n, h] exists only while a pass needs it (gathered
    again in backward, as megatron-core's output layer does, not saved: tp times the bytes), and
    the gradient comes back reduce-scattered to the share."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, chunk: int, sequence_parallel: bool = False):
        whole = _whole_rows(hidden, group, sequence_parallel)
        local, inside = _local_labels(labels, weight, group)
        lse = torch.empty(len(labels), dtype=torch.float32, device=hidden.device)
        loss = torch.empty_like(lse)
        for rows in _chunks(len(labels), chunk):
            lse[rows], loss[rows] = _lse_and_loss(_logits(whole[rows], weight), local[rows], inside[rows], group)
        ctx.save_for_backward(hidden, weight, local, inside, lse)
        ctx.group, ctx.chunk, ctx.sequence_parallel = group, chunk, sequence_parallel
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        share, weight, local, inside, lse = ctx.saved_tensors
        hidden = _whole_rows(share, ctx.group, ctx.sequence_parallel)
        grad_hidden = torch.empty_like(hidden)
        # fp32: each chunk's bf16 product is rounded once, their sum is not rounded again per chunk
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for rows in _chunks(len(local), ctx.chunk):
            grad = _logit_grad(_logits(hidden[rows], weight), lse[rows], local[rows], inside[rows], grad_loss[rows])
            grad = grad.to(hidden.dtype)  # the logits' dtype, as the output layer's backward receives it
            grad_hidden[rows] = grad @ weight
            grad_weight += grad.t() @ hidden[rows]  # an in-place add casts the bf16 product on the fly
        if ctx.sequence_parallel:  # [n, h] partial sums over the vocabulary slices -> this rank's [n/tp, h]
            grad_hidden = reduce_scatter_to_sequence_parallel_region(grad_hidden, group=ctx.group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def chunked_lm_loss(model: GPTModel, hidden: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """What GPTModel's output layer and compute_language_model_loss return together: hidden
    [s(/tp with sequence parallel), b, h], labels [b, s] -> per-token loss [b, s] fp32."""
    tp, sequence_parallel = model.pg_collection.tp, model.output_layer.sequence_parallel
    if not sequence_parallel:  # (with it, LinearCrossEntropy gathers and reduce-scatters itself)
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp)  # backward: sum the ranks' partials
    weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
              else model.output_layer.weight)
    # --overlap-param-gather waits for a bucket in its module's forward, which this path bypasses:
    # the weight could still be in flight (on NCCL, a stale or half-written read)
    getattr(weight, "wait_gathered", _gathered)()
    b, s = labels.shape
    h = hidden.shape[-1]
    # [b, s] -> [s, b] -> [s*b]: the order of the rows of hidden's whole [s, b, h], which rank r's
    # share [s/tp, b, h] -> [s/tp*b, h] holds the r-th block of under sequence parallelism
    flat_labels = labels.transpose(0, 1).reshape(s * b)
    rows = hidden.reshape(-1, h)  # [s(/tp), b, h] -> [s(/tp)*b, h]
    loss = LinearCrossEntropy.apply(rows, weight, flat_labels, tp, chunk, sequence_parallel)  # [s*b]
    return loss.view(s, b).transpose(0, 1).contiguous()  # [s, b] -> [b, s]


class LongSeqGPTModel(GPTModel):
    """megatron-core's GPTModel (same parameters, state dict and outputs) whose training loss, with
    `config.cross_entropy_chunk_tokens` > 0, comes from LinearCrossEntropy: the logits of a
    training step never exist whole. Stages before the last, steps without labels (logits wanted),
    multi-token prediction and inference take megatron-core's path."""

    def _postprocess(self, hidden_states, labels, **kwargs):
        chunk = self.config.cross_entropy_chunk_tokens
        whole = labels is None or kwargs.get("mtp_in_postprocess") or kwargs.get("inference_context") is not None
        if not chunk or whole or not self.post_process:
            return super()._postprocess(hidden_states=hidden_states, labels=labels, **kwargs)
        return chunked_lm_loss(self, hidden_states, labels, chunk)
