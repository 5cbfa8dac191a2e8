"""DeepSeek-V3 state dicts: Archon names <-> HuggingFace checkpoint names.

MLA projections keep their HF roles under Archon names (``q_a_proj`` -> ``wq_a``,
``q_a_layernorm`` -> ``q_norm``, ``kv_a_proj_with_mqa`` -> ``wkv_a``, ``kv_a_layernorm``
-> ``kv_norm``, ...); the router's ``e_score_correction_bias`` is the MoE's
``expert_bias`` buffer. Published checkpoints also hold the multi-token-prediction
layers (``model.layers.{n_layers + i}``, ``num_nextn_predict_layers`` of them), which
are not part of the forward pass: ``from_hf`` drops every key of a layer past
``n_layers``. Checkpoints store one 2D tensor per expert and projection
(``model.layers.{L}.mlp.experts.{E}.gate_proj.weight``); Archon stacks a layer's
experts into 3D ``layers.{L}.moe.experts.w1``/``w2``/``w3``. The split/stack uses only
AReaL's ``MoEWeightConverter`` API (``*_offline`` for plain tensors, ``*_dtensor`` for
expert-sharded DTensors), so this package drops into AReaL unchanged.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from archon_models.base import BaseStateDictAdapter
from archon_models.deepseek_v3.model.args import DeepseekV3ModelArgs
from archon_models.deepseek_v3.model.model import DeepseekV3Model
from archon_models.moe_weight_converter import MoEConversionState, MoEWeightConverter

logger = logging.getLogger(__name__)

__all__ = ["DeepseekV3StateDictAdapter"]

# ".12." inside a key: a layer (or expert) index. Replaced by "{}" to look the key up in the map.
_INDEX = re.compile(r"\.(\d+)(?=\.)")
# "model.layers.12.": the decoder layer a checkpoint key belongs to.
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Prefixes that activation checkpointing and torch.compile insert into parameter names.
_WRAPPER_PREFIXES = ("._checkpoint_wrapped_module", "._orig_mod")


def _abstract(key: str) -> tuple[str, list[str]]:
    """``"model.layers.3.mlp.x"`` → ``("model.layers.{}.mlp.x", ["3"])``."""
    indices: list[str] = []

    def _take(match: re.Match[str]) -> str:
        indices.append(match.group(1))
        return ".{}"

    return _INDEX.sub(_take, key), indices


def _layer_index(hf_key: str) -> int | None:
    """The layer of ``model.layers.{L}.…`` keys, else ``None``."""
    match = _LAYER.match(hf_key)
    return int(match.group(1)) if match else None


def _strip_wrappers(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class DeepseekV3StateDictAdapter(BaseStateDictAdapter):
    """Renames DeepSeek-V3 weights between Archon and HF checkpoints and stacks/splits MoE experts.

    ``model_config`` is a transformers ``DeepseekV3Config`` or a
    :class:`DeepseekV3ModelArgs`. Every HF key must be in ``from_hf_map`` (``None`` drops
    it); anything else raises ``KeyError`` naming the key, so a checkpoint never loads
    with weights silently lost. Map entries with two ``{}`` (layer, expert) are the
    per-expert keys.
    """

    from_hf_map: ClassVar[dict[str, str | None]] = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
        "model.layers.{}.self_attn.q_a_proj.weight": "layers.{}.attention.wq_a.weight",
        "model.layers.{}.self_attn.q_a_proj.bias": "layers.{}.attention.wq_a.bias",
        "model.layers.{}.self_attn.q_a_layernorm.weight": "layers.{}.attention.q_norm.weight",
        "model.layers.{}.self_attn.q_b_proj.weight": "layers.{}.attention.wq_b.weight",
        "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight": "layers.{}.attention.wkv_a.weight",
        "model.layers.{}.self_attn.kv_a_proj_with_mqa.bias": "layers.{}.attention.wkv_a.bias",
        "model.layers.{}.self_attn.kv_a_layernorm.weight": "layers.{}.attention.kv_norm.weight",
        "model.layers.{}.self_attn.kv_b_proj.weight": "layers.{}.attention.wkv_b.weight",
        "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
        "model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
        "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
        "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
        "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
        "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
        "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
        "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.moe.expert_bias",
        "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.experts.w1",
        "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.moe.experts.w3",
        "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.moe.experts.w2",
        "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.moe.shared_experts.w1.weight",
        "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.moe.shared_experts.w3.weight",
        "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.moe.shared_experts.w2.weight",
        "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
        "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
        "score.weight": "score.weight",
    }

    def __init__(self, model_config: Any, hf_assets_path: str | None = None):
        super().__init__(model_config, hf_assets_path)
        # AReaL's base class resets both maps on the instance; rebuild them from the class literal.
        self.from_hf_map = dict(type(self).from_hf_map)
        self.to_hf_map = {archon: hf for hf, archon in self.from_hf_map.items() if archon is not None}
        if isinstance(model_config, DeepseekV3ModelArgs):
            self.model_args = model_config
        else:
            self.model_args = DeepseekV3ModelArgs.from_hf_config(model_config)
        self.enable_weight_tying = self.model_args.enable_weight_tying
        self.moe_enabled = self.model_args.moe_enabled
        self.num_experts = self.model_args.moe_args.num_experts if self.model_args.moe_args is not None else 0
        # Archon expert template ("layers.{}.moe.experts.w1") -> HF template (layer, expert).
        self._expert_templates = {
            archon: hf for hf, archon in self.from_hf_map.items() if archon is not None and hf.count("{}") == 2
        }
        self._moe_converter = MoEWeightConverter()
        # What to_hf of expert-sharded DTensors records for the matching from_hf.
        self._moe_state = MoEConversionState()
        self._expected_keys: frozenset[str] | None = None

    # -- key mapping -------------------------------------------------------------------

    def _archon_key(self, hf_key: str) -> str | None:
        template, indices = _abstract(hf_key)
        if template not in self.from_hf_map:
            raise KeyError(
                f"HF checkpoint key {hf_key!r} (pattern {template!r}) is not in "
                f"{type(self).__name__}.from_hf_map; map it to an Archon key, or to None to drop it."
            )
        target = self.from_hf_map[template]
        return None if target is None else target.format(*indices)

    def _hf_key(self, archon_key: str) -> str:
        template, indices = _abstract(_strip_wrappers(archon_key))
        if template not in self.to_hf_map:
            raise KeyError(
                f"Archon key {archon_key!r} (pattern {template!r}) has no HF name; add the HF key "
                f"that holds it to {type(self).__name__}.from_hf_map."
            )
        hf_key = self.to_hf_map[template]
        for index in indices:  # an expert template keeps its expert "{}" (it names all experts)
            hf_key = hf_key.replace("{}", index, 1)
        return hf_key

    # -- completeness ------------------------------------------------------------------

    def _expected_archon_keys(self) -> frozenset[str]:
        """The state-dict keys of the model these args build (on the meta device: no memory)."""
        if self._expected_keys is None:
            with torch.device("meta"):
                model = DeepseekV3Model(self.model_args)
            self._expected_keys = frozenset(model.state_dict())
        return self._expected_keys

    def _check_complete(self, state_dict: dict[str, Any]) -> None:
        """Raise unless ``state_dict`` holds exactly the model's keys.

        A pipeline stage converts only some layers: when layers are missing, only the
        layers present must be whole, and top-level keys are not required.
        """
        expected = self._expected_archon_keys()
        unexpected = sorted(set(state_dict) - expected)
        if unexpected:
            raise KeyError(
                f"Checkpoint keys with no parameter in {type(self.model_args).__name__} "
                f"(n_layers={self.model_args.n_layers}, moe={self.moe_enabled}): {unexpected}. "
                "The checkpoint does not match this config."
            )
        seen_layers = {key.split(".")[1] for key in state_dict if key.startswith("layers.")}
        all_layers = {str(i) for i in range(self.model_args.n_layers)}
        if seen_layers == all_layers:
            required = set(expected)
        else:
            required = {k for k in expected if k.startswith("layers.") and k.split(".")[1] in seen_layers}
        if self.model_args.is_critic:
            required.discard("score.weight")  # a critic's value head starts fresh
        missing = sorted(required - set(state_dict))
        if missing:
            raise KeyError(f"Checkpoint lacks {[self._hf_key(k) for k in missing]} (Archon {missing}).")

    # -- MoE experts -------------------------------------------------------------------

    def _split_experts(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """Per-expert HF entries of a 3D expert weight, or ``None`` if ``name`` is not one."""
        template, indices = _abstract(name)
        hf_template = self._expert_templates.get(template)
        if hf_template is None:
            return None
        if not self.moe_enabled:
            raise KeyError(f"Archon key {name!r} is an expert weight, but the config has no experts.")
        (layer_id,) = indices
        if isinstance(tensor, DTensor):
            pieces = self._moe_converter.split_expert_weights_dtensor(
                hf_template, template, layer_id, tensor, self._moe_state
            )
            return list(pieces.items())
        # AReaL's offline split keeps the expert dimension ([1, out, in] chunks); the
        # checkpoint holds 2D tensors.
        experts = MoEWeightConverter.split_expert_weights_offline(tensor, self.num_experts)
        return [(hf_template.format(layer_id, e), w.squeeze(0)) for e, w in enumerate(experts)]

    def _stack_experts(self, by_layer: dict[str, dict[str, dict[int, Any]]]) -> dict[str, Any]:
        """3D Archon expert weights from ``{layer: {archon_template: {expert: 2D}}}``.

        Plain tensors need all ``num_experts`` experts; DTensors (a rank under expert
        parallelism) need the experts this rank held when ``to_hf`` split them.
        """
        stacked: dict[str, Any] = {}
        missing: list[str] = []
        for layer_id in sorted(by_layer, key=int):
            for template in list(by_layer[layer_id]):
                experts = by_layer[layer_id][template]
                sample = next(iter(experts.values()))
                if isinstance(sample, DTensor):
                    key = template.format(layer_id)
                    expected = range(*self._moe_state.local_experts_indices.get(key, (0, self.num_experts)))
                    weight = self._moe_converter.concatenate_expert_weights_dtensor(
                        by_layer, template, layer_id, sample.device_mesh, self._moe_state
                    )
                else:
                    expected = range(self.num_experts)
                    weight = MoEWeightConverter.concatenate_expert_weights_offline(
                        by_layer, template, layer_id, self.num_experts
                    )
                if weight is None:
                    hf_template = self._expert_templates[template]
                    missing += [hf_template.format(layer_id, e) for e in expected if e not in experts]
                else:
                    stacked[template.format(layer_id)] = weight
        if missing:
            raise KeyError(f"Checkpoint lacks expert weights {missing}.")
        return stacked

    # -- conversions -------------------------------------------------------------------

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict: dict[str, Any] = {}
        experts_by_layer: dict[str, dict[str, dict[int, Any]]] = {}
        dropped_layers: set[int] = set()
        for hf_key, value in hf_state_dict.items():
            layer = _layer_index(hf_key)
            if layer is not None and layer >= self.model_args.n_layers:
                dropped_layers.add(layer)
                continue
            archon_key = self._archon_key(hf_key)
            if archon_key is None:
                continue
            hf_template, indices = _abstract(hf_key)
            if hf_template.count("{}") != 2:
                state_dict[archon_key] = value
                continue
            # A per-expert 2D weight: collect it for stacking.
            layer_id, expert_id = indices[0], int(indices[1])
            if not self.moe_enabled or expert_id >= self.num_experts:
                raise KeyError(
                    f"HF checkpoint key {hf_key!r} names expert {expert_id}, but the config has "
                    f"{self.num_experts} experts per layer."
                )
            archon_template = self.from_hf_map[hf_template]
            experts_by_layer.setdefault(layer_id, {}).setdefault(archon_template, {})[expert_id] = value
        if dropped_layers:
            logger.info(
                "Dropped checkpoint layers %s past n_layers=%d (multi-token prediction, not trained here).",
                sorted(dropped_layers),
                self.model_args.n_layers,
            )
        state_dict.update(self._stack_experts(experts_by_layer))
        if self.model_args.is_critic and state_dict.pop("output.weight", None) is not None:
            logger.info("Dropped lm_head.weight: a critic has a score head instead.")
        if (
            self.enable_weight_tying
            and not self.model_args.is_critic
            and "output.weight" not in state_dict
            and "tok_embeddings.weight" in state_dict
        ):
            state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
        self._check_complete(state_dict)
        return state_dict

    def to_hf(self, archon_state_dict: dict[str, Any]) -> dict[str, Any]:
        hf_state_dict: dict[str, Any] = {}
        for name, value in archon_state_dict.items():
            for hf_key, tensor in self.convert_single_to_hf(name, value):
                hf_state_dict[hf_key] = tensor
        return hf_state_dict

    def convert_single_to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name = _strip_wrappers(name)
        if self.enable_weight_tying and name == "output.weight":
            return []  # HF rebuilds the tied LM head from the embedding
        experts = self._split_experts(name, tensor)
        if experts is not None:
            return experts
        return [(self._hf_key(name), tensor)]
