"""Routers a family may need instead of the shared top-k router (softmax or sigmoid scores)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon_models.moe import TokenChoiceTopKRouter


class SparseMixerRouter(TokenChoiceTopKRouter):
    """Sparse-mixer routing: the best expert, then the best of the others, two per token.

    Each pick is the highest gate logit still in play; its weight is its softmax
    probability among the experts whose logit trails the pick's by at most
    ``2 * jitter_eps`` relative to ``max(|logit|, pick)`` (the rest are masked out). The
    second pick leaves the first out. Selection is deterministic and the weights get the
    softmax's own gradient: HF's evaluation-mode routing. (HF's training mode samples
    each pick with Gumbel noise and replaces the gradient by a Heun third-order estimate;
    this router does neither.)
    """

    def __init__(
        self, dim: int, num_experts: int, top_k: int, jitter_eps: float, router_dtype: torch.dtype | None = None
    ):
        if top_k != 2:
            raise ValueError(f"sparse-mixer routing picks exactly 2 experts per token, got top_k={top_k}")
        super().__init__(dim, num_experts, top_k, score_func="softmax", router_dtype=router_dtype)
        self.jitter_eps = jitter_eps

    def _masked_outside_margin(self, scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The best of ``candidates`` per token, and ``candidates`` with every logit that
        trails it by more than the relative margin set to -inf."""
        with torch.no_grad():
            best, _ = candidates.max(dim=-1, keepdim=True)
            factor = scores.abs().clamp(min=best)
            outside = ((best - scores) / factor) > (2 * self.jitter_eps)
        return candidates.masked_fill(outside, float("-inf"))

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[num_tokens, dim]``: weights ``[num_tokens, 2]`` (fp32), expert
        indices ``[num_tokens, 2]`` and tokens per expert ``[num_experts]``."""
        if expert_bias is not None:
            raise ValueError("sparse-mixer routing has no load-balancing bias (load_balance_coeff must be None)")
        logits = self.gate(x)
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32))

        first = scores.argmax(dim=-1, keepdim=True)
        first_weight = torch.softmax(self._masked_outside_margin(scores, scores), dim=-1).gather(-1, first)

        others = scores.scatter(-1, first, float("-inf"))
        second = others.argmax(dim=-1, keepdim=True)
        second_weight = torch.softmax(self._masked_outside_margin(scores, others), dim=-1).gather(-1, second)

        selected = torch.cat([first, second], dim=-1)
        top_scores = torch.cat([first_weight, second_weight], dim=-1)
        # histc counts floats only on CPU; indices are exact in fp32 up to 2**24.
        counts = torch.histc(selected.reshape(-1).to(torch.float32), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts.to(torch.int64)


class BiasedRouterGate(nn.Linear):
    """A router gate with a bias: ``x @ weight.T + bias``, computed in ``router_dtype`` when
    given (the bias joins the logits before any top-k or softmax)."""

    def __init__(self, in_features: int, out_features: int, router_dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=True)
        self.router_dtype = router_dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.router_dtype is None:
            return F.linear(input, self.weight, self.bias)
        dtype = self.router_dtype
        return F.linear(input.to(dtype), self.weight.to(dtype), self.bias.to(dtype))


class MaxGroupTopKRouter(TokenChoiceTopKRouter):
    """Group-limited top-k whose groups are scored by their best expert.

    With ``num_expert_groups`` the experts fall into that many equal groups; each token
    keeps the ``num_limited_groups`` groups whose best expert scores highest and takes its
    top-k among their experts only (DeepSeek-V2's ``group_limited_greedy``; AReaL's router
    scores a group by the sum of its two best experts instead). Scores, renormalisation and
    scale are the shared router's: softmax or sigmoid over every expert, ``route_norm``,
    ``route_scale``. Without groups it is the shared router's plain top-k.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        route_norm: bool = False,
        route_scale: float = 1.0,
        router_dtype: torch.dtype | None = None,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
    ):
        super().__init__(
            dim,
            num_experts,
            top_k,
            score_func=score_func,  # type: ignore[arg-type]
            route_norm=route_norm,
            route_scale=route_scale,
            router_dtype=router_dtype,
        )
        if num_expert_groups is not None:
            if num_limited_groups is None or num_experts % num_expert_groups != 0:
                raise ValueError(
                    f"{num_experts} experts need num_expert_groups dividing them and num_limited_groups, got "
                    f"{num_expert_groups} and {num_limited_groups}"
                )
            if top_k > num_limited_groups * (num_experts // num_expert_groups):
                # HF would pick masked experts at weight 0; -inf scores here would not match.
                raise ValueError(f"top_k={top_k} exceeds the experts of the {num_limited_groups} kept groups")
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[num_tokens, dim]``: weights ``[num_tokens, top_k]`` (fp32), expert
        indices ``[num_tokens, top_k]`` and tokens per expert ``[num_experts]``."""
        logits = self.gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = F.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        for_choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups is not None and self.num_limited_groups is not None:
            grouped = for_choice.view(-1, self.num_expert_groups, self.num_experts // self.num_expert_groups)
            best = grouped.amax(dim=-1).topk(self.num_limited_groups, dim=-1, sorted=False).indices
            dropped = torch.ones(best.shape[0], self.num_expert_groups, dtype=torch.bool, device=best.device)
            dropped = dropped.scatter(1, best, False)
            for_choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)
        selected = torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False).indices
        top_scores = scores.gather(dim=1, index=selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        # histc counts floats only on CPU; indices are exact in fp32 up to 2**24.
        counts = torch.histc(selected.reshape(-1).to(torch.float32), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts.to(torch.int64)


class LogitBiasRouter(TokenChoiceTopKRouter):
    """Top-k routing whose selection bias joins the gate logits before the score function.

    The experts are the top-k of ``logits + expert_bias``; their weights are the scores
    (softmax or sigmoid) of the logits alone, renormalised and scaled as configured.
    (AReaL's router adds ``expert_bias`` to the scores instead, which picks other experts.)
    """

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x`` ``[num_tokens, dim]``: weights ``[num_tokens, top_k]`` (fp32), expert
        indices ``[num_tokens, top_k]`` and tokens per expert ``[num_experts]``."""
        if self.num_expert_groups is not None:
            raise ValueError("a selection bias on the logits is implemented for plain top-k only (no expert groups)")
        logits = self.gate(x).to(torch.float32)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        elif self.score_func == "softmax":
            scores = F.softmax(logits, dim=1)
        else:
            raise NotImplementedError(f"Unknown score function: {self.score_func}")
        logits_for_choice = logits if expert_bias is None else logits + expert_bias
        _, selected = torch.topk(logits_for_choice, k=self.top_k, dim=-1, sorted=False)
        top_scores = scores.gather(dim=1, index=selected)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        # histc counts floats only on CPU; indices are exact in fp32 up to 2**24.
        counts = torch.histc(selected.reshape(-1).to(torch.float32), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts.to(torch.int64)
