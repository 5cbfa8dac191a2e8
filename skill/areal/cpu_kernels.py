"""CPU kernels for the two ops AReaL 1.0.4 runs only on CUDA, so its models run on CPU.

1. ``torch.histc`` of integer tensors: AReaL's MoE router and token reorderer count
   tokens per expert with ``histc`` on int64 expert indices, which CUDA implements and
   CPU does not. :func:`register_cpu_histc` adds a CPU ``histc`` with the same
   definition (equal-width bins over ``[min, max]``, the maximum in the last bin,
   values outside ignored, the input's dtype), for every dtype.
2. AReaL's varlen attention ops, below.

AReaL 1.0.4 implements ``varlen`` attention as two custom ops
(``areal::_varlen_attn`` and ``areal::_varlen_attn_backward``) that call
``aten._flash_attention_forward`` / ``_backward``: flash attention, which has no CPU
kernel. The ops, their autograd wiring and the wrapper a package calls
(``VarlenAttentionWrapper``: the 4D -> 3D layout, ``cu_seqlens``, ``scale``, the causal
flag) are AReaL's own and stay untouched; this module only registers a CPU kernel for
the two ops, computing exactly what flash computes: per document, causal softmax
attention, with the log-sum-exp of the scores. That proves a package's varlen path inside
AReaL on a machine without CUDA; the flash kernel itself is AReaL's and PyTorch's.
"""

from __future__ import annotations

import itertools
import logging
import math

import torch

logger = logging.getLogger(__name__)

_registered = False
_histc_library: torch.library.Library | None = None


def _histc_cpu(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    values = input.reshape(-1).double()
    low, high = float(min), float(max)
    if low == high and values.numel():
        low, high = float(values.min()), float(values.max())
    if low == high:
        low, high = low - 1, high + 1
    inside = values[(values >= low) & (values <= high)]
    index = ((inside - low) * bins / (high - low)).floor().long().clamp_(max=bins - 1)
    return torch.bincount(index, minlength=bins).to(input.dtype)


def register_cpu_histc() -> None:
    """Give ``aten::histc`` a CPU kernel that takes integer tensors too (this process only)."""
    global _histc_library
    if _histc_library is None:
        _histc_library = torch.library.Library("aten", "IMPL")
        _histc_library.impl("histc", _histc_cpu, "CPU")


def _documents(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds) if b > a]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One document, ``[S, H, D]`` layout: output ``[S, H, D]`` and log-sum-exp ``[H, S]``."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention, as flash accepts it
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if is_causal:
        n_q, n_k = q.shape[0], k.shape[0]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out, lse


def _scale_of(query: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])


def _forward_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None):
    out = torch.empty_like(query)
    lse = torch.full((query.shape[1], query.shape[0]), float("-inf"), dtype=torch.float32)
    s = _scale_of(query, scale)
    for (q0, q1), (k0, k1) in zip(_documents(cu_seq_q), _documents(cu_seq_k), strict=True):
        doc_out, doc_lse = _attend(query[q0:q1], key[k0:k1], value[k0:k1], is_causal, s)
        out[q0:q1] = doc_out
        lse[:, q0:q1] = doc_lse
    return out, lse, torch.zeros((2,), dtype=torch.uint64)


def _backward_cpu(
    grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state, scale=None
):
    """The softmax-attention gradients, per document, from the saved log-sum-exp (as flash
    does; a kernel runs below autograd, so it cannot differentiate by recording)."""
    s = _scale_of(query, scale)
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    repeat = query.shape[1] // key.shape[1]
    for (q0, q1), (k0, k1) in zip(_documents(cu_seq_q), _documents(cu_seq_k), strict=True):
        q, do, o = query[q0:q1].float(), grad_out[q0:q1].float(), out[q0:q1].float()
        k = key[k0:k1].float().repeat_interleave(repeat, dim=1)
        v = value[k0:k1].float().repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * s
        if is_causal:
            n_q, n_k = q.shape[0], k.shape[0]
            mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.exp(scores - lse[:, q0:q1].unsqueeze(-1))
        grad_v = torch.einsum("hqk,qhd->khd", probs, do)
        grad_p = torch.einsum("qhd,khd->hqk", do, v)
        row = (do * o).sum(-1).transpose(0, 1).unsqueeze(-1)  # [H, S, 1]
        grad_s = probs * (grad_p - row) * s
        grad_q = torch.einsum("hqk,khd->qhd", grad_s, k)
        grad_k = torch.einsum("hqk,qhd->khd", grad_s, q)
        if repeat > 1:  # fold the repeated key/value heads back onto their group
            grad_k = grad_k.unflatten(1, (-1, repeat)).sum(2)
            grad_v = grad_v.unflatten(1, (-1, repeat)).sum(2)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = grad_q.to(dq.dtype), grad_k.to(dk.dtype), grad_v.to(dv.dtype)
    return dq, dk, dv


def register_cpu_varlen_kernel() -> None:
    """Register the CPU kernels on AReaL's ops (idempotent; imports AReaL's module)."""
    global _registered
    if _registered:
        return
    from areal.experimental.models.archon.attention import varlen

    varlen._varlen_attn.register_kernel("cpu")(_forward_cpu)
    varlen._varlen_attn_backward.register_kernel("cpu")(_backward_cpu)
    register_cpu_histc()
    _registered = True
    logger.info("registered CPU kernels for AReaL's varlen attention ops and integer histc")
