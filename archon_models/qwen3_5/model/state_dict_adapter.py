"""Qwen3.5 (text) state dicts: Archon names <-> HuggingFace checkpoint names.

:class:`Qwen3_5TextStateDictAdapter` converts the text model's checkpoint: every key renamed,
the MoE experts stacked from and split into one 2D tensor per expert (AReaL's
``MoEWeightConverter``), an unknown key refused by name, completeness checked against the
model these args build. A layer holds either the gated attention of the full-attention layers
or the Gated DeltaNet of the linear-attention layers, so each layer's keys are checked against
the model, not the map. :class:`Qwen3_5StateDictAdapter` adds what released Qwen3.5
checkpoints need: their multimodal namespace, and the keys transformers' load drops.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from archon_models.base import BaseStateDictAdapter
from archon_models.moe_weight_converter import MoEConversionState, MoEWeightConverter
from archon_models.qwen3_5.model.args import Qwen3_5ModelArgs
from archon_models.qwen3_5.model.model import Qwen3_5Model

logger = logging.getLogger(__name__)

__all__ = ["Qwen3_5StateDictAdapter", "Qwen3_5TextStateDictAdapter"]

# ".12." inside a key: a layer (or expert) index. Replaced by "{}" to look the key up in the map.
_INDEX = re.compile(r"\.(\d+)(?=\.)")
# Prefixes that activation checkpointing and torch.compile insert into parameter names.
_WRAPPER_PREFIXES = ("._checkpoint_wrapped_module", "._orig_mod")


def _abstract(key: str) -> tuple[str, list[str]]:
    """``"model.layers.3.mlp.x"`` → ``("model.layers.{}.mlp.x", ["3"])``."""
    indices: list[str] = []

    def _take(match: re.Match[str]) -> str:
        indices.append(match.group(1))
        return ".{}"

    return _INDEX.sub(_take, key), indices


def _strip_wrappers(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _checkpoint_keys(hf_assets_path: str | None, index: dict[str, int] | None) -> list[str]:
    """The checkpoint's tensor names: its safetensors index, else its single file's header."""
    if index:
        return list(index)
    if hf_assets_path is None:
        return []
    keys: list[str] = []
    for path in sorted(Path(hf_assets_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys.extend(f.keys())
    return keys


class Qwen3_5TextStateDictAdapter(BaseStateDictAdapter):
    """Renames Qwen3.5 text-model weights between Archon and HF checkpoints and stacks/splits
    MoE experts.

    ``model_config`` is a transformers ``Qwen3_5TextConfig``/``Qwen3_5MoeTextConfig`` or a
    :class:`Qwen3_5ModelArgs`. Every HF key must be in ``from_hf_map`` (``None`` drops it);
    anything else raises ``KeyError`` naming the key, so a checkpoint never loads with weights
    silently lost. Map entries with two ``{}`` (layer, expert) are the per-expert keys.
    """

    from_hf_map: ClassVar[dict[str, str | None]] = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        # Full-attention layers.
        "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
        "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
        "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
        "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
        "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
        "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
        "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
        "model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
        "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
        "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
        # Linear-attention (Gated DeltaNet) layers.
        "model.layers.{}.linear_attn.in_proj_qkv.weight": "layers.{}.linear_attn.in_proj_qkv.weight",
        "model.layers.{}.linear_attn.in_proj_z.weight": "layers.{}.linear_attn.in_proj_z.weight",
        "model.layers.{}.linear_attn.in_proj_b.weight": "layers.{}.linear_attn.in_proj_b.weight",
        "model.layers.{}.linear_attn.in_proj_a.weight": "layers.{}.linear_attn.in_proj_a.weight",
        "model.layers.{}.linear_attn.conv1d.weight": "layers.{}.linear_attn.conv1d.weight",
        "model.layers.{}.linear_attn.dt_bias": "layers.{}.linear_attn.dt_bias",
        "model.layers.{}.linear_attn.A_log": "layers.{}.linear_attn.A_log",
        "model.layers.{}.linear_attn.norm.weight": "layers.{}.linear_attn.norm.weight",
        "model.layers.{}.linear_attn.out_proj.weight": "layers.{}.linear_attn.out_proj.weight",
        # Every layer: a dense MLP, or a MoE with one gated shared expert.
        "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
        "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
        "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
        "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
        "model.layers.{}.mlp.experts.{}.gate_proj.weight": "layers.{}.moe.experts.w1",
        "model.layers.{}.mlp.experts.{}.up_proj.weight": "layers.{}.moe.experts.w3",
        "model.layers.{}.mlp.experts.{}.down_proj.weight": "layers.{}.moe.experts.w2",
        "model.layers.{}.mlp.shared_expert.gate_proj.weight": "layers.{}.moe.shared_experts.w1.weight",
        "model.layers.{}.mlp.shared_expert.up_proj.weight": "layers.{}.moe.shared_experts.w3.weight",
        "model.layers.{}.mlp.shared_expert.down_proj.weight": "layers.{}.moe.shared_experts.w2.weight",
        "model.layers.{}.mlp.shared_expert_gate.weight": "layers.{}.moe.shared_expert_gate.weight",
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
        if isinstance(model_config, Qwen3_5ModelArgs):
            self.model_args = model_config
        else:
            self.model_args = Qwen3_5ModelArgs.from_hf_config(model_config)
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
                model = Qwen3_5Model(self.model_args)
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
        for hf_key, value in hf_state_dict.items():
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


class Qwen3_5StateDictAdapter(Qwen3_5TextStateDictAdapter):
    """The text model's conversion, for released Qwen3.5 checkpoints.

    They are multimodal: the text model's keys sit under ``model.language_model.`` (as
    transformers 5.3's ``save_pretrained`` writes them too) beside the vision tower
    (``model.visual.*``) and multi-token-prediction blocks (``mtp.*``), which HF's
    ``Qwen3_5ForCausalLM`` does not build and its load drops
    (``_keys_to_ignore_on_load_unexpected``); they are dropped here too. Either namespace loads;
    ``to_hf`` writes the one the checkpoint uses (its index, or what ``from_hf`` read).
    """

    # transformers drops keys these patterns find (Qwen3_5PreTrainedModel's
    # _keys_to_ignore_on_load_unexpected); so does from_hf, for keys no map entry covers.
    ignored_hf_key_patterns: ClassVar[tuple[str, ...]] = (r"^mtp.*", r"^model.visual.*")
    # Where the text model's keys live in released (multimodal) Qwen3.5 checkpoints, and in what
    # transformers 5.3's save_pretrained writes; the map's names are the text-only ones.
    composite_prefix: ClassVar[str] = "model.language_model."

    def __init__(self, model_config: Any, hf_assets_path: str | None = None):
        super().__init__(model_config, hf_assets_path)
        # Written back in the namespace the checkpoint uses (its keys say, or from_hf saw): AReaL's
        # engine loads a checkpoint by the keys to_hf writes.
        keys = _checkpoint_keys(hf_assets_path, self.fqn_to_index_mapping)
        self.composite_namespace = any(key.startswith(self.composite_prefix) for key in keys)

    def _text_key(self, hf_key: str) -> str:
        if hf_key.startswith(self.composite_prefix):
            return "model." + hf_key.removeprefix(self.composite_prefix)
        return hf_key

    def _dropped(self, hf_key: str) -> bool:
        """A key no map entry covers that transformers' load drops too (an ignore pattern finds it)."""
        template, _ = _abstract(self._text_key(hf_key))
        return template not in self.from_hf_map and any(
            re.search(pattern, hf_key) for pattern in self.ignored_hf_key_patterns
        )

    def _archon_key(self, hf_key: str) -> str | None:
        return None if self._dropped(hf_key) else super()._archon_key(self._text_key(hf_key))

    def _maybe_composite_hf_key(self, hf_key: str) -> str:
        """A text-only HF key in the checkpoint's namespace (AReaL's hook, read by its engine)."""
        if self.composite_namespace and hf_key.startswith("model."):
            return self.composite_prefix + hf_key.removeprefix("model.")
        return hf_key

    def _hf_key(self, archon_key: str) -> str:
        return self._maybe_composite_hf_key(super()._hf_key(archon_key))

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if any(key.startswith(self.composite_prefix) for key in hf_state_dict):
            self.composite_namespace = True
        # The text model's conversion reads text-only names; keys transformers' load drops go first.
        text_only = {self._text_key(k): v for k, v in hf_state_dict.items() if not self._dropped(k)}
        try:
            return super().from_hf(text_only)
        except KeyError as exc:
            if not self.composite_namespace:
                raise
            # Name the keys as the checkpoint does.
            message = re.sub(r"'model\.(?!language_model\.)", f"'{self.composite_prefix}", str(exc.args[0]))
            raise KeyError(message) from None

    def _split_experts(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        experts = super()._split_experts(name, tensor)
        if experts is None:
            return None
        return [(self._maybe_composite_hf_key(key), piece) for key, piece in experts]
