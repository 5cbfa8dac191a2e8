"""Qwen3 (dense and MoE) hyper-parameters and their mapping from ``Qwen3Config`` / ``Qwen3MoeConfig``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from archon_models.base import BaseModelArgs
from archon_models.moe import MoEArgs

logger = logging.getLogger(__name__)

__all__ = ["Qwen3ModelArgs"]

_REQUIRED_HF_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "rms_norm_eps",
)
_REQUIRED_MOE_HF_FIELDS = ("moe_intermediate_size", "num_experts_per_tok")


def _check_supported(hf_config: Any) -> None:
    """Refuse configs whose math this implementation does not reproduce."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Qwen3 in Archon implements SwiGLU with silu; hidden_act={act!r} is not supported.")
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope_parameters.get("rope_type", "default") if isinstance(rope_parameters, dict) else "default"
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} is not supported by the Qwen3 reference; "
            "only the default RoPE is."
        )
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) and "sliding_attention" in layer_types:
        raise ValueError(
            "use_sliding_window=True with sliding_attention layers is not supported by the Qwen3 "
            "reference, which attends over whole documents."
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", hf_config.attention_dropout)


def _eos_id(hf_config: Any, default: int) -> int:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return default if eos is None else int(eos)


def _num_experts(hf_config: Any) -> int:
    for name in ("num_experts", "num_local_experts"):
        value = getattr(hf_config, name, None)
        if value is not None:
            return int(value)
    return 0


@dataclass
class Qwen3ModelArgs(BaseModelArgs):
    """Qwen3 hyper-parameters. Defaults are those of Qwen3-0.6B (dense).

    Every attention layer normalises queries and keys per head (``q_norm``/``k_norm``
    over ``head_dim``). MoE fields (``qwen3_moe``): layer ``i`` is sparse iff
    ``moe_args`` is set, ``i not in mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``; its experts are ``moe_inter_dim`` wide.
    HF's router auxiliary loss (``router_aux_loss_coef``) is a training objective, not
    part of the forward pass, and is not computed here.

    ``pad_id`` (the config's ``pad_token_id``) is the embedding row HF's
    ``nn.Embedding(padding_idx=...)`` gives no gradient through its lookups; so does
    ``tok_embeddings`` here (``None``: every row trains).
    """

    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    vocab_size: int = 151936
    head_dim: int = 128
    hidden_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    depth_init: bool = True
    attention_bias: bool = False
    eos_id: int = 151645
    pad_id: int | None = None
    enable_weight_tying: bool = True
    is_critic: bool = False
    num_labels: int = 1

    moe_inter_dim: int = 768
    moe_args: MoEArgs | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.attn_type not in ("varlen", "sdpa"):
            raise ValueError(f"attn_type must be 'varlen' or 'sdpa', got {self.attn_type!r}.")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}).")
        if self.moe_args is not None and self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1 for a MoE model, got {self.decoder_sparse_step}.")

    @property
    def moe_enabled(self) -> bool:
        return self.moe_args is not None

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) is a sparse MoE layer, by HF's rule."""
        return (
            self.moe_args is not None
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False, **kwargs: Any) -> Qwen3ModelArgs:
        """Map a ``Qwen3Config`` (dense) or ``Qwen3MoeConfig`` (MoE when it has experts).

        Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``), ``num_labels``
        (outputs of a critic's ``score`` head, default 1) and ``router_dtype`` (dtype of
        the router GEMM; reaches ``MoEArgs.router_dtype``). Any other keyword is
        ignored, as AReaL's own ``from_hf_config`` ignores it. ``eos_token_id`` of
        ``None`` keeps the default; a list takes its first id.
        """
        num_experts = _num_experts(hf_config)
        required = _REQUIRED_HF_FIELDS + (_REQUIRED_MOE_HF_FIELDS if num_experts > 0 else ())
        missing = [name for name in required if getattr(hf_config, name, None) is None]
        if missing:
            raise ValueError(
                f"{type(hf_config).__name__} lacks required field(s) {missing}; a Qwen3 config "
                f"must set all of {list(required)}."
            )
        _check_supported(hf_config)

        moe_args = None
        if num_experts > 0:
            moe_args = MoEArgs.from_hf_config(hf_config)
            router_dtype: torch.dtype | None = kwargs.get("router_dtype")
            if router_dtype is not None:
                moe_args.router_dtype = router_dtype

        n_heads = hf_config.num_attention_heads
        return cls(
            attn_type=kwargs.get("attn_type", BaseModelArgs.attn_type),
            dim=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            vocab_size=hf_config.vocab_size,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads,
            hidden_dim=hf_config.intermediate_size,
            norm_eps=hf_config.rms_norm_eps,
            rope_theta=cls._get_rope_theta(hf_config, cls.rope_theta),
            max_seq_len=getattr(hf_config, "max_position_embeddings", None) or cls.max_seq_len,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            eos_id=_eos_id(hf_config, cls.eos_id),
            pad_id=getattr(hf_config, "pad_token_id", None),
            enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
            is_critic=is_critic,
            num_labels=kwargs.get("num_labels", cls.num_labels),
            moe_inter_dim=getattr(hf_config, "moe_intermediate_size", None) or cls.moe_inter_dim,
            moe_args=moe_args,
            decoder_sparse_step=getattr(hf_config, "decoder_sparse_step", None) or 1,
            mlp_only_layers=list(getattr(hf_config, "mlp_only_layers", None) or []),
        )
