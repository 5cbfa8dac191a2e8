"""Routed experts held as 3D weights, one slice per expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from archon_models.moe.utils import indices_padding_wrapper


def _run_experts_for_loop(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """SwiGLU per expert over contiguous groups of rows; runs on every device and dtype.

    Args:
        w1, w3: ``[E, hidden, dim]``; w2: ``[E, dim, hidden]``.
        x: ``[sum(num_tokens_per_expert), dim]``, rows grouped by expert in expert order.
        num_tokens_per_expert: ``[E]`` integer row counts.
    """
    counts = [int(n) for n in num_tokens_per_expert.tolist()]
    if sum(counts) != x.shape[0]:
        raise ValueError(f"experts got {x.shape[0]} rows but num_tokens_per_expert sums to {sum(counts)}")
    outputs = []
    for expert, x_expert in enumerate(torch.split(x, counts, dim=0)):
        h = F.silu(x_expert @ w1[expert].t()) * (x_expert @ w3[expert].t())
        outputs.append(h @ w2[expert].t())
    return torch.cat(outputs, dim=0)


def _run_experts_grouped_mm(
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """SwiGLU for all experts in three ``torch._grouped_mm`` calls.

    Groups must already be aligned (see ``indices_padding_wrapper``). On CUDA the
    grouped GEMM kernels take bf16, so the compute runs in bf16 there, as AReaL does;
    elsewhere it keeps the input dtype (used by tests of the padding logic).
    """
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    compute_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    xc = x.to(compute_dtype)
    h = F.silu(torch._grouped_mm(xc, w1.to(compute_dtype).transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(xc, w3.to(compute_dtype).transpose(-2, -1), offs=offsets)
    out = torch._grouped_mm(h, w2.to(compute_dtype).transpose(-2, -1), offs=offsets)
    return out.type_as(x)


def _grouped_mm_available() -> bool:
    """``torch._grouped_mm`` has a CUDA backward; on CPU only the forward exists."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.is_available()


def _is_expert_sharded(weight: torch.Tensor) -> bool:
    """True when expert parallelism sharded this weight on the expert dimension."""
    return isinstance(weight, DTensor) and any(isinstance(p, Shard) and p.dim == 0 for p in weight.placements)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as 3D weights.

    ``w1`` (gate) and ``w3`` (up) are ``[num_experts, hidden_dim, dim]``, ``w2`` (down)
    is ``[num_experts, dim, hidden_dim]``: slice ``e`` is expert ``e``'s
    ``nn.Linear`` weight (out, in), which is also how checkpoints store it per expert.

    ``forward(x, num_tokens_per_expert)`` takes rows grouped by expert. With
    ``use_grouped_mm`` on CUDA it pads groups and calls ``torch._grouped_mm``; otherwise
    it loops over experts. Under expert parallelism the weights are DTensors sharded on
    dim 0 and the dispatch hook has already grouped and aligned the rows.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm and _grouped_mm_available()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def _get_local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights as plain tensors: under EP/TP each rank computes on its shard."""
        if isinstance(self.w1, DTensor):
            return self.w1.to_local(), self.w2.to_local(), self.w3.to_local()
        return self.w1, self.w2, self.w3

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self._get_local_weights()
        # torch._grouped_mm has no CPU backward: CPU tensors take the loop even on a CUDA machine.
        if not (self.use_grouped_mm and x.is_cuda):
            return _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert)
        if _is_expert_sharded(self.w1):
            return _run_experts_grouped_mm(w1, w2, w3, x, num_tokens_per_expert)
        return indices_padding_wrapper(_run_experts_grouped_mm)(w1, w2, w3, x, num_tokens_per_expert)

    def init_weights(self, init_std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


__all__ = ["GroupedExperts"]
