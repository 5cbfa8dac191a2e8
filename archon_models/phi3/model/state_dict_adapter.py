"""Phi3 state dicts: Archon names <-> HuggingFace checkpoint names."""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

import torch

from archon_models.base import BaseStateDictAdapter
from archon_models.phi3.model.args import Phi3ModelArgs
from archon_models.phi3.model.model import Phi3Model

logger = logging.getLogger(__name__)

__all__ = ["Phi3StateDictAdapter"]

# ".12." inside a key: a layer index. Replaced by "{}" to look the key up in the map.
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


class Phi3StateDictAdapter(BaseStateDictAdapter):
    """Renames Phi3 weights between Archon and HF checkpoints; splits and re-stacks fused tensors.

    ``model_config`` is a transformers ``Phi3Config`` or a :class:`Phi3ModelArgs`.
    Every HF key must be in ``from_hf_map`` (``None`` drops it); anything else raises
    ``KeyError`` naming the key, so a checkpoint never loads with weights silently lost.
    """

    from_hf_map: ClassVar[dict[str, str | None]] = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
        "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
        "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
        "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
        "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
        "score.weight": "score.weight",
    }
    # Checkpoint keys that stack several Archon parameters along dim 0, in this order.
    fused_from_hf_map: ClassVar[dict[str, list[str]]] = {
        "model.layers.{}.mlp.gate_up_proj.weight": [
            "layers.{}.feed_forward.w1.weight",
            "layers.{}.feed_forward.w3.weight",
        ],
        "model.layers.{}.self_attn.qkv_proj.weight": [
            "layers.{}.attention.wq.weight",
            "layers.{}.attention.wk.weight",
            "layers.{}.attention.wv.weight",
        ],
    }

    def __init__(self, model_config: Any, hf_assets_path: str | None = None):
        super().__init__(model_config, hf_assets_path)
        # AReaL's base class resets both maps on the instance; rebuild them from the class literal.
        self.from_hf_map = dict(type(self).from_hf_map)
        self.to_hf_map = {archon: hf for hf, archon in self.from_hf_map.items() if archon is not None}
        # Archon part -> (fused HF key that holds it, its position along dim 0).
        self.fused_to_hf_map = {
            part: (hf, position) for hf, parts in self.fused_from_hf_map.items() for position, part in enumerate(parts)
        }
        self._rows: dict[str, int] | None = None
        if isinstance(model_config, Phi3ModelArgs):
            self.model_args = model_config
        else:
            self.model_args = Phi3ModelArgs.from_hf_config(model_config)
        self.enable_weight_tying = self.model_args.enable_weight_tying
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
        if template in self.fused_to_hf_map:
            return self.fused_to_hf_map[template][0].format(*indices)  # the slice's destination
        if template not in self.to_hf_map:
            raise KeyError(
                f"Archon key {archon_key!r} (pattern {template!r}) has no HF name; add the HF key "
                f"that holds it to {type(self).__name__}.from_hf_map."
            )
        return self.to_hf_map[template].format(*indices)

    # -- completeness ------------------------------------------------------------------

    def _expected_archon_keys(self) -> frozenset[str]:
        """The state-dict keys of the model these args build (on the meta device: no memory)."""
        if self._expected_keys is None:
            with torch.device("meta"):
                model = Phi3Model(self.model_args)
            self._expected_keys = frozenset(model.state_dict())
        return self._expected_keys

    def _archon_rows(self) -> dict[str, int]:
        """Dim-0 size of every Archon parameter (from a meta-device model: no memory)."""
        if self._rows is None:
            with torch.device("meta"):
                model = Phi3Model(self.model_args)
            self._rows = {key: value.shape[0] for key, value in model.state_dict().items()}
        return self._rows

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
                f"(n_layers={self.model_args.n_layers}): {unexpected}. The checkpoint does not "
                "match this config."
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

    def _split_fused(self, hf_key: str, template: str, indices: list[str], value: Any) -> dict[str, Any]:
        """One fused checkpoint tensor -> the Archon parameters it stacks along dim 0."""
        parts = [part.format(*indices) for part in self.fused_from_hf_map[template]]
        rows = [self._archon_rows().get(part, 0) for part in parts]
        if sum(rows) != value.shape[0] or 0 in rows:
            raise KeyError(
                f"HF checkpoint key {hf_key!r} has {value.shape[0]} rows; the Archon parameters "
                f"{parts} it holds have {rows}. The checkpoint does not match this config."
            )
        return dict(zip(parts, torch.split(value, rows, dim=0)))

    def _concat_fused(self, hf_key: str, pieces: dict[int, Any]) -> Any:
        """The Archon parameters one fused checkpoint tensor holds, stacked along dim 0 in order."""
        template, _ = _abstract(hf_key)
        count = len(self.fused_from_hf_map[template])
        if sorted(pieces) != list(range(count)):
            raise KeyError(f"{hf_key!r} stacks {count} Archon parameters; only parts {sorted(pieces)} were given.")
        return torch.cat([pieces[position] for position in range(count)], dim=0)

    # -- conversions -------------------------------------------------------------------

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict: dict[str, Any] = {}
        for hf_key, value in hf_state_dict.items():
            template, indices = _abstract(hf_key)
            if template in self.fused_from_hf_map:
                state_dict.update(self._split_fused(hf_key, template, indices, value))
                continue
            archon_key = self._archon_key(hf_key)
            if archon_key is not None:
                state_dict[archon_key] = value
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
        fused: dict[str, dict[int, Any]] = {}
        for name, value in archon_state_dict.items():
            template, indices = _abstract(_strip_wrappers(name))
            if template in self.fused_to_hf_map:
                hf_template, position = self.fused_to_hf_map[template]
                fused.setdefault(hf_template.format(*indices), {})[position] = value
                continue
            for hf_key, tensor in self.convert_single_to_hf(name, value):
                hf_state_dict[hf_key] = tensor
        for hf_key, pieces in fused.items():
            hf_state_dict[hf_key] = self._concat_fused(hf_key, pieces)
        return hf_state_dict

    def convert_single_to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name = _strip_wrappers(name)
        if self.enable_weight_tying and name == "output.weight":
            return []  # HF rebuilds the tied LM head from the embedding
        return [(self._hf_key(name), tensor)]
