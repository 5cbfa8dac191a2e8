"""Conversion between Archon's 3D expert weights and checkpoints' per-expert 2D keys.

Archon holds a layer's routed experts as three 3D tensors (``w1``/``w3``
``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``); HF checkpoints hold one 2D tensor
per expert and projection, e.g. ``model.layers.0.mlp.experts.5.gate_proj.weight``
(Qwen) or ``model.layers.0.block_sparse_moe.experts.5.w1.weight`` (Mixtral). Slice
``e`` of the 3D tensor *is* expert ``e``'s 2D weight, so conversion only renames,
splits and stacks.

:class:`MoEWeightConverter` keeps AReaL's methods (``split_expert_weights_*``,
``concatenate_expert_weights_*``, the DTensor index helpers), and adds a
template-driven whole-state-dict API for adapters: construct it with the family's
key templates and call :meth:`MoEWeightConverter.split_to_hf` per Archon key and
:meth:`MoEWeightConverter.merge_from_hf` once per HF state dict.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

logger = logging.getLogger(__name__)

_MAX_KEYS_IN_ERROR = 8


@dataclass
class MoEConversionState:
    """What ``to_hf`` of sharded (DTensor) experts records for the matching ``from_hf``.

    Keyed by the concrete Archon key (``layers.3.moe.experts.w1``): the 3D weight's
    placements, its global shape and the ``[start, end)`` experts this rank holds.
    """

    grouped_expert_weight_placements: dict[str, tuple] = field(default_factory=dict)
    grouped_expert_weight_shape: dict[str, tuple[int, ...]] = field(default_factory=dict)
    local_experts_indices: dict[str, tuple[int, int]] = field(default_factory=dict)

    def clear(self) -> None:
        self.grouped_expert_weight_placements.clear()
        self.grouped_expert_weight_shape.clear()
        self.local_experts_indices.clear()


def _template_regex(template: str, placeholders: int, what: str) -> re.Pattern[str]:
    """A regex capturing each ``{}`` of a key template as digits."""
    if template.count("{}") != placeholders:
        raise ValueError(f"{what} template {template!r} must contain exactly {placeholders} '{{}}' placeholder(s)")
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)") + r"\Z")


class MoEWeightConverter:
    """Splits 3D expert weights into per-expert 2D checkpoint keys and stacks them back.

    Args:
        expert_key_map: Archon template (one ``{}`` for the layer) -> HF template
            (``{}`` for the layer, then ``{}`` for the expert), e.g.
            ``{"layers.{}.moe.experts.w1": "model.layers.{}.mlp.experts.{}.gate_proj.weight"}``.
            Needed only by :meth:`split_to_hf` and :meth:`merge_from_hf`.
        num_experts: experts per layer; every one must be present in ``merge_from_hf``.
    """

    def __init__(self, expert_key_map: Mapping[str, str] | None = None, num_experts: int | None = None):
        self.expert_key_map = dict(expert_key_map or {})
        self.num_experts = num_experts
        self.state = MoEConversionState()
        self._archon_patterns = [(_template_regex(a, 1, "Archon expert"), a, h) for a, h in self.expert_key_map.items()]
        self._hf_patterns = [(_template_regex(h, 2, "HF expert"), a, h) for a, h in self.expert_key_map.items()]

    # ------------------------------------------------------------------ template API

    def split_to_hf(
        self, archon_key: str, weight: torch.Tensor, state: MoEConversionState | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Per-expert HF entries for one Archon 3D expert weight, or ``None`` when
        ``archon_key`` is not an expert key.

        Plain tensors become views (``unbind``); DTensors sharded over experts yield this
        rank's experts as DTensors and record what :meth:`merge_from_hf` needs in ``state``
        (default: the converter's own).
        """
        for pattern, archon_template, hf_template in self._archon_patterns:
            match = pattern.match(archon_key)
            if match is None:
                continue
            layer_id = match.group(1)
            if isinstance(weight, DTensor):
                return self.split_expert_weights_dtensor(
                    hf_template, archon_template, layer_id, weight, state or self.state
                )
            if weight.dim() != 3:
                raise ValueError(f"{archon_key}: expected a 3D expert weight, got shape {tuple(weight.shape)}")
            if self.num_experts is not None and weight.shape[0] != self.num_experts:
                raise ValueError(f"{archon_key}: holds {weight.shape[0]} experts, the model has {self.num_experts}")
            return {
                hf_template.format(layer_id, expert_id): expert_weight
                for expert_id, expert_weight in enumerate(torch.unbind(weight, dim=0))
            }
        return None

    def merge_from_hf(
        self, hf_state_dict: Mapping[str, Any], state: MoEConversionState | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Stack every per-expert HF key into Archon 3D weights.

        Returns ``(expert_weights, rest)``: the Archon expert entries and every HF entry
        that is not an expert key. Raises ``KeyError`` naming the missing HF keys when a
        layer lacks an expert (for DTensors: one of this rank's experts) or a projection,
        and ``ValueError`` for an expert index out of range or mismatched shapes.
        """
        if self.num_experts is None:
            raise ValueError("MoEWeightConverter.merge_from_hf needs num_experts (pass it to the constructor)")
        state = state or self.state
        collected: dict[str, dict[str, dict[int, Any]]] = {}
        rest: dict[str, Any] = {}
        for key, value in hf_state_dict.items():
            parsed = self._parse_hf_expert_key(key)
            if parsed is None:
                rest[key] = value
                continue
            layer_id, expert_id, archon_template = parsed
            if expert_id >= self.num_experts:
                raise ValueError(f"{key}: expert {expert_id} is out of range for {self.num_experts} experts")
            collected.setdefault(layer_id, {}).setdefault(archon_template, {})[expert_id] = value

        missing: list[str] = []
        merged: dict[str, torch.Tensor] = {}
        for layer_id in sorted(collected, key=int):
            for archon_template, hf_template in self.expert_key_map.items():
                experts = collected[layer_id].get(archon_template, {})
                expected = self._expected_expert_ids(archon_template.format(layer_id), experts, state)
                absent = [e for e in expected if e not in experts]
                if absent:
                    missing.extend(hf_template.format(layer_id, e) for e in absent)
                    continue
                merged[archon_template.format(layer_id)] = self._stack(
                    experts, archon_template, hf_template, layer_id, state
                )
        if missing:
            shown = ", ".join(missing[:_MAX_KEYS_IN_ERROR])
            more = f" and {len(missing) - _MAX_KEYS_IN_ERROR} more" if len(missing) > _MAX_KEYS_IN_ERROR else ""
            raise KeyError(
                f"checkpoint lacks {len(missing)} expert weight(s): {shown}{more}; every layer needs all "
                f"{self.num_experts} experts for each of {sorted(self.expert_key_map.values())}"
            )
        return merged, rest

    def _parse_hf_expert_key(self, hf_key: str) -> tuple[str, int, str] | None:
        for pattern, archon_template, _ in self._hf_patterns:
            match = pattern.match(hf_key)
            if match is not None:
                return match.group(1), int(match.group(2)), archon_template
        return None

    def _expected_expert_ids(self, archon_key: str, experts: Mapping[int, Any], state: MoEConversionState) -> range:
        if any(isinstance(v, DTensor) for v in experts.values()):
            if archon_key not in state.local_experts_indices:
                raise KeyError(
                    f"no sharding recorded for {archon_key}: call to_hf/split_to_hf on the sharded "
                    "model with the same MoEConversionState before from_hf"
                )
            start, end = state.local_experts_indices[archon_key]
            return range(start, end)
        assert self.num_experts is not None
        return range(self.num_experts)

    def _stack(
        self,
        experts: dict[int, Any],
        archon_template: str,
        hf_template: str,
        layer_id: str,
        state: MoEConversionState,
    ) -> torch.Tensor:
        shapes = {tuple(v.shape) for v in experts.values()}
        if len(shapes) != 1:
            detail = ", ".join(
                f"{hf_template.format(layer_id, e)}: {tuple(v.shape)}" for e, v in sorted(experts.items())
            )
            raise ValueError(f"experts of {archon_template.format(layer_id)} differ in shape: {detail}")
        first = next(iter(experts.values()))
        if isinstance(first, DTensor):
            by_layer = {layer_id: {archon_template: dict(experts)}}
            stacked = self.concatenate_expert_weights_dtensor(
                by_layer, archon_template, layer_id, first.device_mesh, state
            )
            assert stacked is not None
            return stacked
        return torch.stack([experts[e] for e in sorted(experts)], dim=0)

    # ------------------------------------------------------------------ AReaL API

    @staticmethod
    def calculate_strided_shard_indices(
        strided_shard_dim_degree: int,
        strided_shard_dim_rank: int,
        shard_dim_degree: int,
        shard_dim_rank: int,
        dim_size_to_split: int,
    ) -> tuple[int, int]:
        """``[start, end)`` of this rank's block for ``[_StridedShard(d), Shard(d)]``.

        The inner (``Shard``) mesh dimension splits the tensor into contiguous halves
        first; the outer (strided) dimension then splits each of those.
        """
        num_blocks = strided_shard_dim_degree * shard_dim_degree
        if dim_size_to_split % num_blocks != 0:
            raise ValueError(
                f"cannot split a dim of size {dim_size_to_split} evenly over strided degree "
                f"{strided_shard_dim_degree} x shard degree {shard_dim_degree}"
            )
        block = dim_size_to_split // num_blocks
        start = block * (strided_shard_dim_degree * shard_dim_rank + strided_shard_dim_rank)
        return start, start + block

    @staticmethod
    def calculate_indices_from_placements(
        dim: int, dim_size: int, dtensor_placements: tuple, device_mesh: DeviceMesh
    ) -> tuple[int | None, int | None]:
        """This rank's ``[start, end)`` along ``dim`` of a DTensor, or ``(None, None)``
        when no mesh dimension shards ``dim``."""
        names = device_mesh.mesh_dim_names
        if names is None:
            raise ValueError("expert weights must live on a device mesh with named dimensions")
        sharding: list[tuple[str, Any]] = []
        for name, placement in zip(names, dtensor_placements, strict=True):
            if isinstance(placement, (Shard, _StridedShard)):
                if placement.dim == dim:
                    sharding.append((name, placement))
            elif not isinstance(placement, Replicate):
                raise ValueError(
                    f"unexpected placement {type(placement).__name__} on mesh dim {name!r}: expert "
                    "weights are Shard, _StridedShard or Replicate"
                )
        if not sharding:
            return None, None
        if len(sharding) == 1:
            name, placement = sharding[0]
            if isinstance(placement, _StridedShard):
                raise ValueError(f"a lone _StridedShard on mesh dim {name!r} is not an expert layout")
            mesh = device_mesh[name]
            degree, rank = mesh.size(), mesh.get_local_rank()
            if dim_size % degree != 0:
                raise ValueError(f"dim {dim} of size {dim_size} cannot be split evenly over {degree} ranks")
            block = dim_size // degree
            return block * rank, block * (rank + 1)
        if len(sharding) == 2 and isinstance(sharding[0][1], _StridedShard):
            strided, inner = device_mesh[sharding[0][0]], device_mesh[sharding[1][0]]
            return MoEWeightConverter.calculate_strided_shard_indices(
                strided.size(), strided.get_local_rank(), inner.size(), inner.get_local_rank(), dim_size
            )
        raise NotImplementedError(f"unsupported placements for expert weights: {dtensor_placements}")

    def split_expert_weights_dtensor(
        self,
        hf_abstract_key: str,
        archon_abstract_key: str,
        layer_id: str,
        grouped_expert_weight: DTensor,
        state: MoEConversionState,
    ) -> dict[str, DTensor]:
        """This rank's experts of a sharded 3D weight as 2D DTensors (no communication).

        The expert dimension's placement becomes ``Replicate`` on each 2D piece; other
        shardings (expert tensor parallelism on dims 1/2) carry over. ``state`` records
        placements, shape and local range for :meth:`concatenate_expert_weights_dtensor`.
        """
        mesh = grouped_expert_weight.device_mesh
        placements = grouped_expert_weight.placements
        archon_key = archon_abstract_key.format(layer_id)
        num_experts = grouped_expert_weight.shape[0]
        start, end = self.calculate_indices_from_placements(0, num_experts, placements, mesh)
        if start is None or end is None:
            # AReaL's converter refuses this too: its DTensor path is for expert-sharded weights.
            raise ValueError(
                f"{archon_key}: placements {placements} do not shard the expert dimension; "
                "split a replicated expert weight with split_expert_weights_offline"
            )
        state.grouped_expert_weight_placements[archon_key] = placements
        state.grouped_expert_weight_shape[archon_key] = tuple(grouped_expert_weight.shape)
        state.local_experts_indices[archon_key] = (start, end)

        expert_placements = tuple(
            Replicate() if isinstance(p, (Shard, _StridedShard)) and p.dim == 0 else p for p in placements
        )
        local = grouped_expert_weight.to_local()
        if local.shape[0] != end - start:
            raise ValueError(
                f"{archon_key}: local shard holds {local.shape[0]} experts, placements imply {end - start}"
            )
        return {
            hf_abstract_key.format(layer_id, expert_id): DTensor.from_local(
                local[expert_id - start].unsqueeze(0), mesh, expert_placements, run_check=False
            ).squeeze(0)
            for expert_id in range(start, end)
        }

    def concatenate_expert_weights_dtensor(
        self,
        expert_weights_by_layer: dict[str, dict[str, dict[int, Any]]],
        archon_abstract_key: str,
        layer_id: str,
        device_mesh: DeviceMesh,
        state: MoEConversionState,
    ) -> DTensor | None:
        """Rebuild a sharded 3D weight from this rank's 2D expert DTensors.

        ``expert_weights_by_layer`` is ``{layer_id: {archon_abstract_key: {expert_id: w}}}``;
        returns ``None`` until all local experts have arrived (weights may stream in),
        then removes them from the dict.
        """
        experts = expert_weights_by_layer.get(layer_id, {}).get(archon_abstract_key)
        if experts is None:
            return None
        archon_key = archon_abstract_key.format(layer_id)
        if archon_key not in state.grouped_expert_weight_placements:
            raise KeyError(f"no placements recorded for {archon_key}: split it with the same state first")
        start, end = state.local_experts_indices[archon_key]
        if len(experts) < end - start:
            return None
        local = torch.stack([w.to_local() if isinstance(w, DTensor) else w for _, w in sorted(experts.items())], dim=0)
        del expert_weights_by_layer[layer_id][archon_abstract_key]
        if not expert_weights_by_layer[layer_id]:
            del expert_weights_by_layer[layer_id]
        return DTensor.from_local(
            local, device_mesh, state.grouped_expert_weight_placements[archon_key], run_check=False
        )

    @staticmethod
    def split_expert_weights_offline(weight: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, ...]:
        """A plain 3D expert weight as ``n_experts`` chunks of shape ``[1, out, in]``.

        The chunks keep the expert dimension (``torch.split``), as AReaL's do; an adapter
        that wants checkpoint-shaped 2D tensors squeezes it.
        """
        return torch.split(weight, weight.shape[0] // n_experts, dim=0)

    @staticmethod
    def concatenate_expert_weights_offline(
        expert_weights_by_layer: dict[str, dict[str, dict[int, torch.Tensor]]],
        abstract_key: str,
        layer_num: str,
        n_experts: int,
    ) -> torch.Tensor | None:
        """Stack a layer's 2D experts once all ``n_experts`` arrived (else ``None``),
        removing them from ``expert_weights_by_layer``."""
        experts = expert_weights_by_layer.get(layer_num, {}).get(abstract_key)
        if experts is None or len(experts) < n_experts:
            return None
        stacked = torch.stack([w for _, w in sorted(experts.items())], dim=0)
        del expert_weights_by_layer[layer_num][abstract_key]
        if not expert_weights_by_layer[layer_num]:
            del expert_weights_by_layer[layer_num]
        return stacked


__all__ = ["MoEConversionState", "MoEWeightConverter"]
