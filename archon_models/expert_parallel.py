"""Parallel styles for the routed experts of an MoE layer (``GroupedExperts``).

- :class:`ExpertParallel`: experts sharded on dim 0 over an EP mesh; tokens travel
  to the rank holding their expert with ``all_to_all_single`` and come back the same
  way. gloo implements ``all_to_all_single`` with uneven splits on CPU (checked with
  torch 2.13), so the same code runs on CPU for tests and on NCCL for training.
- :class:`TensorParallel`: every rank holds all experts, each split column-/row-wise
  over a TP mesh; tokens are replicated, the output is a partial sum over TP ranks.
- :class:`ExpertTensorParallel`: both, on an ``[ep, tp]`` mesh.
- :class:`ReordererSequenceParallel`: when EP borrows the TP ranks (``etp == 1``),
  each TP rank reorders and dispatches only its slice of the tokens.

Under TP and ETP the experts' output is left *partial* over the TP ranks: the MoE
block's output hook (``PrepareModuleInputOutput(output_layouts=Partial())`` in the
model's ``parallelize``) reduces it together with the shared experts.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from archon_models.moe.utils import TOKEN_GROUP_ALIGN_SIZE_M, _permute, _unpermute

logger = logging.getLogger(__name__)


def _declare_grad_partial(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; in backward, all-reduce ``x``'s gradient over ``mesh``.

    Each TP rank computes with its shard of the expert weights, so the gradient
    reaching a replicated input is only that rank's share of the sum.
    """
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def _shard_expert_weights(module: nn.Module, mesh: DeviceMesh, placements: dict[str, list]) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        if name not in placements:
            raise ValueError(
                f"{type(module).__name__} has parameter {name!r}; expert parallel styles shard "
                f"only {sorted(placements)} (GroupedExperts)"
            )
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements[name])))


class BaseExpertParallel(ParallelStyle, ABC):
    """A parallel style that moves routed tokens to their experts and back."""

    @abstractmethod
    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        """Shard the expert weights."""

    @abstractmethod
    def _token_dispatch(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], device_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows grouped by global expert, counts per global expert)`` -> this rank's rows and counts."""

    @abstractmethod
    def _token_combine(self, module: nn.Module, output: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        """This rank's expert outputs -> outputs for the rows this rank dispatched."""


class ExpertParallel(BaseExpertParallel):
    """Experts sharded on dim 0 over a 1D EP mesh (``num_experts % ep == 0``).

    Dispatch: exchange the per-expert counts (``all_to_all_single``), send each
    rank the rows of its experts (``all_to_all_single_autograd``), then regroup the
    received rank-major rows expert-major (padded for grouped GEMM when the module
    uses it). Combine reverses both steps. The splits of one forward are kept on the
    style object for its combine and backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.input_splits: list[int] | None = None
        self.output_splits: list[int] | None = None
        self.input_shape: torch.Size | None = None
        self.permuted_indices: torch.Tensor | None = None

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _shard_expert_weights(module, device_mesh, {w: [Shard(0)] for w in ("w1", "w2", "w3")})

    def _token_dispatch(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], device_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        routed_input, num_tokens_per_expert = inputs
        group = device_mesh.get_group()
        ep_degree = device_mesh.size()
        num_experts = num_tokens_per_expert.shape[0]
        if num_experts % ep_degree != 0:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the EP degree ({ep_degree})")
        num_local_experts = num_experts // ep_degree

        with torch.no_grad():
            received_counts = all_to_all_single(num_tokens_per_expert, None, None, group=group)
            received_counts = torch.ops._c10d_functional.wait_tensor(received_counts)
            self.input_splits = num_tokens_per_expert.view(ep_degree, num_local_experts).sum(1).tolist()
            self.output_splits = received_counts.view(ep_degree, num_local_experts).sum(1).tolist()

        routed_input = all_to_all_single_autograd(routed_input, self.output_splits, self.input_splits, group)

        grouped_mm = getattr(module, "use_grouped_mm", False) and routed_input.is_cuda
        alignment = TOKEN_GROUP_ALIGN_SIZE_M if grouped_mm else 1
        self.input_shape, routed_input, self.permuted_indices, local_counts = _permute(
            routed_input, received_counts, ep_degree, num_local_experts, alignment
        )
        return routed_input, local_counts

    def _token_combine(self, module: nn.Module, output: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        assert self.input_shape is not None and self.permuted_indices is not None, "combine before dispatch"
        output = _unpermute(output, self.input_shape, self.permuted_indices)
        return all_to_all_single_autograd(output, self.input_splits, self.output_splits, device_mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition_fn,
            input_fn=self._token_dispatch,
            output_fn=self._token_combine,
        )


class TensorParallel(ParallelStyle):
    """Experts split over a 1D TP mesh: ``w1``/``w3`` by output rows (``Shard(1)``),
    ``w2`` by input columns (``Shard(2)``).

    Input rows are replicated over the TP ranks; their gradient is all-reduced in
    backward. The output is each rank's partial sum (see the module docstring).
    """

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _shard_expert_weights(module, device_mesh, {"w1": [Shard(1)], "w2": [Shard(2)], "w3": [Shard(1)]})

    def _prepare_input_fn(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], device_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        routed_input, num_tokens_per_expert = inputs
        return _declare_grad_partial(routed_input, device_mesh), num_tokens_per_expert

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn, input_fn=self._prepare_input_fn)


class ExpertTensorParallel(ExpertParallel):
    """EP on dim 0 of a 2D ``[ep, tp]`` mesh, TP within each expert on dim 1.

    Tokens are dispatched over the EP dimension only (TP ranks of one EP rank hold
    the same tokens); the output stays partial over TP.
    """

    @staticmethod
    def _sub_meshes(device_mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        names = device_mesh.mesh_dim_names
        if device_mesh.ndim != 2 or names is None:
            raise ValueError(f"ExpertTensorParallel needs a 2D mesh with named dims [ep, tp], got {device_mesh}")
        return device_mesh[names[0]], device_mesh[names[1]]

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _shard_expert_weights(
            module,
            device_mesh,
            {"w1": [Shard(0), Shard(1)], "w2": [Shard(0), Shard(2)], "w3": [Shard(0), Shard(1)]},
        )

    def _token_dispatch(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], device_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ep_mesh, tp_mesh = self._sub_meshes(device_mesh)
        routed_input, counts = super()._token_dispatch(module, inputs, ep_mesh)
        return _declare_grad_partial(routed_input, tp_mesh), counts

    def _token_combine(self, module: nn.Module, output: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        ep_mesh, _ = self._sub_meshes(device_mesh)
        return super()._token_combine(module, output, ep_mesh)


class ReordererSequenceParallel(ParallelStyle):
    """Each TP rank reorders only its contiguous slice of the tokens (EP with ``etp == 1``).

    Applied to ``MoE.reorderer``: the input hook keeps this rank's rows of
    ``(top_scores, selected_experts_indices)``; the output hook shifts the returned slot
    indices to global slots (``rank * (num_tokens // tp) * top_k``), so the MoE block
    gathers and scatters the right tokens and its output is partial over TP ranks.
    ``num_tokens`` must be divisible by the TP degree.
    """

    def __init__(self) -> None:
        super().__init__()
        self.num_tokens: int | None = None

    def _prepare_input_fn(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], device_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        top_scores, selected_experts_indices = inputs
        tp_degree, rank = device_mesh.size(), device_mesh.get_local_rank()
        self.num_tokens = top_scores.shape[0]
        if self.num_tokens % tp_degree != 0:
            raise ValueError(
                f"{self.num_tokens} tokens cannot be split over {tp_degree} TP ranks for expert "
                "parallelism; pad the packed batch to a multiple of the TP degree"
            )
        return top_scores.chunk(tp_degree, dim=0)[rank], selected_experts_indices.chunk(tp_degree, dim=0)[rank]

    def _prepare_output_fn(
        self, module: nn.Module, outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], device_mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.num_tokens is not None
        top_scores_sorted, slot_indices_sorted, num_tokens_per_expert = outputs
        offset = device_mesh.get_local_rank() * (self.num_tokens // device_mesh.size()) * module.top_k
        return top_scores_sorted, slot_indices_sorted + offset, num_tokens_per_expert

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, partition_fn=None, input_fn=self._prepare_input_fn, output_fn=self._prepare_output_fn
        )


def apply_expert_parallel(experts_module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard ``experts_module`` (a ``GroupedExperts``) over the 1D ``ep_mesh`` and hook
    token dispatch/combine into its forward."""
    ExpertParallel()._apply(experts_module, ep_mesh)


__all__ = [
    "ExpertParallel",
    "ExpertTensorParallel",
    "ReordererSequenceParallel",
    "TensorParallel",
    "apply_expert_parallel",
]
