"""Qwen3.5 (text, dense and MoE) hyper-parameters and their mapping from ``Qwen3_5TextConfig`` /
``Qwen3_5MoeTextConfig``.

Qwen3.5 is a hybrid: ``layer_types`` says, per layer, whether its token mixer is gated
full attention (``"full_attention"``) or a Gated DeltaNet (``"linear_attention"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from archon_models.base import BaseModelArgs
from archon_models.moe import MoEArgs

logger = logging.getLogger(__name__)

__all__ = ["LAYER_TYPES", "Qwen3_5ModelArgs"]

# The token mixers this package implements, by HF's ``layer_types`` name.
LAYER_TYPES = ("full_attention", "linear_attention")

_REQUIRED_HF_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "rms_norm_eps",
    "layer_types",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def _check_supported(hf_config: Any) -> None:
    """Refuse configs whose maths this implementation does not reproduce."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            "Qwen3.5 in Archon implements the SwiGLU MLP and the Gated DeltaNet's convolution with silu; "
            f"hidden_act={act!r} is not supported."
        )
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} is not supported: "
            "Qwen3.5 in Archon implements the default RoPE only."
        )
    unknown = sorted(set(hf_config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types holds {unknown}; this package implements {list(LAYER_TYPES)} only.")
    if hf_config.linear_num_value_heads % hf_config.linear_num_key_heads != 0:
        raise ValueError(
            f"linear_num_value_heads ({hf_config.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({hf_config.linear_num_key_heads}): each key head serves a group of value heads."
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", hf_config.attention_dropout)


_REQUIRED_DENSE_HF_FIELDS = ("intermediate_size",)
_REQUIRED_MOE_HF_FIELDS = ("moe_intermediate_size", "num_experts_per_tok", "shared_expert_intermediate_size")


def _eos_id(hf_config: Any, default: int) -> int:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return default if eos is None else int(eos)


@dataclass
class Qwen3_5ModelArgs(BaseModelArgs):
    """Qwen3.5 (text) hyper-parameters. Defaults are ``Qwen3_5TextConfig``'s.

    Full-attention layers: ``n_heads`` query heads of ``head_dim`` (the query projection is
    twice as wide, the second half of each head being a sigmoid output gate), ``n_kv_heads``
    key/value heads, per-head ``(1 + w)`` RMSNorm on queries and keys, and RoPE on the first
    ``partial_rotary_factor`` of each head. Linear-attention layers: a Gated DeltaNet with
    ``linear_num_key_heads`` query/key heads of ``linear_key_head_dim`` and
    ``linear_num_value_heads`` value heads of ``linear_value_head_dim``, after a causal
    depthwise convolution of ``linear_conv_kernel_dim`` taps.

    MoE (when the config has experts): the MLP of each layer ``is_moe_layer`` names is a MoE of
    ``moe_inter_dim``-wide experts under top-k softmax routing (``moe_args.route_norm``: the
    top-k weights renormalised), beside one shared expert scaled by
    ``sigmoid(shared_expert_gate(x))``; any other layer's MLP is dense, ``hidden_dim`` wide.
    HF's router auxiliary loss is a training objective, not part of the forward pass, and is not
    computed here.

    ``pad_id`` (the config's ``pad_token_id``) is the embedding row HF's
    ``nn.Embedding(padding_idx=...)`` gives no gradient; so does ``tok_embeddings`` here.
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 16
    n_kv_heads: int = 4
    vocab_size: int = 248320
    head_dim: int = 256
    hidden_dim: int = 12288
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    max_seq_len: int = 32768
    depth_init: bool = True
    attention_bias: bool = False
    eos_id: int = 151645  # AReaL's default; from_hf_config takes the config's
    pad_id: int | None = None
    enable_weight_tying: bool = False
    is_critic: bool = False
    num_labels: int = 1

    moe_inter_dim: int = 512
    moe_args: MoEArgs | None = None

    layer_types: list[str] = field(default_factory=list)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    def __post_init__(self) -> None:
        if self.attn_type not in ("varlen", "sdpa"):
            raise ValueError(f"attn_type must be 'varlen' or 'sdpa', got {self.attn_type!r}.")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}).")
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.n_layers
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}.")

    @property
    def moe_enabled(self) -> bool:
        return self.moe_args is not None

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) routes its tokens to experts: every layer, when the
        config has experts (Qwen3.5-MoE's rule)."""
        return self.moe_args is not None

    @property
    def rotary_dim(self) -> int:
        """How many leading features of each head RoPE rotates (HF: ``int(head_dim * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False, **kwargs: Any) -> Qwen3_5ModelArgs:
        """Map the text config (dense, or with experts).

        Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``), ``num_labels``
        (outputs of a critic's ``score`` head, default 1) and ``router_dtype`` (dtype of the
        router GEMM; reaches ``MoEArgs.router_dtype``). Any other keyword is ignored, as AReaL's
        own ``from_hf_config`` ignores it.
        """
        moe = bool(getattr(hf_config, "num_experts", None))
        required = _REQUIRED_HF_FIELDS + (_REQUIRED_MOE_HF_FIELDS if moe else _REQUIRED_DENSE_HF_FIELDS)
        missing = [name for name in required if getattr(hf_config, name, None) is None]
        if missing:
            raise ValueError(
                f"{type(hf_config).__name__} lacks required field(s) {missing}; "
                f"this package's config must set all of {list(required)}."
            )
        _check_supported(hf_config)
        moe_args = None
        if moe:
            moe_args = MoEArgs.from_hf_config(hf_config)
            # Qwen3.5-MoE's router renormalises its top-k weights whatever the config says.
            moe_args.route_norm = True
            # One shared expert, gated by sigmoid(shared_expert_gate(x)), runs beside the routed
            # ones; AReaL's MoEArgs.from_hf_config reads neither.
            moe_args.shared_expert_intermediate_size = hf_config.shared_expert_intermediate_size
            moe_args.use_shared_expert_gate = True
            router_dtype: torch.dtype | None = kwargs.get("router_dtype")
            if router_dtype is not None:
                moe_args.router_dtype = router_dtype
        rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
        n_heads = hf_config.num_attention_heads
        return cls(
            attn_type=kwargs.get("attn_type", BaseModelArgs.attn_type),
            dim=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            vocab_size=hf_config.vocab_size,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads,
            hidden_dim=getattr(hf_config, "intermediate_size", None) or cls.hidden_dim,
            moe_inter_dim=getattr(hf_config, "moe_intermediate_size", None) or cls.moe_inter_dim,
            moe_args=moe_args,
            norm_eps=hf_config.rms_norm_eps,
            rope_theta=cls._get_rope_theta(hf_config, cls.rope_theta),
            partial_rotary_factor=float(rope_parameters.get("partial_rotary_factor", 1.0)),
            max_seq_len=getattr(hf_config, "max_position_embeddings", None) or cls.max_seq_len,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            eos_id=_eos_id(hf_config, cls.eos_id),
            pad_id=getattr(hf_config, "pad_token_id", None),
            enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
            is_critic=is_critic,
            num_labels=kwargs.get("num_labels", cls.num_labels),
            layer_types=list(hf_config.layer_types),
            linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
            linear_key_head_dim=hf_config.linear_key_head_dim,
            linear_value_head_dim=hf_config.linear_value_head_dim,
            linear_num_key_heads=hf_config.linear_num_key_heads,
            linear_num_value_heads=hf_config.linear_num_value_heads,
        )
