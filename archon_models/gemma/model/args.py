"""Gemma hyper-parameters and their mapping from a transformers ``GemmaConfig``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from archon_models.base import BaseModelArgs

logger = logging.getLogger(__name__)

__all__ = ["GemmaModelArgs"]

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
    act = getattr(hf_config, "hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma in Archon implements the gelu_pytorch_tanh activation; hidden_act={act!r} is not supported.")
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope_parameters.get("rope_type", "default") if isinstance(rope_parameters, dict) else "default"
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} is not supported by Gemma in Archon; "
            "only the default RoPE is. Port the variant with `archon-port add`."
        )
    if bool(getattr(hf_config, "attention_bias", False)) is not False:
        raise ValueError(
            "attention_bias=True is not supported: Gemma checkpoints have no "
            "such bias; port that variant as its own family."
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", hf_config.attention_dropout)


def _eos_id(hf_config: Any, default: int) -> int:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return default if eos is None else int(eos)


@dataclass
class GemmaModelArgs(BaseModelArgs):
    """Gemma hyper-parameters. Defaults are those of transformers' ``GemmaConfig``."""

    dim: int = 3072
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 16
    vocab_size: int = 256_000
    head_dim: int = 256
    hidden_dim: int = 24_576
    norm_eps: float = 1e-06
    rope_theta: float = 10000.0
    max_seq_len: int = 8192
    depth_init: bool = True
    eos_id: int = 1
    enable_weight_tying: bool = True
    is_critic: bool = False
    num_labels: int = 1

    def __post_init__(self) -> None:
        if self.attn_type not in ("varlen", "sdpa"):
            raise ValueError(f"attn_type must be 'varlen' or 'sdpa', got {self.attn_type!r}.")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})."
            )

    @classmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False, **kwargs: Any) -> GemmaModelArgs:
        """Map a ``GemmaConfig``.

        Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``) and
        ``num_labels`` (outputs of a critic's ``score`` head, default 1). Others that
        AReaL's engine passes (``router_dtype``) are ignored, as AReaL's own
        ``from_hf_config`` ignores them: a dense model has no router.
        ``eos_token_id`` of ``None`` keeps the default; a list takes its first id.
        """
        missing = [name for name in _REQUIRED_HF_FIELDS if getattr(hf_config, name, None) is None]
        if missing:
            raise ValueError(
                f"{type(hf_config).__name__} lacks required field(s) {missing}; a Gemma config "
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
            eos_id=_eos_id(hf_config, cls.eos_id),
            enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
            is_critic=is_critic,
            num_labels=kwargs.get("num_labels", cls.num_labels),
        )
