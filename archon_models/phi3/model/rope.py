"""Phi3 RoPE: HF's default rotary embedding, the same formula as Qwen2's, re-exported."""

from archon_models.qwen2.model.rope import (
    apply_rotary_emb,
    precompute_rope_cache,
    repeat_kv,
    reshape_for_broadcast,
    rotate_half,
)

__all__ = [
    "apply_rotary_emb",
    "precompute_rope_cache",
    "repeat_kv",
    "reshape_for_broadcast",
    "rotate_half",
]
