"""Mixture-of-experts building blocks shared by every MoE model package."""

from archon_models.moe.args import MoEArgs
from archon_models.moe.grouped_experts import GroupedExperts
from archon_models.moe.moe import FeedForward, MoE
from archon_models.moe.router import TokenChoiceTopKRouter
from archon_models.moe.token_reorderer import TokenReorderer

__all__ = [
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "TokenChoiceTopKRouter",
    "TokenReorderer",
]
