"""LayerNorm / RMSNorm for our layer spec.

megatron-core's torch fallback norm refuses sequence parallelism; the only thing it lacks is the
`sequence_parallel` tag on its parameters, which tells the gradient reduction that their gradients
are partial sums over the tp ranks (sequence shards there). This norm sets the tag.

--apply-layernorm-1p (megatron-core's layernorm_zero_centered_gamma): the weight holds gamma - 1,
initialised to 0 (init.py), and the norm scales by 1 + weight; the function is the same, the
stored number is small and centred on zero.
"""
import torch
import torch.nn.functional as F


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


_CLASSES = {("LayerNorm", False): torch.nn.LayerNorm, ("RMSNorm", False): torch.nn.RMSNorm,
            ("LayerNorm", True): ZeroCenteredLayerNorm, ("RMSNorm", True): ZeroCenteredRMSNorm}


class Norm:
    """Built by megatron-core's build_module as Norm(config=..., hidden_size=..., eps=...)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        zero_centered = config.layernorm_zero_centered_gamma
        kind = _CLASSES.get((config.normalization, zero_centered))
        if kind is None:
            raise ValueError(f"unknown normalization {config.normalization}")
        norm = kind(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class QKNorm:
    """--qk-layernorm: one norm over the head dimension, shared by every head. With tp each rank
    holds some of the heads, so its weight gradient is a partial sum over tp, as a
    sequence-parallel norm's is: the same tag has it summed over tp. `norm` builds the module: our
    Norm, or Transformer Engine's TENorm, which tags its parameters only when sequence parallel."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, norm=Norm):
        module = norm(config=config, hidden_size=hidden_size, eps=eps)
        for param in module.parameters():
            param.sequence_parallel = True
        return module
