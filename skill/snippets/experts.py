"""Conversions between Archon's routed-expert weights and checkpoints that fuse them.

Archon holds a layer's experts as ``w1`` (gate) and ``w3`` (up) ``[E, hidden, dim]`` and
``w2`` (down) ``[E, dim, hidden]``: slice ``e`` is expert ``e``'s ``nn.Linear`` weight
(out, in). Some checkpoints hold all experts of a projection in one 3D tensor, gate and
up stacked along the output axis: first all gate rows, then all up rows (``chunk(2)``),
or gate and up alternating (gate at even rows), or either with the up rows leading. The
adapter of such a family inserts the pair of functions for its order, renamed
``split_gate_up`` / ``merge_gate_up``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from archon_models.moe import FeedForward, GroupedExperts
from archon_models.moe.utils import indices_padding_wrapper


def split_concatenated_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2 * hidden, dim]`` -> gate, up ``[E, hidden, dim]``: the gate rows come first."""
    gate, up = fused.chunk(2, dim=1)
    return gate, up


def merge_concatenated_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up ``[E, hidden, dim]`` -> ``[E, 2 * hidden, dim]``, the gate rows first."""
    return torch.cat([gate, up], dim=1)


def split_interleaved_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2 * hidden, dim]`` -> gate, up ``[E, hidden, dim]``: gate at even rows, up at odd."""
    return fused[:, 0::2], fused[:, 1::2]


def merge_interleaved_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up ``[E, hidden, dim]`` -> ``[E, 2 * hidden, dim]`` with gate and up rows alternating."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def split_concatenated_up_first_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2 * hidden, dim]`` -> gate, up ``[E, hidden, dim]``: the up rows come first."""
    up, gate = fused.chunk(2, dim=1)
    return gate, up


def merge_concatenated_up_first_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up ``[E, hidden, dim]`` -> ``[E, 2 * hidden, dim]``, the up rows first."""
    return torch.cat([up, gate], dim=1)


def split_interleaved_up_first_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2 * hidden, dim]`` -> gate, up ``[E, hidden, dim]``: up at even rows, gate at odd."""
    return fused[:, 1::2], fused[:, 0::2]


def merge_interleaved_up_first_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up ``[E, hidden, dim]`` -> ``[E, 2 * hidden, dim]`` with up and gate rows alternating."""
    return torch.stack([up, gate], dim=2).flatten(1, 2)


# --- experts whose activation is not SwiGLU's SiLU --------------------------------------------


class ActivatedGroupedExperts(GroupedExperts):
    """Routed experts ``w2(act(w1(x)) * w3(x))`` with the family's activation (the edit writes
    it into :meth:`_activate`); weights, layout and sharding are ``GroupedExperts``'. The rows
    come grouped by expert: a loop over experts, or ``torch._grouped_mm`` on CUDA."""

    def _activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self._get_local_weights()
        # torch._grouped_mm has no CPU backward: CPU tensors take the loop even on a CUDA machine.
        if not (self.use_grouped_mm and x.is_cuda):
            return self._run_for_loop(w1, w2, w3, x, num_tokens_per_expert)
        if _expert_sharded(self.w1):
            return self._run_grouped_mm(w1, w2, w3, x, num_tokens_per_expert)
        return indices_padding_wrapper(self._run_grouped_mm)(w1, w2, w3, x, num_tokens_per_expert)

    def _run_for_loop(
        self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """One expert at a time over its contiguous group of rows; any device and dtype."""
        counts = [int(n) for n in num_tokens_per_expert.tolist()]
        if sum(counts) != x.shape[0]:
            raise ValueError(f"experts got {x.shape[0]} rows but num_tokens_per_expert sums to {sum(counts)}")
        outputs = []
        for expert, x_expert in enumerate(torch.split(x, counts, dim=0)):
            h = self._activate(x_expert @ w1[expert].t(), x_expert @ w3[expert].t())
            outputs.append(h @ w2[expert].t())
        return torch.cat(outputs, dim=0)

    def _run_grouped_mm(
        self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """All experts in three ``torch._grouped_mm`` calls (bf16 on CUDA, as AReaL computes)."""
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        compute_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        xc = x.to(compute_dtype)
        gate = torch._grouped_mm(xc, w1.to(compute_dtype).transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(xc, w3.to(compute_dtype).transpose(-2, -1), offs=offsets)
        h = self._activate(gate, up).to(compute_dtype)
        return torch._grouped_mm(h, w2.to(compute_dtype).transpose(-2, -1), offs=offsets).type_as(x)


# --- experts whose projections have biases, and their activations -----------------------------


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: the gate clamped from above at ``limit``, the up
    projection to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _expert_sharded(weight: torch.Tensor) -> bool:
    """True when expert parallelism sharded ``weight`` on the expert dimension."""
    return isinstance(weight, DTensor) and any(isinstance(p, Shard) and p.dim == 0 for p in weight.placements)


class BiasedGroupedExperts(GroupedExperts):
    """Routed experts whose gate, up and down projections all have biases.

    ``w1``/``w3`` ``[E, hidden, dim]`` with ``w1_bias``/``w3_bias`` ``[E, hidden]``, ``w2``
    ``[E, dim, hidden]`` with ``w2_bias`` ``[E, dim]``: slice ``e`` is expert ``e``'s
    ``nn.Linear``. Expert ``e`` computes ``w2_e(act(w1_e(x), w3_e(x)))``, ``act`` being
    :meth:`_activate`. The rows come grouped by expert, as for ``GroupedExperts``: a loop
    over experts, or ``torch._grouped_mm`` on CUDA with each row's bias gathered by its
    expert. Expert parallelism shards the biases with their weights on dim 0; under
    tensor parallelism (``w2`` split on its input dim, the output a partial sum over the
    TP ranks) each rank adds its share of the down bias, so the sum adds it once.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm)
        self.w1_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))
        self.w3_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))

    def _activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(gate) * up``."""
        return F.silu(gate) * up

    def _local_parameters(self) -> tuple[torch.Tensor, ...]:
        """``w1, w2, w3, w1_bias, w2_bias, w3_bias`` as the tensors this rank computes with."""
        params: tuple[torch.Tensor, ...] = (self.w1, self.w2, self.w3, self.w1_bias, self.w2_bias, self.w3_bias)
        if not all(isinstance(p, DTensor) for p in params):
            return params
        w1, w2, w3, b1, b2, b3 = (p for p in params if isinstance(p, DTensor))
        # Mesh dims that split w2 on its input dim leave the output a partial sum: each of
        # their n ranks adds b2 / n, and the gradient each gets is its share of the sum.
        split = [isinstance(p, Shard) and p.dim == 2 for p in w2.placements]
        share = math.prod(b2.device_mesh.size(i) for i, s in enumerate(split) if s)
        grads = tuple(Partial() if s else p for s, p in zip(split, b2.placements, strict=True))
        down_bias = b2.to_local(grad_placements=grads) / share
        return w1.to_local(), w2.to_local(), w3.to_local(), b1.to_local(), down_bias, b3.to_local()

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3, b1, b2, b3 = self._local_parameters()
        # torch._grouped_mm has no CPU backward: CPU tensors take the loop even on a CUDA machine.
        if not (self.use_grouped_mm and x.is_cuda):
            return self._run_for_loop(w1, w2, w3, b1, b2, b3, x, num_tokens_per_expert)

        def run(
            w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, counts: torch.Tensor
        ) -> torch.Tensor:
            return self._run_grouped_mm(w1, w2, w3, b1, b2, b3, x, counts)

        if _expert_sharded(self.w1):
            return run(w1, w2, w3, x, num_tokens_per_expert)
        return indices_padding_wrapper(run)(w1, w2, w3, x, num_tokens_per_expert)

    def _run_for_loop(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        b1: torch.Tensor,
        b2: torch.Tensor,
        b3: torch.Tensor,
        x: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        """One expert at a time over its contiguous group of rows; any device and dtype."""
        counts = [int(n) for n in num_tokens_per_expert.tolist()]
        if sum(counts) != x.shape[0]:
            raise ValueError(f"experts got {x.shape[0]} rows but num_tokens_per_expert sums to {sum(counts)}")
        outputs = []
        for expert, x_expert in enumerate(torch.split(x, counts, dim=0)):
            gate = x_expert @ w1[expert].t() + b1[expert]
            up = x_expert @ w3[expert].t() + b3[expert]
            outputs.append(self._activate(gate, up) @ w2[expert].t() + b2[expert])
        return torch.cat(outputs, dim=0)

    def _run_grouped_mm(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        b1: torch.Tensor,
        b2: torch.Tensor,
        b3: torch.Tensor,
        x: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        """All experts in three ``torch._grouped_mm`` calls (bf16 on CUDA, as AReaL computes);
        each row's biases are its expert's, repeated over the group's rows."""
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        compute_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        xc = x.to(compute_dtype)

        def row_bias(bias: torch.Tensor) -> torch.Tensor:
            return bias.to(compute_dtype).repeat_interleave(num_tokens_per_expert, dim=0, output_size=x.shape[0])

        gate = torch._grouped_mm(xc, w1.to(compute_dtype).transpose(-2, -1), offs=offsets) + row_bias(b1)
        up = torch._grouped_mm(xc, w3.to(compute_dtype).transpose(-2, -1), offs=offsets) + row_bias(b3)
        h = self._activate(gate, up).to(compute_dtype)
        out = torch._grouped_mm(h, w2.to(compute_dtype).transpose(-2, -1), offs=offsets) + row_bias(b2)
        return out.type_as(x)

    def init_weights(self, init_std: float = 0.02) -> None:
        super().init_weights(init_std)
        for bias in (self.w1_bias, self.w2_bias, self.w3_bias):
            nn.init.zeros_(bias)


class ClampedSwiGLUExperts(BiasedGroupedExperts):
    """Biased experts whose activation is the clamped SwiGLU (:func:`clamped_swiglu`) with
    the config's ``alpha`` and ``limit``."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, alpha: float, limit: float, use_grouped_mm: bool = True
    ):
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm)
        self.alpha = alpha
        self.limit = limit

    def _activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate, up, self.alpha, self.limit)


class ClampedSwiGLUGroupedExperts(ActivatedGroupedExperts):
    """Routed experts without biases whose activation is the clamped SwiGLU
    (:func:`clamped_swiglu`) with the config's ``alpha`` and ``limit``."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, alpha: float, limit: float, use_grouped_mm: bool = True
    ):
        super().__init__(dim, hidden_dim, num_experts, use_grouped_mm)
        self.alpha = alpha
        self.limit = limit

    def _activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate, up, self.alpha, self.limit)


class ClampedSwiGLUFeedForward(FeedForward):
    """The shared experts' MLP ``w2(clamped_swiglu(w1(x), w3(x)))`` with the config's
    ``alpha`` and ``limit``; weights and their names are ``FeedForward``'s."""

    def __init__(self, dim: int, hidden_dim: int, alpha: float, limit: float):
        super().__init__(dim, hidden_dim)
        self.alpha = alpha
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.alpha, self.limit))
