"""Differential attention (the Differential Transformer, arXiv 2410.05258; transformers'
DiffLlama) for a family's ``model.py`` (the ``differential_attention`` edit copies these in
before ``Attention``) and its ``infra/parallelize.py`` (``validate_differential_pairs``).

Query heads ``i`` and ``i + H/2`` of the checkpoint form a pair: both attend (each with its own
softmax) over the values of two KV heads side by side, and the pair's output is the first
head's minus ``lambda`` times the second's, normalised over its ``2 * head_dim`` features. The
adapter stores ``wq``/``wk``/``wv`` with each pair's heads, and the two KV heads they read,
side by side (``_pair_halves``), so a tensor-parallel or Ulysses rank holds whole pairs and
everything here is local to it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def differential_lambda_init(layer_id: int) -> float:
    """``lambda_init`` of layer ``layer_id`` (0-based): the schedule the analysis measured on
    every layer of the checkpoint's model (the paper's)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_id)


class DifferentialLambda(nn.Module):
    """The learned part of lambda, ``exp(q1 . k1) - exp(q2 . k2)`` (a scalar; HF's
    ``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2``), in float32 as HF computes it.

    A module of its own so that tensor parallelism can replicate it and sum its gradient over
    the ranks: each rank's heads contribute their part of it.
    """

    def __init__(self, head_dim: int):
        super().__init__()
        self.q1 = nn.Parameter(torch.empty(head_dim))
        self.k1 = nn.Parameter(torch.empty(head_dim))
        self.q2 = nn.Parameter(torch.empty(head_dim))
        self.k2 = nn.Parameter(torch.empty(head_dim))

    def forward(self) -> torch.Tensor:
        first = torch.exp(torch.sum(self.q1 * self.k1, dim=-1, dtype=torch.float32))
        second = torch.exp(torch.sum(self.q2 * self.k2, dim=-1, dtype=torch.float32))
        return first - second

    def reset_parameters(self, std: float = 0.1) -> None:
        for vector in (self.q1, self.k1, self.q2, self.k2):
            nn.init.normal_(vector, mean=0.0, std=std)


class DifferentialAttention(nn.Module):
    """Differential attention around any attention kernel (the kernel runs twice, once over
    each KV head of a pair: no kernel needs a value twice as wide as the keys). A fused kernel
    that takes values twice as wide as the keys (one softmax for both KV heads of a pair) would
    compute each head's scores and softmax once instead of twice.

    ``q`` ``[B, H, T, D]`` and ``k``/``v`` ``[B, KV, T, D]`` with the heads in the adapter's
    order (each pair's two KV heads side by side, their query heads after them) ->
    ``[B, H/2, T, 2D]``, the pairs in the checkpoint's order.
    """

    def __init__(self, kernel: nn.Module, layer_id: int, head_dim: int, eps: float):
        super().__init__()
        self.kernel = kernel
        self.lambda_init = differential_lambda_init(layer_id)
        self.norm = nn.RMSNorm(2 * head_dim, eps=eps, elementwise_affine=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, lambda_diff: torch.Tensor, **kwargs: object
    ) -> torch.Tensor:
        kv_heads = v.shape[1]
        if kv_heads % 2:
            raise ValueError(
                f"differential attention got {kv_heads} KV heads on this rank: each rank needs whole pairs, so "
                "n_kv_heads / 2 must be divisible by the tensor-parallel (times Ulysses) degree"
            )
        pairs = v.unflatten(1, (kv_heads // 2, 2))
        first = pairs[:, :, :1].expand_as(pairs).flatten(1, 2).contiguous()
        second = pairs[:, :, 1:].expand_as(pairs).flatten(1, 2).contiguous()
        out = torch.cat([self.kernel(q, k, first, **kwargs), self.kernel(q, k, second, **kwargs)], dim=-1)
        out = out.unflatten(1, (kv_heads // 2, 2, -1))  # [B, pair groups, first|second, heads per KV, T, 2D]
        lam = (lambda_diff + self.lambda_init).to(out.dtype)
        out = out[:, :, 0] - lam * out[:, :, 1]
        return ((1 - self.lambda_init) * self.norm(out)).flatten(1, 2)


def validate_differential_pairs(model_args: Any, ranks: int) -> None:
    """Refuse, before any step runs, a split of the heads over ``ranks`` (tensor-parallel, times
    Ulysses) that leaves a rank part of a head pair: each rank needs whole pairs of KV heads."""
    pairs = model_args.n_kv_heads // 2
    if pairs % ranks:
        raise ValueError(
            f"differential attention needs whole head pairs on every rank: its {pairs} pairs of KV heads "
            f"(n_kv_heads={model_args.n_kv_heads}) cannot be split over {ranks} ranks (tensor x Ulysses "
            "parallel); choose a degree that divides n_kv_heads / 2."
        )
