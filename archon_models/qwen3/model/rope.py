"""Qwen3 uses Qwen2's RoPE unchanged (HF half-rotation, default frequencies)."""

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
