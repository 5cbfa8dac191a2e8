"""Helpers a family's ``args.py`` needs to read its config, copied in by ``edit_args``."""

from __future__ import annotations

from typing import Any


def _partial_rotary_factor(hf_config: Any) -> float:
    """The share of each head's features that rotate (``rope_parameters`` in transformers 5)."""
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    return float(rope_parameters.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))


def _rope_freq_scaling(hf_config: Any) -> dict[str, float] | None:
    """The RoPE frequency-scaling parameters (``rope_parameters`` less its type and theta,
    flags as 0.0 / 1.0); ``None`` for the unscaled default RoPE."""
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    skip = ("rope_type", "rope_theta")
    # A flag (YaRN's truncate) travels as 0.0 / 1.0: the RoPE reads its truth value.
    return {k: float(v) for k, v in rope_parameters.items() if k not in skip and isinstance(v, (int, float))}


def _layer_rope_parameters(hf_config: Any, layer_type: str) -> dict[str, Any]:
    """The RoPE parameters of one layer type. ``rope_parameters`` holds one dict per layer
    type; a config written for a model that shares one RoPE across layer types (the Olmo3
    of transformers 5.3) holds a single dict, which then serves every layer type."""
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    per_type = rope_parameters.get(layer_type)
    return per_type if isinstance(per_type, dict) else rope_parameters


def _layer_partial_rotary_factor(hf_config: Any, layer_type: str) -> float:
    """The share of each head's features that the layers of one type rotate."""
    return float(_layer_rope_parameters(hf_config, layer_type).get("partial_rotary_factor", 1.0))


def _layer_rope_freq_scaling(hf_config: Any, layer_type: str) -> dict[str, float] | None:
    """The RoPE frequency-scaling parameters of one layer type, less its type and theta;
    ``None`` where that type is unscaled."""
    rope_parameters = _layer_rope_parameters(hf_config, layer_type)
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    skip = ("rope_type", "rope_theta")
    # A flag (YaRN's truncate) travels as 0.0 / 1.0: the RoPE reads its truth value.
    return {k: float(v) for k, v in rope_parameters.items() if k not in skip and isinstance(v, (int, float))}
