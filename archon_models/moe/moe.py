"""The MoE layer: router, reorderer, grouped experts and optional shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archon_models.moe.args import MoEArgs
from archon_models.moe.grouped_experts import GroupedExperts
from archon_models.moe.router import TokenChoiceTopKRouter
from archon_models.moe.token_reorderer import TokenReorderer


class FeedForward(nn.Module):
    """SwiGLU MLP ``w2(silu(w1(x)) * w3(x))``: a dense layer's MLP or a shared expert."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=init_std)


class MoE(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts.

    ``out = sum_k score_k * expert_k(x) [+ gate(x) * shared(x)]``, where the shared
    expert is always active and its optional gate is ``sigmoid(shared_expert_gate(x))``.

    Submodules (their names are the checkpoint and parallelism contract):
    ``router`` (``router.gate`` weight ``[num_experts, dim]``), ``reorderer``,
    ``experts`` (``w1``/``w2``/``w3`` 3D), ``shared_experts`` (:class:`FeedForward` or
    ``None``) and ``shared_expert_gate`` (``nn.Linear(dim, 1)`` or ``None``).
    Buffers: ``tokens_per_expert`` (routing counts accumulated for load balancing, not
    saved) and ``expert_bias`` (saved; only with ``load_balance_coeff``, else ``None``).

    Under expert parallelism, hooks on ``experts`` dispatch and combine the rows;
    under TP with ``ReordererSequenceParallel`` each rank reorders a slice of the
    tokens and fills its slots of the output, which is then partial over ranks.
    """

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__()
        self.moe_args = moe_args
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.num_experts = moe_args.num_experts
        self.top_k = moe_args.top_k
        self.score_before_experts = moe_args.score_before_experts
        self.load_balance_coeff = moe_args.load_balance_coeff

        self.router = TokenChoiceTopKRouter(
            dim=dim,
            num_experts=moe_args.num_experts,
            top_k=moe_args.top_k,
            score_func=moe_args.score_func,
            route_norm=moe_args.route_norm,
            route_scale=moe_args.route_scale,
            router_dtype=moe_args.router_dtype,
            num_expert_groups=moe_args.num_expert_groups,
            num_limited_groups=moe_args.num_limited_groups,
            _debug_force_load_balance=moe_args._debug_force_load_balance,
        )
        self.experts = GroupedExperts(
            dim=dim,
            hidden_dim=hidden_dim,
            num_experts=moe_args.num_experts,
            use_grouped_mm=moe_args.use_grouped_mm,
        )
        self.reorderer = TokenReorderer(num_experts=moe_args.num_experts, top_k=moe_args.top_k)

        self.shared_experts: FeedForward | None
        if moe_args.shared_expert_intermediate_size > 0:
            self.shared_experts = FeedForward(dim, moe_args.shared_expert_intermediate_size)
        elif moe_args.num_shared_experts > 0:
            self.shared_experts = FeedForward(dim, hidden_dim * moe_args.num_shared_experts)
        else:
            self.shared_experts = None

        self.shared_expert_gate: nn.Linear | None
        if moe_args.use_shared_expert_gate and self.shared_experts is not None:
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        else:
            self.shared_expert_gate = None

        self.expert_bias: torch.Tensor | None
        self.tokens_per_expert: torch.Tensor
        self.init_buffers(None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[bs, slen, dim]`` -> ``[bs, slen, dim]``."""
        bs, slen, dim = x.shape
        x_flat = x.view(-1, dim)

        top_scores, selected_indices, num_tokens_per_expert = self.router(x_flat, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert.to(self.tokens_per_expert.dtype))

        # The reorderer recounts: under TP with ReordererSequenceParallel it sees only
        # this rank's slice of the tokens, while the router's counts above are global.
        scores_sorted, slot_indices_sorted, num_per_expert = self.reorderer(top_scores, selected_indices)
        routed_input = x_flat[slot_indices_sorted // self.top_k]
        if self.score_before_experts:
            routed_input = (routed_input.float() * scores_sorted.unsqueeze(-1)).to(x.dtype)

        routed_output = self.experts(routed_input, num_per_expert)

        shared_out = None
        if self.shared_experts is not None:
            shared_out = self.shared_experts(x_flat)
            if self.shared_expert_gate is not None:
                shared_out = torch.sigmoid(self.shared_expert_gate(x_flat)) * shared_out

        # Slots this rank did not compute (other TP ranks' slice) stay zero.
        per_slot = routed_output.new_zeros(bs * slen * self.top_k, dim)
        per_slot = per_slot.index_copy(0, slot_indices_sorted, routed_output).view(bs * slen, self.top_k, dim)
        if self.score_before_experts:
            out = per_slot.sum(dim=1)
        else:
            out = torch.bmm(top_scores.unsqueeze(1).float(), per_slot.float()).squeeze(1).to(x.dtype)

        if shared_out is not None:
            out = shared_out + out
        return out.view(bs, slen, dim)

    def init_weights(self, init_std: float = 0.02) -> None:
        self.experts.init_weights(init_std)
        self.router.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        if self.shared_expert_gate is not None:
            nn.init.trunc_normal_(self.shared_expert_gate.weight, mean=0.0, std=init_std)

    def init_buffers(self, buffer_device: torch.device | str | None) -> None:
        """(Re)create the load-balancing buffers, e.g. after building on the meta device."""
        if self.load_balance_coeff is not None and self.load_balance_coeff <= 0.0:
            raise ValueError(f"load_balance_coeff must be > 0 or None, got {self.load_balance_coeff}")
        device = buffer_device if buffer_device is not None else self.router.gate.weight.device
        self.register_buffer(
            "tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32, device=device), persistent=False
        )
        if self.load_balance_coeff is not None:
            self.register_buffer(
                "expert_bias", torch.zeros(self.num_experts, dtype=torch.float32, device=device), persistent=True
            )
        else:
            self.expert_bias = None


__all__ = ["FeedForward", "MoE"]
