"""Packed-document attention as one SDPA call with a dense block-diagonal causal mask.

Simple and backend-agnostic, but the mask is ``[T, T]``: memory and compute grow
with the square of the packed length, including the blocks that are masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["SDPAWrapper", "create_block_causal_mask_2d"]


def create_block_causal_mask_2d(
    cu_seqlens: torch.Tensor,
    seq_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A ``[seq_len, seq_len]`` additive mask: ``0`` where a query may attend, ``-inf`` elsewhere.

    Token ``i`` attends to token ``j`` iff both lie in the same document and ``j <= i``.
    Documents are ``[cu_seqlens[d], cu_seqlens[d + 1])``. Tokens past ``cu_seqlens[-1]``
    (padding) form one more document of their own, so no row is fully masked and
    softmax never yields NaN.
    """
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least two entries [0, ..., total], got shape {tuple(cu_seqlens.shape)}."
        )
    positions = torch.arange(seq_len, device=device)
    boundaries = cu_seqlens.to(device=device, dtype=positions.dtype)
    doc_ids = torch.searchsorted(boundaries, positions, right=True)
    same_doc = doc_ids.unsqueeze(1) == doc_ids.unsqueeze(0)
    causal = positions.unsqueeze(0) <= positions.unsqueeze(1)
    mask = torch.full((seq_len, seq_len), float("-inf"), device=device, dtype=dtype)
    return mask.masked_fill(same_doc & causal, 0.0)


class SDPAWrapper(nn.Module):
    """Attention over packed documents with one SDPA call and a block-diagonal causal mask.

    Args:
        sdpa_backends: restrict SDPA to these kernels (in priority order); ``None``
            lets PyTorch choose.
    """

    def __init__(self, sdpa_backends: list[SDPBackend] | None = None):
        super().__init__()
        self.sdpa_backends = sdpa_backends

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
        """``q`` ``[B, H, T, D]``, ``k``/``v`` ``[B, H_kv, T, D]`` → ``[B, H, T, D]``.

        ``max_seqlen`` is unused here; it is accepted so both backends share one signature.
        """
        mask = create_block_causal_mask_2d(cu_seqlens, q.shape[2], q.device, q.dtype)
        enable_gqa = q.shape[1] != k.shape[1]
        if self.sdpa_backends is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
