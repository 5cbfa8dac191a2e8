"""Stablelm RoPE: HF's default rotary embedding on the first ``rotary_dim`` features of
each head only (partial rotary); the remaining features pass through unrotated.
"""

from __future__ import annotations

import torch

from archon_models.qwen2.model.rope import apply_rotary_emb as _apply_full_rotary_emb
from archon_models.qwen2.model.rope import (
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


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    rope_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rope_cache.shape[-1] // 2`` features of every head of queries
    ``[bs, seq, n_heads, hd]`` and keys ``[bs, seq, n_kv_heads, hd]``; keep the rest.
    """
    rotary_dim = rope_cache.shape[-1] // 2
    q_rot, k_rot = _apply_full_rotary_emb(xq[..., :rotary_dim], xk[..., :rotary_dim], rope_cache, positions)
    return (
        torch.cat([q_rot, xq[..., rotary_dim:]], dim=-1),
        torch.cat([k_rot, xk[..., rotary_dim:]], dim=-1),
    )
