"""Qwen3.5's RoPE: HF's half-rotation over the first ``rotary_dim`` features of each head.

Qwen3.5's text config carries a multimodal RoPE section (``mrope_section``): HF rotates
the temporal, height and width frequency bands by three position streams. A text-only
sequence gives all three streams the same positions, so every band turns by the same
angle and the rotation is the ordinary one, which is what this module computes. The
features past ``rotary_dim`` pass through unrotated.
"""

from __future__ import annotations

import torch

from archon_models.qwen2.model import rope as full_rope
from archon_models.qwen2.model.rope import repeat_kv, reshape_for_broadcast, rotate_half

__all__ = [
    "apply_rotary_emb",
    "precompute_rope_cache",
    "repeat_kv",
    "reshape_for_broadcast",
    "rotate_half",
]


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, partial_rotary_factor: float = 1.0, base: float = 10_000.0
) -> torch.Tensor:
    """``[max_seq_len, 2 * rotary_dim]`` (cos, then sin) for ``rotary_dim = int(head_dim * factor)``."""
    return full_rope.precompute_rope_cache(int(head_dim * partial_rotary_factor), max_seq_len, base)


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    rope_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` features of queries and keys ``[bs, seq, heads, head_dim]``."""
    rotary_dim = rope_cache.shape[-1] // 2
    q_rot, k_rot = full_rope.apply_rotary_emb(xq[..., :rotary_dim], xk[..., :rotary_dim], rope_cache, positions)
    return (
        torch.cat([q_rot, xq[..., rotary_dim:]], dim=-1),
        torch.cat([k_rot, xk[..., rotary_dim:]], dim=-1),
    )
