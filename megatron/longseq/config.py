"""megatron-core's TransformerConfig plus the fields our modules read."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.longseq.attention.rope import RopeScaling


@dataclass
class LongSeqConfig(TransformerConfig):
    # Rotary embedding, applied by our core attention from position ids (GPTModel gets 'none').
    use_rope: bool = False
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # context extension (rope.py)
    # --recompute-granularity selective: recompute core attention in backward.
    recompute_core_attention: bool = False
    # Selective Checkpoint++ (LoongTrain 5.2): under full recompute keep attention (out, lse).
    selective_checkpoint_pp: bool = False
    # --cross-entropy-chunk-tokens: the output layer and the loss this many tokens at a time (0: whole).
    cross_entropy_chunk_tokens: int = 0
