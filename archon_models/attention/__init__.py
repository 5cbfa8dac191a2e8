"""Attention over packed documents.

Two interchangeable backends with one call signature,
``wrapper(q, k, v, *, scale, cu_seqlens, max_seqlen)`` on ``[1, heads, T, head_dim]``:

- :class:`SDPAWrapper`: one SDPA call with a block-diagonal causal mask.
- :class:`VarlenAttentionWrapper`: flash varlen attention on CUDA, a per-document
  SDPA loop elsewhere.
"""

from archon_models.attention.sdpa import SDPAWrapper, create_block_causal_mask_2d
from archon_models.attention.varlen import VarlenAttentionWrapper, varlen_attn

__all__ = [
    "SDPAWrapper",
    "VarlenAttentionWrapper",
    "create_block_causal_mask_2d",
    "varlen_attn",
]
