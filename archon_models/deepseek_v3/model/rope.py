"""DeepSeek-V3 rotary embedding: default or YaRN frequencies, half-rotation or interleaved pairs.

Only the ``qk_rope_head_dim`` slice of each query head, and the one RoPE key shared by
all heads, are rotated. The cache layout is Qwen2's (``[max_seq_len, 2 * dim]``, ``cos``
then ``sin``, each frequency in both halves), so :func:`apply_rotary_emb` (HF's
``rotate_half`` layout) is Qwen2's own. DeepSeek's checkpoints pair adjacent features
``(x[2i], x[2i+1])`` instead (``rope_interleave``); :func:`apply_interleaved_rotary_emb`
rotates those pairs and writes the rotated even features, then the rotated odd ones,
exactly as transformers' ``apply_rotary_pos_emb_interleave`` does. Queries and keys are
permuted alike, so attention scores are unchanged by that output order.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from archon_models.deepseek_v3.model.args import YarnArgs
from archon_models.qwen2.model.rope import (
    apply_rotary_emb,
    repeat_kv,
    reshape_for_broadcast,
    rotate_half,
)

__all__ = [
    "apply_interleaved_rotary_emb",
    "apply_rotary_emb",
    "precompute_rope_cache",
    "repeat_kv",
    "reshape_for_broadcast",
    "rotate_half",
    "yarn_mscale",
]


def _local_shard(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (RoPE is applied per rank under TP), else ``x``."""
    return x.to_local() if isinstance(x, DTensor) else x


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_frequencies(dim: int, base: float, yarn: YarnArgs) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies and the factor on ``cos``/``sin``, as transformers computes them.

    Long wavelengths are interpolated (divided by ``factor``), short ones extrapolated
    (kept), with a linear ramp between the correction dimensions of ``beta_fast`` and
    ``beta_slow`` rotations over the original context.
    """
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def precompute_rope_cache(
    dim: int, max_seq_len: int, base: float = 10_000.0, yarn: YarnArgs | None = None
) -> torch.Tensor:
    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest.

    ``yarn=None`` gives the default frequencies (bit-identical to Qwen2's cache);
    with YaRN both ``cos`` and ``sin`` carry its attention factor, as HF's do.
    """
    if dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")
    if yarn is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_factor = 1.0
    else:
        inv_freq, attention_factor = _yarn_frequencies(dim, base, yarn)
    t = torch.arange(max_seq_len, dtype=torch.int64).float()
    angles = torch.outer(t, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos() * attention_factor, angles.sin() * attention_factor], dim=-1)


def apply_interleaved_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    rope_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate adjacent pairs of queries ``[bs, seq, n_heads, d]`` and keys ``[bs, seq, h, d]``.

    Output features: the rotated even features ``x0' x2' ...``, then the rotated odd ones
    ``x1' x3' ...``. ``cos``/``sin`` are cast to the activation dtype before multiplying.
    """
    rope_cache = _local_shard(rope_cache)
    if positions is not None:
        positions = _local_shard(positions)
    dim = xq.shape[-1]
    rows = reshape_for_broadcast(rope_cache, xq, positions).to(device=xq.device, dtype=xq.dtype)
    # Each frequency fills both halves of the cache; the first half has one per pair.
    cos, sin = rows[..., : dim // 2], rows[..., dim : dim + dim // 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    return rotate(xq), rotate(xk)
