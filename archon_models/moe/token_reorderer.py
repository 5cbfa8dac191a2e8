"""Sort routed token slots by expert, the layout grouped expert compute needs."""

from __future__ import annotations

import torch
from torch import nn

from archon_models.moe.router import count_tokens_per_expert


class TokenReorderer(nn.Module):
    """Orders the ``num_tokens * top_k`` routing slots by expert.

    Stateless, and a module of its own so that expert parallelism with TP can shard
    it over the sequence (``ReordererSequenceParallel``).

    ``forward(top_scores, selected_experts_indices)`` returns the scores in expert
    order, the flat slot indices in expert order (slot ``i`` belongs to token
    ``i // top_k``), and the number of slots per expert (int64). The sort is stable,
    so within an expert tokens keep their order.
    """

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(
        self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat_indices = selected_experts_indices.reshape(-1)
        num_tokens_per_expert = count_tokens_per_expert(flat_indices, self.num_experts)
        token_indices_experts_sorted = torch.argsort(flat_indices, stable=True)
        top_scores_experts_sorted = top_scores.reshape(-1)[token_indices_experts_sorted]
        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


__all__ = ["TokenReorderer"]
