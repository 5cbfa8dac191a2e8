"""Qwen3.5 (text) state dicts: Archon names <-> HuggingFace checkpoint names.

The conversion is qwen3's (every key renamed, the MoE experts stacked from and split into
one 2D tensor per expert, an unknown key refused by name, completeness checked against the
model these args build) with Qwen3.5's names: the gated attention of the full-attention
layers, the Gated DeltaNet of the linear-attention layers. A layer has one of the two, so
each layer's keys are checked against the model, not the map.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open

from archon_models.base import BaseStateDictAdapter
from archon_models.moe_weight_converter import MoEConversionState, MoEWeightConverter
from archon_models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter, _abstract
from archon_models.qwen3_5.model.args import Qwen3_5ModelArgs
from archon_models.qwen3_5.model.model import Qwen3_5Model

__all__ = ["Qwen3_5StateDictAdapter"]


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


class Qwen3_5StateDictAdapter(Qwen3StateDictAdapter):
    """Renames Qwen3.5 (text) weights between Archon and HF checkpoints.

    ``model_config`` is a transformers ``Qwen3_5TextConfig``/``Qwen3_5MoeTextConfig`` or a
    :class:`Qwen3_5ModelArgs`.
    Released checkpoints are multimodal: the text model's keys sit under
    ``model.language_model.`` (as transformers 5.3's ``save_pretrained`` writes them too) beside
    the vision tower (``model.visual.*``) and multi-token-prediction blocks (``mtp.*``), which
    HF's ``Qwen3_5ForCausalLM`` does not build and its load drops
    (``_keys_to_ignore_on_load_unexpected``); they are dropped here too. Either namespace
    loads; ``to_hf`` writes the one the checkpoint uses (its index, or what ``from_hf`` read).
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
    # transformers drops keys these patterns find (Qwen3_5PreTrainedModel's
    # _keys_to_ignore_on_load_unexpected); so does from_hf, for keys no map entry covers.
    ignored_hf_key_patterns: ClassVar[tuple[str, ...]] = (r"^mtp.*", r"^model.visual.*")
    # Where the text model's keys live in released (multimodal) Qwen3.5 checkpoints, and in what
    # transformers 5.3's save_pretrained writes; the map's names are the text-only ones.
    composite_prefix: ClassVar[str] = "model.language_model."

    def __init__(self, model_config: Any, hf_assets_path: str | None = None):
        # qwen3's constructor would build qwen3's args: set up what it sets, with Qwen3.5's.
        BaseStateDictAdapter.__init__(self, model_config, hf_assets_path)
        self.from_hf_map = dict(type(self).from_hf_map)
        self.to_hf_map = {archon: hf for hf, archon in self.from_hf_map.items() if archon is not None}
        if isinstance(model_config, Qwen3_5ModelArgs):
            self.model_args = model_config
        else:
            self.model_args = Qwen3_5ModelArgs.from_hf_config(model_config)
        self.enable_weight_tying = self.model_args.enable_weight_tying
        self.moe_enabled = self.model_args.moe_enabled
        self.num_experts = self.model_args.moe_args.num_experts if self.model_args.moe_args is not None else 0
        self._expert_templates = {
            archon: hf for hf, archon in self.from_hf_map.items() if archon is not None and hf.count("{}") == 2
        }
        self._moe_converter = MoEWeightConverter()
        self._moe_state = MoEConversionState()
        self._expected_keys = None
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
        # qwen3's conversion reads text-only names; keys transformers' load drops go first.
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

    def _expected_archon_keys(self) -> frozenset[str]:
        """The state-dict keys of the model these args build (on the meta device: no memory)."""
        if self._expected_keys is None:
            with torch.device("meta"):
                model = Qwen3_5Model(self.model_args)
            self._expected_keys = frozenset(model.state_dict())
        return self._expected_keys
