"""RoPE pieces a family's ``rope.py`` is assembled from (by ``set_rope``).

Each frequency function follows transformers' ``ROPE_INIT_FUNCTIONS[rope_type]``
operation by operation and returns ``(inv_freq, attention_factor)``; ``set_rope`` copies
the family's one as ``_frequencies``. The cache and partial-rotary functions are copied
as they are, so every combination (scaled frequencies, partial rotary, both) is the
same tested code.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from archon_models.qwen2.model.rope import apply_rotary_emb as _apply_full_rotary_emb
from archon_models.qwen2.model.rope import reshape_for_broadcast


def linear_frequencies(dim: int, base: float, scaling: dict[str, float]) -> tuple[torch.Tensor, float]:
    """The linear-scaled inverse frequencies and the factor on cos/sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    # Linear position interpolation: every frequency divided by the factor.
    return inv_freq / scaling["factor"], 1.0


def llama3_frequencies(dim: int, base: float, scaling: dict[str, float]) -> tuple[torch.Tensor, float]:
    """The llama3-scaled inverse frequencies and the factor on cos/sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    # Llama 3: long wavelengths divided by the factor, short ones kept, the band between
    # interpolated smoothly (wavelengths measured against the original context length).
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def yarn_frequencies(dim: int, base: float, scaling: dict[str, float]) -> tuple[torch.Tensor, float]:
    """The yarn-scaled inverse frequencies and the factor on cos/sin."""
    # YaRN: interpolated frequencies for long wavelengths, extrapolated ones for short
    # wavelengths, a linear ramp between the beta_fast/beta_slow correction dimensions, and
    # cos/sin scaled by an attention factor.
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


# The name the assembled rope.py gives the family's frequency function.
_frequencies = linear_frequencies


def precompute_rope_cache(
    dim: int, max_seq_len: int, base: float = 10_000.0, scaling: dict[str, float] | None = None
) -> torch.Tensor:
    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest.

    ``scaling`` holds the checkpoint's ``rope_parameters`` (``factor``, ...); ``None``
    gives the unscaled default RoPE.
    """
    if dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")
    if scaling is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_factor = 1.0
    else:
        inv_freq, attention_factor = _frequencies(dim, base, scaling)
    t = torch.arange(max_seq_len, dtype=torch.int64).float()
    angles = torch.outer(t, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos() * attention_factor, angles.sin() * attention_factor], dim=-1)


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


def _local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (rope is applied per rank under TP), else ``x``."""
    return x.to_local() if isinstance(x, DTensor) else x


def interleaved_precompute_rope_cache(dim: int, max_seq_len: int, base: float = 10_000.0) -> torch.Tensor:
    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest,
    each frequency repeated for the two features of its pair (``f0, f0, f1, f1, ...``).
    """
    if dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    t = torch.arange(max_seq_len, dtype=torch.int64).float()
    angles = torch.outer(t, inv_freq)
    angles = torch.repeat_interleave(angles, 2, dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def interleaved_scaled_precompute_rope_cache(
    dim: int, max_seq_len: int, base: float = 10_000.0, scaling: dict[str, float] | None = None
) -> torch.Tensor:
    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest,
    each frequency repeated for the two features of its pair (``f0, f0, f1, f1, ...``).

    ``scaling`` holds the checkpoint's ``rope_parameters``; ``None`` gives the default RoPE.
    """
    if dim % 2 != 0:
        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")
    if scaling is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_factor = 1.0
    else:
        inv_freq, attention_factor = _frequencies(dim, base, scaling)
    t = torch.arange(max_seq_len, dtype=torch.int64).float()
    angles = torch.outer(t, inv_freq)
    angles = torch.repeat_interleave(angles, 2, dim=-1)
    return torch.cat([angles.cos() * attention_factor, angles.sin() * attention_factor], dim=-1)


def interleaved_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``: each adjacent pair rotated."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def interleaved_apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    rope_cache: torch.Tensor,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries ``[bs, seq, n_heads, hd]`` and keys ``[bs, seq, n_kv_heads, hd]``.

    ``cos``/``sin`` are cast to the activation dtype before multiplying, as Qwen2's rope does.
    """
    rope_cache = _local(rope_cache)
    if positions is not None:
        positions = _local(positions)
    head_dim = xq.shape[-1]
    rows = reshape_for_broadcast(rope_cache, xq, positions).to(device=xq.device, dtype=xq.dtype)
    cos, sin = rows[..., :head_dim], rows[..., head_dim:]
    xq_out = xq * cos + interleaved_rotate_half(xq) * sin
    xk_out = xk * cos + interleaved_rotate_half(xk) * sin
    return xq_out, xk_out
