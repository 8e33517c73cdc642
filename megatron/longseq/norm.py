"""LayerNorm / RMSNorm for our layer spec.

megatron-core's torch fallback norm refuses sequence parallelism; the only thing it lacks is the
`sequence_parallel` tag on its parameters, which tells the gradient reduction that their gradients
are partial sums over the tp ranks' sequence shards. This norm sets the tag.
"""
import torch


class Norm:
    """Built by megatron-core's build_module as Norm(config=..., hidden_size=..., eps=...)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"unknown normalization {config.normalization}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
