"""Per-layer MoE rules a family's args class gets as its ``is_moe_layer`` method.

``edit_args`` copies the method of the class whose rule the analysis measured
(``MoEFeatures.moe_layer_rule``) into the generated args; each class here declares only
the fields its method reads, so the rule is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from archon_models.moe import MoEArgs


@dataclass
class FirstKDenseRule:
    """DeepSeek-V3 / GLM-4-MoE: the first ``first_k_dense_replace`` layers are dense."""

    moe_args: MoEArgs | None = None
    first_k_dense_replace: int = 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) is a sparse MoE layer: every layer from
        ``first_k_dense_replace`` on (HF's rule)."""
        return self.moe_args is not None and layer_id >= self.first_k_dense_replace


@dataclass
class LayerTypesRule:
    """An explicit per-layer list: ``mlp_layer_types[i]`` is ``"sparse"`` or ``"dense"``."""

    moe_args: MoEArgs | None = None
    mlp_layer_types: tuple[str, ...] = ()

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) is a sparse MoE layer: the config's
        ``mlp_layer_types`` says ``"sparse"`` for it (HF's rule)."""
        return self.moe_args is not None and self.mlp_layer_types[layer_id] == "sparse"


@dataclass
class StartEndIntervalRule:
    """ERNIE-4.5-MoE: every ``moe_layer_interval``-th layer between two indices."""

    moe_args: MoEArgs | None = None
    moe_layer_start_index: int = 0
    moe_layer_end_index: int = -1
    moe_layer_interval: int = 1

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) is a sparse MoE layer: ``(layer_id + 1)`` is
        a multiple of ``moe_layer_interval`` and ``layer_id`` lies in
        ``[moe_layer_start_index, moe_layer_end_index]`` (HF's rule)."""
        return (
            self.moe_args is not None
            and (layer_id + 1) % self.moe_layer_interval == 0
            and self.moe_layer_start_index <= layer_id <= self.moe_layer_end_index
        )


@dataclass
class SparseStepRule:
    """Qwen-MoE: every ``decoder_sparse_step``-th layer, less ``mlp_only_layers``."""

    moe_args: MoEArgs | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) is a sparse MoE layer, by HF's rule."""
        return (
            self.moe_args is not None
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


# The analysis' rule name -> the class holding its method.
RULES = {
    "first_k_dense": "FirstKDenseRule",
    "layer_types": "LayerTypesRule",
    "start_end_interval": "StartEndIntervalRule",
    "sparse_step": "SparseStepRule",
}
