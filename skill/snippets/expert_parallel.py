"""Expert-parallel styles for routed experts whose projections have biases.

AReaL's ``ExpertParallel``, ``TensorParallel`` and ``ExpertTensorParallel`` shard the
experts' ``w1``/``w2``/``w3``; the subclasses here shard the biases with them (a
package's ``apply_moe_ep_tp`` uses them when its experts are ``BiasedGroupedExperts``).
Token dispatch and combine are AReaL's. Under TP the down bias stays replicated: the
experts add each rank's share of it to their partial output (see
``BiasedGroupedExperts._local_parameters``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from archon_models.expert_parallel import ExpertParallel, ExpertTensorParallel, TensorParallel


def shard_expert_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, list[Placement]]) -> None:
    """Replace each of ``module``'s own parameters by a DTensor placed as ``placements`` says."""
    for name, param in list(module.named_parameters(recurse=False)):
        if name not in placements:
            raise ValueError(f"{type(module).__name__} has parameter {name!r}; placements name {sorted(placements)}")
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements[name])))


class BiasedExpertParallel(ExpertParallel):
    """EP over a 1D mesh: every expert weight and bias sharded on the expert dim 0."""

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        shard_expert_parameters(
            module,
            device_mesh,
            {p: [Shard(0)] for p in ("w1", "w2", "w3", "w1_bias", "w2_bias", "w3_bias")},
        )


class BiasedTensorParallel(TensorParallel):
    """TP within every expert: ``w1``/``w3`` and their biases by hidden rows, ``w2`` by
    input columns; the down bias replicated."""

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        shard_expert_parameters(
            module,
            device_mesh,
            {
                "w1": [Shard(1)],
                "w2": [Shard(2)],
                "w3": [Shard(1)],
                "w1_bias": [Shard(1)],
                "w2_bias": [Replicate()],
                "w3_bias": [Shard(1)],
            },
        )


class BiasedExpertTensorParallel(ExpertTensorParallel):
    """EP on dim 0 of an ``[ep, tp]`` mesh, TP within each expert as :class:`BiasedTensorParallel`."""

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        shard_expert_parameters(
            module,
            device_mesh,
            {
                "w1": [Shard(0), Shard(1)],
                "w2": [Shard(0), Shard(2)],
                "w3": [Shard(0), Shard(1)],
                "w1_bias": [Shard(0), Shard(1)],
                "w2_bias": [Shard(0), Replicate()],
                "w3_bias": [Shard(0), Shard(1)],
            },
        )
