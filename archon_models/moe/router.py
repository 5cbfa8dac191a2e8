"""Token-choice top-k routing."""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn


class RouterGatingLinearFunction(torch.autograd.Function):
    """The router GEMM in ``router_dtype`` (usually fp32) for a bf16 model.

    Routing decisions are sensitive to rounding; doing the GEMM in fp32 while saving
    the bf16 operands keeps routing stable without holding fp32 copies.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, router_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.router_dtype = router_dtype
        return torch.mm(input.to(router_dtype), weight.to(router_dtype).t())

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        input, weight = ctx.saved_tensors
        grad = grad_output.to(ctx.router_dtype)
        grad_input = grad.mm(weight.to(ctx.router_dtype)).to(input.dtype)
        grad_weight = grad.t().mm(input.to(ctx.router_dtype)).to(weight.dtype)
        return grad_input, grad_weight, None


def router_gating_linear(input: torch.Tensor, weight: torch.Tensor, router_dtype: torch.dtype | None) -> torch.Tensor:
    """``input @ weight.T``, in ``router_dtype`` when given."""
    if router_dtype is None:
        return F.linear(input, weight)
    return cast(torch.Tensor, RouterGatingLinearFunction.apply(input, weight, router_dtype))


class RouterGateLinear(nn.Linear):
    """The router's gate: an ``nn.Linear`` (so TP plans and hooks see one) whose GEMM
    may run in a higher precision than the model."""

    def __init__(self, in_features: int, out_features: int, router_dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=False)
        self.router_dtype = router_dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return router_gating_linear(input, self.weight, self.router_dtype)


class TokenChoiceTopKRouter(nn.Module):
    """Each token picks its ``top_k`` experts from the gate's scores.

    Scores are ``softmax`` over all experts (top-k taken after the softmax, as HF's
    Qwen and Mixtral routers do) or an independent ``sigmoid`` per expert. With
    ``route_norm`` the chosen scores are renormalised to sum to one; ``route_scale``
    multiplies them afterwards. An optional ``expert_bias`` shifts which experts are
    chosen without changing the scores they are weighted by (aux-loss-free load
    balancing). With ``num_expert_groups`` only the best ``num_limited_groups``
    groups (scored by the sum of their two best experts) compete.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: Literal["softmax", "sigmoid"] = "sigmoid",
        route_norm: bool = False,
        route_scale: float = 1.0,
        router_dtype: torch.dtype | None = None,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        _debug_force_load_balance: bool = False,
    ):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if num_expert_groups is not None:
            if num_limited_groups is None:
                raise ValueError("num_limited_groups must be set when num_expert_groups is set")
            if num_experts % num_expert_groups != 0:
                raise ValueError(
                    f"num_experts ({num_experts}) must be divisible by num_expert_groups ({num_expert_groups})"
                )
            if num_experts // num_expert_groups < 2:
                raise ValueError(
                    f"node-limited routing needs >= 2 experts per group, got {num_experts // num_expert_groups}"
                )
        self.gate = RouterGateLinear(dim, num_experts, router_dtype=router_dtype)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.router_dtype = router_dtype
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self._debug_force_load_balance = _debug_force_load_balance

    def _limit_to_best_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """Mask (to -inf) the experts outside each token's best expert groups."""
        assert self.num_expert_groups is not None and self.num_limited_groups is not None
        grouped = scores_for_choice.view(-1, self.num_expert_groups, self.num_experts // self.num_expert_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(self.num_limited_groups, dim=-1, sorted=False).indices
        masked = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, best_groups, False)
        return grouped.masked_fill(masked.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[num_tokens, dim]``.

        Returns:
            top_scores ``[num_tokens, top_k]`` (fp32), selected expert indices
            ``[num_tokens, top_k]`` (int64), and tokens per expert ``[num_experts]`` (int64).
        """
        # Score in fp32 at least: softmax/sigmoid in bf16 destabilise routing.
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = F.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)

        scores_for_choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None:
            scores_for_choice = self._limit_to_best_groups(scores_for_choice)

        if self._debug_force_load_balance:
            n_tokens = scores.shape[0]
            selected = (
                torch.arange(n_tokens * self.top_k, device=scores.device, dtype=torch.int64).view(n_tokens, self.top_k)
                % self.num_experts
            )
        else:
            selected = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(dim=1, index=selected)

        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale

        return top_scores, selected, count_tokens_per_expert(selected, self.num_experts)

    def init_weights(self, init_std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)


def count_tokens_per_expert(selected_experts_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, as int64 (split sizes must be integers).

    ``histc`` on CPU takes floating input only; indices are exact in fp32 up to 2**24.
    """
    return torch.histc(
        selected_experts_indices.reshape(-1).to(torch.float32), bins=num_experts, min=0, max=num_experts
    ).to(torch.int64)


__all__ = ["TokenChoiceTopKRouter"]
