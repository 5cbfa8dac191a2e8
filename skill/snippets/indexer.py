"""DeepSeek Sparse Attention: the indexer that picks each query's keys, and the attention
over packed documents that keeps only those keys (the ``sparse_indexer`` edit copies them
into an MLA package).

AReaL has no kernel for it, so the package carries a correct PyTorch path: per document, the
indexer's ``[L, L]`` scores, their causal top-k as a boolean mask, and SDPA with that mask, on
CPU and CUDA alike. A fused sparse kernel (DeepSeek's FlashMLA sparse prefill, which reads the
top-k indices themselves) would gain what this path spends on the dense mask: the attention's
cost and memory grow with ``L * index_topk`` instead of ``L * L`` per document, and no
``[L, L]`` score or mask tensor is held. The selection itself needs the ``[L, L]`` index scores
either way (DeepSeek's own ``fp8_index`` computes them in FP8).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from archon_models.deepseek_v3.model.rope import apply_rotary_emb


class Indexer(nn.Module):
    """The sparse-attention indexer of one MLA layer (HF's ``indexer``, no gradient).

    ``index_n_heads`` query heads of ``index_head_dim`` come from the attention's query latent
    (``wq_b(q_latent)``), one key head from the hidden state (``k_norm(wk(x))``, a LayerNorm);
    the first ``qk_rope_head_dim`` of each are rotated by the model's RoPE cache (the halves, or
    interleaved pairs where the edit writes ``apply_interleaved_rotary_emb``). A query ``s``
    scores key ``t`` as ``sum_h weights_proj(x_s)_h / sqrt(index_n_heads) * relu(q_{s,h} . k_t /
    sqrt(index_head_dim))`` and keeps its ``index_topk`` best causal keys
    (:func:`sparse_index_mask`). HF computes the indexer under ``torch.no_grad``: its weights
    get no gradient from the language-model loss (DeepSeek trains them by a separate
    distillation loss), and neither does the query latent through it; so here.
    """

    def __init__(self, model_args: Any):
        super().__init__()
        self.n_heads = model_args.index_n_heads
        self.head_dim = model_args.index_head_dim
        self.rope_dim = model_args.qk_rope_head_dim
        self.topk = model_args.index_topk
        self.wq_b = nn.Linear(model_args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(model_args.dim, self.n_heads, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)
        self.k_norm.reset_parameters()

    @torch.no_grad()
    def forward(
        self, x: torch.Tensor, q_latent: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: the queries ``[bs, seq, n_heads, head_dim]``, the key ``[bs, seq, head_dim]``
        and the head weights ``[bs, seq, n_heads]`` (fp32) that :func:`sparse_index_mask` scores."""
        bs, seqlen, _ = x.shape
        q = self.wq_b(q_latent).view(bs, seqlen, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        q_pe, k_pe = apply_rotary_emb(q[..., : self.rope_dim], k[..., : self.rope_dim], rope_cache, positions)
        q = torch.cat([q_pe, q[..., self.rope_dim :]], dim=-1)
        k = torch.cat([k_pe, k[..., self.rope_dim :]], dim=-1).squeeze(2)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return q, k, weights


@torch.no_grad()
def sparse_index_mask(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, mask_dtype: torch.dtype
) -> torch.Tensor:
    """``[L, L]`` boolean: query ``s`` may attend key ``t`` (``t <= s`` and ``t`` among the
    ``topk`` best index scores of row ``s``). One document of ``q [L, n_heads, head_dim]``, ``k
    [L, head_dim]`` and ``weights [L, n_heads]``, starting at position 0.

    The scores are computed in fp32 with HF's operations and its additive causal mask of
    ``mask_dtype``'s minimum, so that equal scores (a key every head's ReLU zeroes) are broken
    the same way."""
    length, _, head_dim = q.shape
    scores = torch.matmul(q[None].float(), k[None].transpose(-1, -2).float().unsqueeze(1)) * head_dim**-0.5
    scores = F.relu(scores)
    index_scores = torch.matmul(weights[None].unsqueeze(-2), scores).squeeze(-2)[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    index_scores = index_scores + torch.zeros(length, length, dtype=mask_dtype, device=q.device).masked_fill(
        ~causal, torch.finfo(mask_dtype).min
    )
    chosen = index_scores.topk(min(topk, length), dim=-1).indices
    keep = torch.zeros(length, length, dtype=torch.bool, device=q.device).scatter(-1, chosen, True)
    return keep & causal


class IndexedAttention(nn.Module):
    """Attention over packed documents that keeps, per query, only the keys the indexer chose.

    One document at a time: the indexer's mask (:func:`sparse_index_mask`) and SDPA with it,
    on CPU and CUDA alike (a dense masked path; see the module docstring for what a fused
    sparse kernel would gain). Tokens past ``cu_seqlens[-1]`` (padding) form one more document.
    """

    def __init__(self, topk: int):
        super().__init__()
        self.topk = topk

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``q``/``k``/``v`` ``[1, H, T, D]`` and the indexer's ``(q, k, weights)`` of the same T
        tokens -> ``[1, H, T, D]``."""
        index_q, index_k, index_w = index
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[-1] < q.shape[2]:
            bounds.append(q.shape[2])
        outputs = []
        for start, end in pairwise(bounds):
            if end <= start:
                continue
            keep = sparse_index_mask(
                index_q[0, start:end], index_k[0, start:end], index_w[0, start:end], self.topk, q.dtype
            )
            outputs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], attn_mask=keep, scale=scale
                )
            )
        return torch.cat(outputs, dim=2)
