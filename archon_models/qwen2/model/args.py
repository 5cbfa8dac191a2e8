"""Qwen2 hyper-parameters and their mapping from a transformers ``Qwen2Config``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from archon_models.base import BaseModelArgs

logger = logging.getLogger(__name__)

__all__ = ["Qwen2ModelArgs"]

_REQUIRED_HF_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "rms_norm_eps",
)


def _check_supported(hf_config: Any) -> None:
    """Refuse configs whose math this implementation does not reproduce."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Qwen2 in Archon implements SwiGLU with silu; hidden_act={act!r} is not supported.")
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope_parameters.get("rope_type", "default") if isinstance(rope_parameters, dict) else "default"
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} is not supported by the Qwen2 reference; "
            "only the default RoPE is."
        )
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) and "sliding_attention" in layer_types:
        raise ValueError(
            "use_sliding_window=True with sliding_attention layers is not supported by the Qwen2 "
            "reference, which attends over whole documents."
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", hf_config.attention_dropout)


def _eos_id(hf_config: Any, default: int) -> int:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return default if eos is None else int(eos)


@dataclass
class Qwen2ModelArgs(BaseModelArgs):
    """Qwen2 hyper-parameters. Defaults are those of Qwen2-0.5B.

    ``attention_bias`` is the bias on the q/k/v projections (never on the output
    projection), which every Qwen2 checkpoint has.

    ``pad_id`` (the config's ``pad_token_id``) is the embedding row HF's
    ``nn.Embedding(padding_idx=...)`` gives no gradient through its lookups; so does
    ``tok_embeddings`` here (``None``: every row trains).
    """

    dim: int = 896
    n_layers: int = 24
    n_heads: int = 14
    n_kv_heads: int = 2
    vocab_size: int = 151936
    head_dim: int = 64
    hidden_dim: int = 4864
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 131072
    depth_init: bool = True
    attention_bias: bool = True
    eos_id: int = 151643
    pad_id: int | None = None
    enable_weight_tying: bool = True
    is_critic: bool = False
    num_labels: int = 1

    def __post_init__(self) -> None:
        if self.attn_type not in ("varlen", "sdpa"):
            raise ValueError(f"attn_type must be 'varlen' or 'sdpa', got {self.attn_type!r}.")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}).")

    @classmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False, **kwargs: Any) -> Qwen2ModelArgs:
        """Map a ``Qwen2Config``.

        Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``) and
        ``num_labels`` (outputs of a critic's ``score`` head, default 1). Others that
        AReaL's engine passes (``router_dtype``) are ignored, as AReaL's own
        ``from_hf_config`` ignores them: a dense model has no router.
        ``eos_token_id`` of ``None`` keeps the Qwen2 default; a list takes its first id.
        """
        missing = [name for name in _REQUIRED_HF_FIELDS if getattr(hf_config, name, None) is None]
        if missing:
            raise ValueError(
                f"{type(hf_config).__name__} lacks required field(s) {missing}; a Qwen2 config "
                f"must set all of {list(_REQUIRED_HF_FIELDS)}."
            )
        _check_supported(hf_config)
        n_heads = hf_config.num_attention_heads
        n_kv_heads = getattr(hf_config, "num_key_value_heads", None) or n_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        return cls(
            attn_type=kwargs.get("attn_type", BaseModelArgs.attn_type),
            dim=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=hf_config.vocab_size,
            head_dim=head_dim,
            hidden_dim=hf_config.intermediate_size,
            norm_eps=hf_config.rms_norm_eps,
            rope_theta=cls._get_rope_theta(hf_config, cls.rope_theta),
            max_seq_len=getattr(hf_config, "max_position_embeddings", None) or cls.max_seq_len,
            attention_bias=True,
            eos_id=_eos_id(hf_config, cls.eos_id),
            pad_id=getattr(hf_config, "pad_token_id", None),
            enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
            is_critic=is_critic,
            num_labels=kwargs.get("num_labels", cls.num_labels),
        )
