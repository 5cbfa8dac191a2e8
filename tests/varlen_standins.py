"""CPU stand-ins for ``torch.nn.attention.varlen.varlen_attn`` as each torch version ships it.

The flash varlen kernel runs only on CUDA, and its keywords changed from version to
version. Each stand-in here carries one version's exact signature (read from that
version's ``torch/nn/attention/varlen.py``) and the semantics its docstring documents,
computed on the CPU with plain tensor ops (differentiable), so the CUDA call sites of
``archon_models`` and of the generated packages can be driven on a machine without a
GPU:

- 2.10: ``(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
  return_aux=None)``; the scale is always ``1/sqrt(D)``; key/value must have the query's
  head count.
- 2.11: keyword-only ``return_aux``, ``scale``, ``window_size=(-1, -1)`` (``(-1, 0)`` is
  causal, ``(W, 0)`` a causal window of ``W`` tokens before the query); no ``is_causal``;
  key/value must have the query's head count.
- 2.13: 2.11's keywords plus ``enable_gqa`` (fewer key/value heads, allowed only when
  asked), ``seqused_k``, ``block_table``, ``num_splits``.

A stand-in refuses what its version refuses (an unknown keyword is a ``TypeError`` from
Python itself), and records each call in :data:`CALLS`, so a test can tell the kernel was
called rather than a fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch

CALLS: list[dict[str, Any]] = []


def _check_packed(query: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int) -> None:
    if cu_seq_q.dtype != torch.int32 or cu_seq_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must have dtype int32 (flash attention)")
    if not isinstance(max_q, int) or not isinstance(max_k, int):
        raise TypeError("max_q and max_k must be Python ints")
    if max(b - a for a, b in pairwise(cu_seq_q.tolist())) > max_q:
        raise RuntimeError("max_q is smaller than the longest query document")
    if max(b - a for a, b in pairwise(cu_seq_k.tolist())) > max_k:
        raise RuntimeError("max_k is smaller than the longest key document")
    if int(cu_seq_q[-1]) != query.shape[0]:
        raise RuntimeError("cu_seq_q must end at the number of query tokens (flash computes no token past it)")


def _flash_semantics(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    scale: float,
    window: tuple[int, int],
) -> torch.Tensor:
    """Flash attention over packed documents, ``[T, H, D]``, fp32 softmax: query ``i`` of a
    document with ``Lq`` queries and ``Lk`` keys sits at key position ``i + Lk - Lq``
    (bottom-right alignment) and sees keys within ``window = (left, right)`` of it, ``-1``
    meaning unbounded. Computed in fp32 (float64 for float64 inputs), cast back."""
    if key.shape[1] != query.shape[1]:
        raise RuntimeError(f"query has {query.shape[1]} heads but key/value {key.shape[1]}")
    left, right = window
    dtype = torch.promote_types(query.dtype, torch.float32)
    outputs = []
    for (qs, qe), (ks, ke) in zip(pairwise(cu_seq_q.tolist()), pairwise(cu_seq_k.tolist()), strict=True):
        lq, lk = qe - qs, ke - ks
        row = torch.arange(lq)[:, None] + (lk - lq)
        col = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            allowed &= col >= row - left
        if right >= 0:
            allowed &= col <= row + right
        scores = torch.einsum("qhd,khd->hqk", query[qs:qe].to(dtype), key[ks:ke].to(dtype)) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, value[ks:ke].to(dtype)).to(query.dtype))
    return torch.cat(outputs, dim=0)


def varlen_attn_2_10(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    return_aux: Any = None,
) -> torch.Tensor:
    CALLS.append({"version": "2.10", "is_causal": is_causal})
    _check_packed(query, cu_seq_q, cu_seq_k, max_q, max_k)
    scale = 1.0 / math.sqrt(query.shape[-1])
    return _flash_semantics(query, key, value, cu_seq_q, cu_seq_k, scale, (-1, 0) if is_causal else (-1, -1))


def varlen_attn_2_11(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    CALLS.append({"version": "2.11", "scale": scale, "window_size": window_size})
    _check_packed(query, cu_seq_q, cu_seq_k, max_q, max_k)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _flash_semantics(query, key, value, cu_seq_q, cu_seq_k, scale, tuple(window_size))  # type: ignore[arg-type]


def varlen_attn_2_13(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    CALLS.append({"version": "2.13", "scale": scale, "window_size": window_size, "enable_gqa": enable_gqa})
    assert cu_seq_k is not None, "this stand-in covers the packed (non-paged) call only"
    _check_packed(query, cu_seq_q, cu_seq_k, max_q, max_k)
    if key.shape[1] != query.shape[1]:
        if not enable_gqa:
            raise RuntimeError("key/value have fewer heads than query: pass enable_gqa=True")
        n_rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return _flash_semantics(query, key, value, cu_seq_q, cu_seq_k, scale, tuple(window_size))  # type: ignore[arg-type]


def varlen_attn_unknown(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    mask: str = "full",
) -> torch.Tensor:
    """A signature no torch release has: no ``is_causal``, no ``window_size``."""
    CALLS.append({"version": "unknown"})
    raise AssertionError("a kernel with an unknown signature must not be called")


VERSIONS: dict[str, Callable[..., torch.Tensor]] = {
    "2.10": varlen_attn_2_10,
    "2.11": varlen_attn_2_11,
    "2.13": varlen_attn_2_13,
}
