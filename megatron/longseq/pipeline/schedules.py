"""Forward-backward schedules with megatron-core's signature, device-agnostic.

megatron-core's `forward_backward_no_pipelining` counts tokens on CUDA; this one runs on any device
and keeps its contract: forward_step_func(data_iterator, model) -> (output, loss_func);
loss_func(output) -> (loss_sum, num_tokens, report) or (loss, report); a micro-batch loss is
divided by its token count and the number of micro-batches, unless calculate_per_token_loss;
gradient sync is disabled by config.no_sync_func for all but the last micro-batch and finished by
config.finalize_model_grads_func(model, total_num_tokens).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Union

import torch

from megatron.core.utils import get_model_config


def _scaled_loss(outputs, config, num_microbatches):
    """(loss to backprop, num_tokens, report) from what loss_func returned. Per-token losses stay
    sums (finalize divides the gradients by the global token count); otherwise every micro-batch
    contributes its token mean / num_microbatches."""
    if len(outputs) == 3:
        loss, num_tokens, report = outputs
        if not config.calculate_per_token_loss:
            loss = loss / num_tokens / num_microbatches
    else:
        (loss, report), num_tokens = outputs, torch.zeros((), dtype=torch.int64)
        loss = loss / num_microbatches
    return loss, num_tokens, report


def forward_step(forward_step_func, data_iterator, model, num_microbatches, config, store):
    output, loss_func = forward_step_func(data_iterator, model)
    loss, num_tokens, report = _scaled_loss(loss_func(output), config, num_microbatches)
    store.append(report)
    return loss, num_tokens


def forward_backward_no_pipelining(
    *, forward_step_func, data_iterator: Union[Iterator, List[Iterator]], model, num_microbatches: int,
    seq_length: int = None, micro_batch_size: int = None, decoder_seq_length: int = None,
    forward_only: bool = False, collect_non_loss_data: bool = False, first_val_step: bool = None,
    adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
):
    """Run `num_microbatches` forward (and backward) passes on one pipeline stage. Returns the
    list of loss reports, one per micro-batch."""
    if isinstance(model, list):
        assert len(model) == 1, "no-pipelining schedule takes one model chunk"
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if collect_non_loss_data:
        raise NotImplementedError("collect_non_loss_data is not supported")
    config = get_model_config(model)
    no_sync = config.no_sync_func or contextlib.nullcontext
    store, total_tokens = [], 0
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        with contextlib.nullcontext() if (last or forward_only) else no_sync():
            grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
            with grad_ctx:
                loss, num_tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, store)
            total_tokens = total_tokens + num_tokens.detach()  # stays on device: no sync per step
            if not forward_only:
                loss.backward()
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None)
    return store
