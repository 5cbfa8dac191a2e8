"""Rotary position embedding with HuggingFace's half-rotation layout.

The head dimension is split into two halves ``(x1, x2)`` that rotate as pairs
``(x1[i], x2[i])`` by the angle ``position * base ** (-2i / head_dim)``, exactly as
transformers' ``rotate_half`` / ``apply_rotary_pos_emb`` do. (The interleaved
complex-number layout of the original LLaMA code pairs ``(x[2i], x[2i+1])``
instead and would silently mismatch HF checkpoints.)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "apply_rotary_emb",
    "precompute_rope_cache",
    "repeat_kv",
    "reshape_for_broadcast",
    "rotate_half",
]


def _local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (rope is applied per rank under TP), else ``x``."""
    return x.to_local() if isinstance(x, DTensor) else x


def precompute_rope_cache(dim: int, max_seq_len: int, base: float = 10_000.0) -> torch.Tensor:
    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest.

    Computed in fp32 with the same operation order as transformers' default RoPE,
    so the cached values are bit-identical to what HF computes per forward.
    """
    if dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    t = torch.arange(max_seq_len, dtype=torch.int64).float()
    angles = torch.outer(t, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reshape_for_broadcast(
    rope_cache: torch.Tensor, x: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of ``rope_cache`` for each token of ``x`` (``[bs, seq, heads, head_dim]``).

    Returns ``[1 or bs, seq, 1, 2 * head_dim]``. ``positions`` (``[1, seq]`` or
    ``[bs, seq]``) selects rows, which is how packed documents restart at 0; without
    it, rows ``0 .. seq-1`` are used.
    """
    _, seqlen, _, head_dim = x.shape
    if rope_cache.shape[-1] != 2 * head_dim:
        raise ValueError(f"rope_cache has {rope_cache.shape[-1]} columns, expected 2 * head_dim = {2 * head_dim}.")
    if positions is None:
        return rope_cache[:seqlen].view(1, seqlen, 1, 2 * head_dim)
    if positions.shape[-1] != seqlen:
        raise ValueError(f"positions cover {positions.shape[-1]} tokens, the input has {seqlen}.")
    rows = rope_cache[positions.reshape(-1, seqlen)]
    return rows.unsqueeze(2)


def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    rope_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries ``[bs, seq, n_heads, hd]`` and keys ``[bs, seq, n_kv_heads, hd]``.

    ``cos``/``sin`` are cast to the activation dtype before multiplying, as HF does,
    so bf16 runs round the same way.
    """
    rope_cache = _local(rope_cache)
    if positions is not None:
        positions = _local(positions)
    head_dim = xq.shape[-1]
    rows = reshape_for_broadcast(rope_cache, xq, positions).to(device=xq.device, dtype=xq.dtype)
    cos, sin = rows[..., :head_dim], rows[..., head_dim:]
    xq_out = xq * cos + rotate_half(xq) * sin
    xk_out = xk * cos + rotate_half(xk) * sin
    return xq_out, xk_out


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[bs, seq, n_kv_heads, hd]`` → ``[bs, seq, n_kv_heads * n_rep, hd]``, each head repeated in place."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return (
        x.unsqueeze(3).expand(bs, seqlen, n_kv_heads, n_rep, head_dim).reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )
