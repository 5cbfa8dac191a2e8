"""Packed-document attention kernels a family needs when Archon's shared wrappers lack
its feature: a sliding window, soft-capped scores, learned sink logits, or a mix.

AReaL's shared ``attention`` module has none of them, so a ported package carries its
own kernel (the ``sliding_window``, ``eager_attention`` and ``attention_sinks`` edits copy
the classes and helpers it needs from here). Each kernel chooses its path in one place,
its ``forward``:

- CUDA, fp16/bf16, a plain window: PyTorch's flash varlen kernel, which takes the
  window natively and skips cross-document blocks.
- CUDA, soft-capped scores: flex attention, the cap as its ``score_mod`` and the
  document/causal/window rule as a block mask built from the packed document ids.
- CUDA otherwise (sinks, fp32): the documents scattered into one zero-padded
  ``[n_docs, H, L, D]`` batch by index, attended with one batched call, gathered back
  (:func:`padded_documents`). No Python loop over documents on the GPU.
- CUDA, ALiBi: flex attention, the per-head linear bias as its ``score_mod`` and the
  document/causal rule as a block mask (no Python loop over documents).
- CPU: one call per document (:func:`per_document`). Measured fastest there
  (``bench/attention_kernels.py``): CPU attention is bound by arithmetic, and a padded
  batch or a ``[T, T]`` document mask spends it on masked-out blocks (2-10x slower for
  8 documents of 64-512 tokens); flex attention has no CPU backward.

Every kernel's math lives in an ``attend(q, k, v, scale)`` method over documents that
each start at position 0 of their row, so one ``[L, L]`` mask (causal, banded) or
additive score bias (ALiBi) serves every document, whichever of the two drivers runs it.
"""

from __future__ import annotations

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


def padded_documents(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """``attend`` once on the documents of ``[1, H, T, D]`` tensors as a zero-padded
    ``[n_docs, H, L, D]`` batch (each document from position 0), gathered back to ``[1, H, T, D]``.

    Padded keys sit after every real query of their row, so a causal ``attend`` never
    sees them; padded query rows are dropped. Tokens past ``cu_seqlens[-1]`` form one
    more document.
    """
    total = q.shape[2]
    bounds = cu_seqlens.to(torch.long)
    if int(bounds[-1]) < total:
        bounds = torch.cat([bounds, bounds.new_tensor([total])])
    lengths = bounds[1:] - bounds[:-1]
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=bounds.device), lengths)
    columns = torch.arange(total, device=bounds.device) - bounds[:-1][rows]
    shape = (lengths.numel(), int(lengths.max()))

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(*shape, x.shape[1], x.shape[3])
        return out.index_put((rows, columns), x[0].transpose(0, 1)).transpose(1, 2)

    out = attend(pad(q), pad(k), pad(v), **kwargs)
    return out.transpose(1, 2)[rows, columns].transpose(0, 1).unsqueeze(0)


class SlidingWindowAttention(nn.Module):
    """Causal attention over packed documents in which each token sees only the last
    ``window`` tokens of its own document, itself included (HF's sliding-window mask).

    Archon's shared attention wrappers have no window, so it lives in this package: the
    flash varlen kernel with its native window on CUDA (fp16/bf16); elsewhere SDPA with
    a banded causal mask, over the padded documents on CUDA, one document at a time on CPU.
    A window of ``None`` (a config without one) sees the whole document, as HF does.
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
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and int(cu_seqlens[-1]) == q.shape[2]:
            return self.flash(q, k, v, cu_seqlens, max_seqlen, scale)
        run = padded_documents if q.is_cuda else per_document
        return run(self.attend, q, k, v, cu_seqlens, scale=scale)

    def flash(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float | None,
    ) -> torch.Tensor:
        """PyTorch's flash varlen kernel (torch >= 2.9) on packed ``[1, H, T, D]`` tensors: the
        window is native, cross-document blocks are skipped."""
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens.to(torch.int32)
        out: torch.Tensor = varlen_attn(  # type: ignore[assignment]  # the output alone (no return_aux)
            q[0].transpose(0, 1),
            k[0].transpose(0, 1),
            v[0].transpose(0, 1),
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            scale=scale,
            window_size=(-1 if self.window is None else self.window - 1, 0),  # excludes the query itself
            enable_gqa=q.shape[1] != k.shape[1],
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
    lives in the package: on CUDA flex attention (the cap as its score_mod, a block mask
    from the document ids; fused where the block is compiled, as ``parallelize`` does by
    default); on CPU the scores computed explicitly, one document at a time.
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
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        total = q.shape[2]
        positions = torch.arange(total, device=q.device)
        documents = torch.searchsorted(cu_seqlens.to(q.device, torch.long), positions, right=True)
        softcap, window = self.softcap, self.window

        def allowed(batch, head, query, key):
            keep = (documents[query] == documents[key]) & (query >= key)
            return keep & (query - key < window) if window is not None else keep

        def capped(score, batch, head, query, key):
            return torch.tanh(score / softcap) * softcap if softcap is not None else score

        block_mask = create_block_mask(allowed, None, None, total, total, device=q.device)
        return flex_attention(
            q, k, v, score_mod=capped, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )


class SinkAttention(nn.Module):
    """Causal attention over packed documents with a learned sink logit per head: each
    row's softmax runs over its scores and the head's sink, and the sink's share is
    dropped (it attends to nothing), as HF's ``sinks`` / ``s_aux`` do. On a sliding-window
    layer each token sees the last ``window`` tokens of its own document.

    Neither SDPA nor the flash varlen kernel takes a sink, so the scores are computed
    explicitly: over the padded documents in one batched call on CUDA, one document at a
    time on CPU.
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
        run = padded_documents if q.is_cuda else per_document
        return run(self.attend, q, k, v, cu_seqlens, sinks=sinks, scale=scale)

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

    Archon's shared wrappers take no score bias, so it lives in this package: flex
    attention on CUDA (the bias as ``score_mod``, a block mask from the document ids, no
    loop over documents); on CPU SDPA with the bias as an additive mask, one document at a
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
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        total = q.shape[2]
        positions = torch.arange(total, device=q.device)
        documents = torch.searchsorted(cu_seqlens.to(q.device, torch.long), positions, right=True)
        head_slopes = slopes.to(q.device, torch.float32)

        def causal_document(batch, head, query, key):
            return (documents[query] == documents[key]) & (query >= key)

        def alibi(score, batch, head, query, key):
            return score + head_slopes[head] * (key - query)

        block_mask = create_block_mask(causal_document, None, None, total, total, device=q.device)
        return flex_attention(
            q, k, v, score_mod=alibi, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )


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


def gate_per_head(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output ``out`` (``[..., heads * head_dim]``) with each head's channels
    scaled by that head's one gate value (``gate``: ``[..., heads]``; the heads a rank
    holds under tensor parallelism)."""
    return (out.unflatten(-1, (gate.shape[-1], -1)) * gate.unsqueeze(-1)).flatten(-2)
