"""Packed-document attention kernels a family needs when Archon's shared wrappers lack
its feature: a sliding window, soft-capped scores, learned sink logits, or a mix.

AReaL's shared ``attention`` module has none of them, so a ported package carries its
own kernel (the ``sliding_window``, ``eager_attention`` and ``attention_sinks`` edits copy
the classes and helpers it needs from here). Each kernel chooses its path in one place,
its ``forward``:

- CUDA, fp16/bf16, a plain window, a torch whose flash varlen kernel takes a window
  (2.11 and newer): that kernel, which skips cross-document blocks
  (:func:`flash_varlen_keywords` reads what the installed kernel takes).
- CUDA otherwise (soft-capped scores, sinks, ALiBi, fp32, an older torch): flex
  attention (:func:`flex_packed`), compiled once per process (:func:`flex_functions`):
  the document/causal/window rule as a block mask built from the packed document ids, a
  soft-cap or ALiBi bias as its ``score_mod``, sinks folded in afterwards from the
  kernel's log-sum-exp (:func:`fold_sinks`). Uncompiled, flex attention materialises the
  scores (measured: 12.5 GiB more for a 1.1B gemma2 at 20k tokens on an H200), so the CUDA
  path never runs it eager.
- CPU: one call per document (:func:`per_document`). Measured fastest there
  (``bench/attention_kernels.py``): CPU attention is bound by arithmetic, and a padded
  batch or a ``[T, T]`` document mask spends it on masked-out blocks (2-10x slower for
  8 documents of 64-512 tokens); flex attention has no CPU backward.

Every kernel's math on CPU lives in an ``attend(q, k, v, scale)`` method over documents
that each start at position 0 of their row, so one ``[L, L]`` mask (causal, banded) or
additive score bias (ALiBi) serves every document.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def per_document(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """``attend`` on each document of ``[1, H, T, D]`` tensors in turn, concatenated along T.

    Tokens past ``cu_seqlens[-1]`` (padding) attend as one more document of their own.
    """
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[-1] < q.shape[2]:
        bounds.append(q.shape[2])
    spans = [(start, end) for start, end in pairwise(bounds) if end > start]
    outputs = [attend(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], **kwargs) for s, e in spans]
    return torch.cat(outputs, dim=2)


@functools.cache
def flex_functions(compiled: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(flex_attention, create_block_mask)``, compiled once per process when ``compiled``.

    Uncompiled, flex attention materialises every score and ``create_block_mask`` every
    ``[T, T]`` mask entry; compiled, both are fused kernels that skip masked blocks. CUDA
    always takes the compiled pair (as torchtitan compiles its flex attention where it is
    defined); the CPU runs them eager (forward only: flex attention has no CPU backward).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not compiled:
        return flex_attention, create_block_mask
    return torch.compile(flex_attention), torch.compile(create_block_mask)


def flex_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
    score_mod: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flex attention over packed ``[1, H, T, D]`` documents: each token sees the earlier
    tokens of its own document (the last ``window`` of them, itself included, when given),
    as a block mask, so masked blocks are skipped; ``score_mod`` rewrites the scores.

    Returns the output ``[1, H, T, D]`` and each row's log-sum-exp of its scaled scores
    ``[1, H, T]`` (fp32, natural log). Tokens past ``cu_seqlens[-1]`` form one more document.
    """
    flex_attention, create_block_mask = flex_functions(q.is_cuda)
    total = q.shape[2]
    positions = torch.arange(total, device=q.device)
    documents = torch.searchsorted(cu_seqlens.to(q.device, torch.long), positions, right=True)

    def visible(batch, head, query, key):
        keep = (documents[query] == documents[key]) & (query >= key)
        return keep & (query - key < window) if window is not None else keep

    block_mask = create_block_mask(visible, None, None, total, total, device=q.device)
    enable_gqa = q.shape[1] != k.shape[1]
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch before 2.9 returns the log-sum-exp by the older flag
        out, lse = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True
        )
        return out, lse
    out, aux = flex_attention(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=enable_gqa,
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse


@functools.cache
def flash_varlen_keywords() -> frozenset[str]:
    """The parameters of the installed torch's flash varlen kernel
    (``torch.nn.attention.varlen.varlen_attn``); empty where torch has none.

    They differ by version: 2.10 takes ``is_causal`` and nothing else, 2.11 ``scale`` and
    ``window_size``, 2.13 also ``enable_gqa``. Read, not assumed from one version.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


class SlidingWindowAttention(nn.Module):
    """Causal attention over packed documents in which each token sees only the last
    ``window`` tokens of its own document, itself included (HF's sliding-window mask).

    Archon's shared attention wrappers have no window, so it lives in this package: on
    CUDA the flash varlen kernel with its native window (fp16/bf16, a torch whose kernel
    takes ``window_size``), else compiled flex attention with the window in its block
    mask; on CPU SDPA with a banded causal mask, one document at a time. A window of
    ``None`` (a config without one) sees the whole document, as HF does.
    """

    def __init__(self, window: int | None):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {window}.")
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """``q`` ``[1, H, T, D]``, ``k``/``v`` ``[1, H_kv, T, D]`` -> ``[1, H, T, D]``."""
        if not q.is_cuda:
            return per_document(self.attend, q, k, v, cu_seqlens, scale=scale)
        flash = {"window_size", "scale"} <= flash_varlen_keywords() and q.dtype in (torch.float16, torch.bfloat16)
        if flash and int(cu_seqlens[-1]) == q.shape[2]:
            return self.flash(q, k, v, cu_seqlens, max_seqlen, scale)
        out, _ = flex_packed(q, k, v, cu_seqlens, q.shape[-1] ** -0.5 if scale is None else scale, self.window)
        return out

    def flash(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float | None,
    ) -> torch.Tensor:
        """PyTorch's flash varlen kernel (torch >= 2.11: it takes ``window_size``) on packed
        ``[1, H, T, D]`` tensors: the window is native, cross-document blocks are skipped.
        Key/value heads are repeated to the query heads where the kernel has no ``enable_gqa``."""
        from torch.nn.attention.varlen import varlen_attn

        keys, values = k[0].transpose(0, 1), v[0].transpose(0, 1)
        grouped: dict[str, Any] = {}
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1 and "enable_gqa" in flash_varlen_keywords():
            grouped["enable_gqa"] = True
        elif n_rep > 1:
            keys, values = keys.repeat_interleave(n_rep, dim=1), values.repeat_interleave(n_rep, dim=1)
        cu = cu_seqlens.to(torch.int32)
        out: torch.Tensor = varlen_attn(  # type: ignore[assignment]  # the output alone (no return_aux)
            q[0].transpose(0, 1),
            keys,
            values,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            scale=scale,
            window_size=(-1 if self.window is None else self.window - 1, 0),  # excludes the query itself
            **grouped,
        )
        return out.transpose(0, 1).unsqueeze(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Documents starting at position 0 of their rows, ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
        index = torch.arange(q.shape[2], device=q.device)
        distance = index[:, None] - index[None, :]
        mask = distance >= 0
        if self.window is not None:
            mask = mask & (distance < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class EagerAttention(nn.Module):
    """Attention over packed documents with soft-capped scores: ``softcap * tanh(scores /
    softcap)`` before the causal (and, for a sliding-window layer, banded) mask and an
    fp32 softmax, as HF's eager path does. SDPA cannot soft-cap.

    Archon's shared attention wrappers have neither soft-capping nor windows, so this
    lives in the package: on CUDA compiled flex attention (the cap as its score_mod, a
    block mask from the document ids); on CPU the scores computed explicitly, one
    document at a time.
    """

    def __init__(self, softcap: float | None = None, window: int | None = None):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {window}.")
        self.softcap = softcap
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """``q`` ``[1, H, T, D]``, ``k``/``v`` ``[1, H_kv, T, D]`` -> ``[1, H, T, D]``."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if q.is_cuda:
            return self.flex(q, k, v, cu_seqlens, scale=scale)
        return per_document(self.attend, q, k, v, cu_seqlens, scale=scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Documents starting at position 0 of their rows, ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
        n_rep = q.shape[1] // k.shape[1]
        keys = k.repeat_interleave(n_rep, dim=1)
        values = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        index = torch.arange(q.shape[2], device=q.device)
        distance = index[:, None] - index[None, :]
        allowed = distance >= 0
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)

    def flex(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Flex attention on packed ``[1, H, T, D]`` tensors: the soft-cap as ``score_mod``;
        documents, causality and the window as a block mask, so masked blocks are skipped."""
        softcap = self.softcap

        def capped(score, batch, head, query, key):
            return torch.tanh(score / softcap) * softcap if softcap is not None else score

        out, _ = flex_packed(q, k, v, cu_seqlens, scale, self.window, capped)
        return out


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention ``out`` ``[B, H, T, D]`` with each head's sink logit joined to every row's
    softmax: with ``lse`` ``[B, H, T]`` the log-sum-exp of the row's scaled scores, the rows'
    weights shrink by ``exp(lse) / (exp(lse) + exp(sink))`` = ``sigmoid(lse - sink)`` (the
    sink's share of the softmax, which attends to nothing, removed). In fp32 at least, cast back."""
    dtype = torch.promote_types(out.dtype, torch.float32)
    keep = torch.sigmoid(lse.to(dtype) - sinks.to(dtype).view(1, -1, 1))
    return (out.to(dtype) * keep.unsqueeze(-1)).to(out.dtype)


class SinkAttention(nn.Module):
    """Causal attention over packed documents with a learned sink logit per head: each
    row's softmax runs over its scores and the head's sink, and the sink's share is
    dropped (it attends to nothing), as HF's ``sinks`` / ``s_aux`` do. On a sliding-window
    layer each token sees the last ``window`` tokens of its own document.

    Neither SDPA nor the flash varlen kernel takes a sink: on CUDA compiled flex attention
    returns each row's log-sum-exp and the sink is folded in from it (:func:`fold_sinks`),
    so no score is ever materialised; on CPU the scores are computed explicitly, one
    document at a time.
    """

    def __init__(self, window: int | None = None):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {window}.")
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sinks: torch.Tensor,
        scale: float | None = None,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """``q`` ``[1, H, T, D]``, ``k``/``v`` ``[1, H_kv, T, D]``, ``sinks`` ``[H]`` -> ``[1, H, T, D]``."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if q.is_cuda:
            return self.flex(q, k, v, sinks, cu_seqlens, scale)
        return per_document(self.attend, q, k, v, cu_seqlens, sinks=sinks, scale=scale)

    def flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Flex attention on packed ``[1, H, T, D]`` tensors (documents, causality and the
        window as a block mask), the sinks folded in from its log-sum-exp."""
        out, lse = flex_packed(q, k, v, cu_seqlens, scale, self.window)
        return fold_sinks(out, lse, sinks)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Documents starting at position 0 of their rows, ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
        n_rep = q.shape[1] // k.shape[1]
        keys = k.repeat_interleave(n_rep, dim=1)
        values = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale
        index = torch.arange(q.shape[2], device=q.device)
        distance = index[:, None] - index[None, :]
        allowed = distance >= 0
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        # The sink joins each row's softmax in fp32 (HF keeps the sink arithmetic in fp32).
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)
        return torch.matmul(probs[..., :-1].to(q.dtype), values)


class SoftCappedSinkAttention(SinkAttention):
    """:class:`SinkAttention` whose scores are soft-capped first: ``softcap * tanh(scores /
    softcap)`` on the scaled scores, then the causal (and window) mask, then the head's sink
    joins the softmax uncapped (HF's eager order: the cap rewrites the scores before the
    mask and the sink logits are concatenated after it).

    A kernel of its own, for the families that have both (the ``attention_sinks`` edit picks
    it when the analysis also found a soft-cap), so a family with sinks alone carries no cap.
    On CUDA the cap is flex attention's ``score_mod`` and the sinks are folded in from the
    log-sum-exp of the capped scores; on CPU the capped scores are computed explicitly.
    """

    def __init__(self, softcap: float, window: int | None = None):
        super().__init__(window)
        self.softcap = softcap

    def flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Flex attention on packed ``[1, H, T, D]`` tensors with the cap as ``score_mod``,
        the sinks folded in from the log-sum-exp of the capped scores."""
        softcap = self.softcap

        def capped(score, batch, head, query, key):
            return torch.tanh(score / softcap) * softcap

        out, lse = flex_packed(q, k, v, cu_seqlens, scale, self.window, capped)
        return fold_sinks(out, lse, sinks)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Documents starting at position 0 of their rows, ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
        n_rep = q.shape[1] // k.shape[1]
        keys = k.repeat_interleave(n_rep, dim=1)
        values = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        index = torch.arange(q.shape[2], device=q.device)
        distance = index[:, None] - index[None, :]
        allowed = distance >= 0
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        # The sink joins each row's softmax in fp32, uncapped.
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)
        return torch.matmul(probs[..., :-1].to(q.dtype), values)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's fixed per-head slopes (Press et al.), fp32 ``[n_heads]``.

    With ``n`` the largest power of two not above ``n_heads``, the first ``n`` heads get
    ``r, r**2, ..., r**n`` for ``r = 2**(-8 / n)``; the remaining heads take the odd powers
    ``s, s**3, ...`` of ``s = 2**(-4 / n)`` (the slopes of ``2n`` heads that the first ``n``
    skipped). Bloom's ``build_alibi_tensor`` and MPT's ``build_mpt_alibi_tensor`` give
    these slopes for every head count.
    """
    closest = 2 ** math.floor(math.log2(n_heads))
    base = torch.full((), 2.0 ** (-8.0 / closest), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, closest + 1, dtype=torch.int32))
    if closest != n_heads:
        extra = torch.full((), 2.0 ** (-4.0 / closest), dtype=torch.float32)
        powers = torch.arange(1, 1 + 2 * (n_heads - closest), 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra, powers)])
    return slopes


class AlibiAttention(nn.Module):
    """Causal attention over packed documents with ALiBi: head ``h`` adds
    ``slopes[h] * (key - query)`` to its scores, both positions counted within their
    document (only tokens of one document attend to each other, so the packed indices'
    difference is the in-document one). Softmax ignores a per-row constant, so this is
    HF's ``slope * key_position`` (Bloom) and ``slope * (key_position - L + 1)`` (MPT).

    Archon's shared wrappers take no score bias, so it lives in this package: compiled
    flex attention on CUDA (the bias as ``score_mod``, a block mask from the document ids,
    no loop over documents); on CPU SDPA with the bias as an additive mask, one document at a
    time (:func:`per_document`, measured fastest there; flex attention has no CPU backward).
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        slopes: torch.Tensor,
        scale: float | None = None,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """``q`` ``[1, H, T, D]``, ``k``/``v`` ``[1, H_kv, T, D]``, ``slopes`` ``[H]`` -> ``[1, H, T, D]``."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if q.is_cuda:
            return self.flex(q, k, v, slopes, cu_seqlens, scale)
        return per_document(self.attend, q, k, v, cu_seqlens, slopes=slopes, scale=scale)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Documents starting at position 0 of their rows, ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
        index = torch.arange(q.shape[2], device=q.device)
        distance = (index[None, :] - index[:, None]).to(torch.float32)  # key - query
        bias = slopes.to(q.device, torch.float32).view(-1, 1, 1) * distance
        bias = bias.masked_fill(distance > 0, float("-inf")).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Flex attention on packed ``[1, H, T, D]`` tensors: the ALiBi bias as ``score_mod``;
        documents and causality as a block mask, so masked blocks are skipped."""
        head_slopes = slopes.to(q.device, torch.float32)

        def alibi(score, batch, head, query, key):
            return score + head_slopes[head] * (key - query)

        out, _ = flex_packed(q, k, v, cu_seqlens, scale, score_mod=alibi)
        return out


class WindowedAlibiAttention(AlibiAttention):
    """:class:`AlibiAttention` on a sliding window: each token sees the last ``window``
    tokens of its own document, itself included, each scored with its head's ALiBi bias
    (``None``: the whole document, as on a full-attention layer of a per-layer pattern).

    A kernel of its own, for the families that have both (the ``alibi_attention`` edit picks
    it where the analysis found a window), so an ALiBi family without one carries no window.
    On CUDA the window is part of flex attention's block mask; on CPU of the additive mask.
    """

    def __init__(self, window: int | None):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {window}.")
        self.window = window

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Documents starting at position 0 of their rows, ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
        index = torch.arange(q.shape[2], device=q.device)
        distance = (index[None, :] - index[:, None]).to(torch.float32)  # key - query
        hidden = distance > 0
        if self.window is not None:
            hidden = hidden | (distance <= -self.window)
        bias = slopes.to(q.device, torch.float32).view(-1, 1, 1) * distance
        bias = bias.masked_fill(hidden, float("-inf")).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Flex attention on packed ``[1, H, T, D]`` tensors: the ALiBi bias as ``score_mod``;
        documents, causality and the window as a block mask."""
        head_slopes = slopes.to(q.device, torch.float32)

        def alibi(score, batch, head, query, key):
            return score + head_slopes[head] * (key - query)

        out, _ = flex_packed(q, k, v, cu_seqlens, scale, self.window, score_mod=alibi)
        return out


class SoftCappedAlibiAttention(WindowedAlibiAttention):
    """ALiBi on soft-capped scores: ``softcap * tanh(scores / softcap)`` on the scaled
    scores, then each head's ALiBi bias (uncapped), then the causal mask (and the window,
    when given), as the eager attention of such a family orders them. SDPA cannot cap, so
    the CPU path computes the scores explicitly; on CUDA the cap and the bias are flex
    attention's ``score_mod``.

    A kernel of its own, for the families that have both (the ``alibi_attention`` edit picks
    it where the analysis also found a soft-cap; the analysis's slope probe reads a bias
    added after the cap as linear, one added before it as none).
    """

    def __init__(self, softcap: float, window: int | None = None):
        super().__init__(window)
        self.softcap = softcap

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Documents starting at position 0 of their rows, ``[B, H, L, D]`` -> ``[B, H, L, D]``."""
        n_rep = q.shape[1] // k.shape[1]
        keys = k.repeat_interleave(n_rep, dim=1)
        values = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        index = torch.arange(q.shape[2], device=q.device)
        distance = (index[None, :] - index[:, None]).to(torch.float32)  # key - query
        hidden = distance > 0
        if self.window is not None:
            hidden = hidden | (distance <= -self.window)
        scores = scores + (slopes.to(q.device, torch.float32).view(-1, 1, 1) * distance).to(scores.dtype)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values)

    def flex(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Flex attention on packed ``[1, H, T, D]`` tensors: the cap, then the ALiBi bias, as
        ``score_mod``; documents, causality and the window as a block mask."""
        head_slopes = slopes.to(q.device, torch.float32)
        softcap = self.softcap

        def capped_alibi(score, batch, head, query, key):
            return torch.tanh(score / softcap) * softcap + head_slopes[head] * (key - query)

        out, _ = flex_packed(q, k, v, cu_seqlens, scale, self.window, score_mod=capped_alibi)
        return out


# A method of the family's ``Attention``: the ``attention_sinks`` edit adds it there.
def local_sinks(self, n_heads: int) -> torch.Tensor:
    """The sink logits of the ``n_heads`` heads this rank attends with: its tensor-parallel
    shard of them, and under Ulysses the slice of heads its all-to-all gave it."""
    sinks = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
    start = self._cp_rank * n_heads if self._sp_enabled else 0
    return sinks[start : start + n_heads]


# A method of the family's ``Attention``: the ``alibi_attention`` edit adds it there.
def local_alibi_slopes(self, n_heads: int, device: torch.device) -> torch.Tensor:
    """The ALiBi slopes of the ``n_heads`` heads this rank attends with: under tensor
    parallelism its block of the heads (``head_offset``, set by ``parallelize``), and
    under Ulysses the slice of those its all-to-all gave it."""
    start = self.head_offset + (self._cp_rank * n_heads if self._sp_enabled else 0)
    return alibi_slopes(self.n_heads).to(device)[start : start + n_heads]


def maybe_to_local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, else ``x``.

    Under tensor parallelism ``wq``/``wk`` keep DTensor outputs so that ``q_norm`` and
    ``k_norm`` run as sequence-parallel modules over the sharded heads; everything after
    them works on this rank's heads as plain tensors.
    """
    return x.to_local() if isinstance(x, DTensor) else x


def clamp_projection(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``x`` clamped to ``[-limit, limit]``; unchanged when ``limit`` is None.

    The checkpoint's ``clip_qkv`` bounds the q, k and v projections (OLMo) to keep
    training stable; a config without one leaves them as they are.
    """
    return x if limit is None else x.clamp(min=-limit, max=limit)


def query_position_scale(positions: torch.Tensor, beta: float, period: int) -> torch.Tensor:
    """The factor on the query at position ``p``: ``1 + beta * log(1 + floor(p / period))``,
    shaped ``[1, T, 1, 1]`` to scale ``[1, T, heads, head_dim]`` queries.

    Ministral3's long-context attention temperature: the first ``period`` positions of a
    document keep their queries, later ones are sharpened a little more at each multiple of
    ``period``. Positions restart at 0 in every packed document, as HF's do in each sequence.
    """
    scale = 1 + beta * torch.log(1 + torch.floor(positions / period))
    return scale[..., None, None]


def chunk_documents(cu_seqlens: torch.Tensor, max_seqlen: int, chunk: int) -> tuple[torch.Tensor, int]:
    """Packed documents cut into chunks of ``chunk`` tokens counted from each document's first
    token: the boundaries and the longest chunk, for the attention kernel to treat each chunk
    as a document of its own.

    Chunked local attention (Llama 4's ``attention_chunk_size``): a token attends to the earlier
    tokens of its chunk only, as HF's chunked mask allows in each sequence. Causal attention over
    these documents is exactly that, whatever the kernel (flash, flex, one call per document),
    and a window or a score bias of the kernel still applies inside each chunk. Tokens past
    ``cu_seqlens[-1]`` (padding) stay as they are.
    """
    index = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device)
    document_start = torch.repeat_interleave(cu_seqlens[:-1], torch.diff(cu_seqlens))
    starts = index[(index - document_start) % chunk == 0]
    return torch.cat([starts, cu_seqlens[-1:]]).to(cu_seqlens.dtype), min(max_seqlen, chunk)


def split_query_gate(projected: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries and the output gate of a query projection whose rows hold, head after
    head, the head's query and then its gate (``[..., heads * 2 * head_dim]``; the heads a
    rank holds under tensor parallelism): two ``[..., heads * head_dim]`` tensors."""
    query, gate = projected.unflatten(-1, (-1, 2 * head_dim)).chunk(2, dim=-1)
    return query.flatten(-2), gate.flatten(-2)


def gate_per_head(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output ``out`` (``[..., heads * head_dim]``) with each head's channels
    scaled by that head's one gate value (``gate``: ``[..., heads]``; the heads a rank
    holds under tensor parallelism)."""
    return (out.unflatten(-1, (gate.shape[-1], -1)) * gate.unsqueeze(-1)).flatten(-2)
