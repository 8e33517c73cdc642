"""Full activation recompute (--recompute-granularity full) for megatron-core transformer layers.

megatron-core's own recompute saves CUDA RNG states and cannot run on CPU; here the layers'
forwards are wrapped with our device-agnostic `checkpoint`, keeping Megatron's two methods:
- uniform: the stage's layers are cut into chunks of N; only each chunk's input is kept;
- block:   the first N layers of the stage are recomputed one by one, the rest are not.
The wrapping replaces `forward` on the layer instances, so parameters and state-dict keys are
untouched.
"""
from __future__ import annotations

from typing import Callable, List

from megatron.longseq.random import checkpoint


def _chunk_forward(forwards: List[Callable]):
    def forward(hidden_states, context=None, **kwargs):
        def run(h, ctx):
            for fwd in forwards:
                h, ctx = fwd(hidden_states=h, context=ctx, **kwargs)
            return h, ctx

        return checkpoint(run, hidden_states, context)

    return forward


def _pass_through(hidden_states, context=None, **kwargs):
    # A layer whose work the first layer of its chunk already did.
    return hidden_states, context


def apply_full_recompute(layers, method: str, num_layers: int) -> None:
    """Wrap `layers` (a TransformerBlock's ModuleList) for recompute in place."""
    originals = [layer.forward for layer in layers]
    if method == "uniform":
        for start in range(0, len(layers), num_layers):
            chunk = list(range(start, min(start + num_layers, len(layers))))
            layers[start].forward = _chunk_forward([originals[i] for i in chunk])
            for i in chunk[1:]:
                layers[i].forward = _pass_through
    elif method == "block":
        for i in range(min(num_layers, len(layers))):
            layers[i].forward = _chunk_forward([originals[i]])
    else:
        raise ValueError(f"unknown recompute method {method}")
