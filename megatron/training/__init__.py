"""Megatron-style training driver on megatron-core."""
import megatron.longseq  # noqa: F401  (quiets megatron-core's import-time fallback warnings first)
