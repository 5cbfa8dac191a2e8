"""Every config field with its value, and the Archon args field it maps to.

The Archon side is the args vocabulary of the references (``dim``, ``n_layers``, ...,
``moe_args.*``); the HF side is matched by the field's canonical name (after the
config's ``attribute_map``, so ``n_embd`` reads as ``hidden_size``) and by its role
(any ``*_eps`` field is the norm epsilon), not by family.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PretrainedConfig

from skill.analysis.report import UNMAPPED, ConfigField

ARCHON_FIELDS: dict[str, str] = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "vocab_size": "vocab_size",
    "head_dim": "head_dim",
    "intermediate_size": "hidden_dim",
    "rope_theta": "rope_theta",
    "rope_parameters": "rope_theta",
    "max_position_embeddings": "max_seq_len",
    "eos_token_id": "eos_id",
    "tie_word_embeddings": "enable_weight_tying",
    "attention_bias": "attention_bias",
    "moe_intermediate_size": "moe_inter_dim",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
    "num_experts": "moe_args.num_experts",
    "num_local_experts": "moe_args.num_experts",
    "n_routed_experts": "moe_args.num_experts",
    "num_experts_per_tok": "moe_args.top_k",
    "norm_topk_prob": "moe_args.route_norm",
    "routed_scaling_factor": "moe_args.route_scale",
    "n_shared_experts": "moe_args.num_shared_experts",
    "num_shared_experts": "moe_args.num_shared_experts",
    "shared_expert_intermediate_size": "moe_args.shared_expert_intermediate_size",
    "scoring_func": "moe_args.score_func",
    "expert_selection_fn": "moe_args.score_func",  # Cohere2-MoE
    "n_group": "moe_args.num_expert_groups",
    "topk_group": "moe_args.num_limited_groups",
    "num_labels": "num_labels",
    # The Gated DeltaNet layers of a hybrid (the qwen3_5 reference's args).
    "linear_conv_kernel_dim": "linear_conv_kernel_dim",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
}
_EPS_SUFFIXES = ("_eps", "_epsilon")
# Bookkeeping of PretrainedConfig itself, not architecture.
_SKIP = {"transformers_version", "_name_or_path", "id2label", "label2id"}


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def mapped_field(config: PretrainedConfig, name: str) -> str | None:
    """The Archon args field a config field maps to, or None."""
    inverse = {stored: canonical for canonical, stored in (getattr(type(config), "attribute_map", {}) or {}).items()}
    canonical = inverse.get(name, name)
    archon = ARCHON_FIELDS.get(canonical)
    if archon is None and canonical.endswith(_EPS_SUFFIXES) and "norm" in canonical:
        archon = "norm_eps"
    return archon


def config_fields(config: PretrainedConfig) -> list[ConfigField]:
    """All fields of ``config`` sorted by name, each with its Archon field or ``unmapped``."""
    rows = []
    data = config.to_dict()
    data["num_labels"] = config.num_labels
    for name in sorted(data):
        if name in _SKIP:
            continue
        archon = mapped_field(config, name)
        rows.append(ConfigField(name=name, value=_jsonable(data[name]), archon_field=archon or UNMAPPED))
    return rows
