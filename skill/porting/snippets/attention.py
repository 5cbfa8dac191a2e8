"""Packed-document attention kernels a family needs when Archon's shared wrappers lack
its feature: a sliding window, soft-capped scores, or both.

AReaL's shared ``attention`` module has neither, so a ported package carries its own
kernel (copied from here by the ``attention_kernel`` edit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SlidingWindowAttention(nn.Module):
    """Causal attention over packed documents in which each token sees only the last
    ``window`` tokens of its own document, itself included (HF's sliding-window mask).

    Archon's shared attention wrappers have no window, so it lives in this package: one
    SDPA call per document with a banded causal mask, on every backend.
    """

    def __init__(self, window: int):
        super().__init__()
        if window < 1:
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
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[-1] < q.shape[2]:
            bounds.append(q.shape[2])  # trailing padding attends as its own document
        outputs = []
        for doc in range(len(bounds) - 1):
            start, end = bounds[doc], bounds[doc + 1]
            if end <= start:
                continue
            index = torch.arange(end - start, device=q.device)
            distance = index[:, None] - index[None, :]
            mask = (distance >= 0) & (distance < self.window)
            outputs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start:end],
                    k[:, :, start:end],
                    v[:, :, start:end],
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=q.shape[1] != k.shape[1],
                )
            )
        return torch.cat(outputs, dim=2)


class EagerAttention(nn.Module):
    """Attention over packed documents computed step by step, because SDPA cannot
    soft-cap scores: ``softcap * tanh(scores / softcap)`` before the causal (and, for a
    sliding-window layer, banded) mask and an fp32 softmax, as HF's eager path does.

    Archon's shared attention wrappers have neither soft-capping nor windows, so this
    lives in the package. One document at a time; no document attends to another.
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
        n_rep = q.shape[1] // k.shape[1]
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[-1] < q.shape[2]:
            bounds.append(q.shape[2])  # trailing padding attends as its own document
        outputs = []
        for doc in range(len(bounds) - 1):
            start, end = bounds[doc], bounds[doc + 1]
            if end <= start:
                continue
            keys = k[:, :, start:end].repeat_interleave(n_rep, dim=1)
            values = v[:, :, start:end].repeat_interleave(n_rep, dim=1)
            scores = torch.matmul(q[:, :, start:end], keys.transpose(2, 3)) * scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            index = torch.arange(end - start, device=q.device)
            distance = index[:, None] - index[None, :]
            allowed = distance >= 0
            if self.window is not None:
                allowed = allowed & (distance < self.window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            outputs.append(torch.matmul(probs, values))
        return torch.cat(outputs, dim=2)


def clamp_projection(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``x`` clamped to ``[-limit, limit]``; unchanged when ``limit`` is None.

    The checkpoint's ``clip_qkv`` bounds the q, k and v projections (OLMo) to keep
    training stable; a config without one leaves them as they are.
    """
    return x if limit is None else x.clamp(min=-limit, max=limit)
