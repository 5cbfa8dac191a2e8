"""Configuration of a mixture-of-experts layer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)


@dataclass
class MoEArgs:
    """Arguments of one MoE layer (router, routed experts, shared experts).

    Attributes:
        num_experts: routed experts per layer.
        num_shared_experts: always-active experts, each ``hidden_dim`` wide (DeepSeek
            style); ignored when ``shared_expert_intermediate_size`` is set.
        top_k: experts each token is routed to.
        shared_expert_intermediate_size: width of the single always-active shared
            expert (Qwen2-MoE style); 0 means none.
        use_shared_expert_gate: scale the shared expert's output by
            ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).
        score_func: ``"softmax"`` over all experts before top-k (Qwen, Mixtral) or
            ``"sigmoid"`` per expert (DeepSeek-V3).
        route_norm: renormalise the top-k scores to sum to one (HF ``norm_topk_prob``).
        route_scale: factor applied to the (possibly renormalised) top-k scores.
        score_before_experts: multiply expert inputs by their score instead of outputs.
        router_dtype: dtype of the router GEMM; ``None`` keeps the model dtype.
        num_expert_groups / num_limited_groups: node-limited routing (DeepSeek-V3):
            only the best ``num_limited_groups`` of ``num_expert_groups`` groups compete.
        use_grouped_mm: run experts with ``torch._grouped_mm`` where CUDA provides it;
            elsewhere a per-expert loop computes the same thing.
        load_balance_coeff: enables the auxiliary-loss-free load-balancing bias.
        _debug_force_load_balance: route round-robin (tests and debugging only).
    """

    num_experts: int = 8
    num_shared_experts: int = 0
    top_k: int = 1

    shared_expert_intermediate_size: int = 0
    use_shared_expert_gate: bool = False

    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_norm: bool = False
    route_scale: float = 1.0
    score_before_experts: bool = False
    router_dtype: torch.dtype | None = None

    num_expert_groups: int | None = None
    num_limited_groups: int | None = None

    use_grouped_mm: bool = True

    load_balance_coeff: float | None = None

    _debug_force_load_balance: bool = False

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"MoEArgs.num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEArgs.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"MoEArgs.score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> MoEArgs:
        """The routing fields every Qwen-style HF MoE config has, as AReaL 1.0.4 reads them.

        ``num_experts`` (else ``num_local_experts``, else 8), ``num_experts_per_tok``
        (else 1) and ``norm_topk_prob`` (else no renormalisation), with softmax scoring.
        Nothing else: shared experts, a router that always renormalises, sigmoid scoring
        are the family's to set on the result, inside its own package, because a package
        must behave the same when this name resolves to AReaL's ``MoEArgs``.
        """
        return cls(
            num_experts=getattr(hf_config, "num_experts", getattr(hf_config, "num_local_experts", 8)),
            top_k=getattr(hf_config, "num_experts_per_tok", 1),
            route_norm=getattr(hf_config, "norm_topk_prob", False),
            score_func="softmax",
        )


__all__ = ["MoEArgs"]
