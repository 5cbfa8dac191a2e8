"""DeepSeek-V3 hyper-parameters and their mapping from a transformers ``DeepseekV3Config``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from archon_models.base import BaseModelArgs
from archon_models.moe import MoEArgs

logger = logging.getLogger(__name__)

__all__ = ["DeepseekV3ModelArgs", "YarnArgs"]

_REQUIRED_HF_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "intermediate_size",
    "rms_norm_eps",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
_REQUIRED_MOE_HF_FIELDS = ("moe_intermediate_size", "num_experts_per_tok")


@dataclass
class YarnArgs:
    """YaRN RoPE scaling (HF ``rope_parameters`` with ``rope_type="yarn"``).

    ``factor`` stretches the context ``original_max_seq_len`` was trained on; the
    frequencies between the ``beta_fast`` and ``beta_slow`` correction dimensions are
    interpolated; ``cos``/``sin`` are multiplied by ``attention_factor`` (derived from
    ``mscale``/``mscale_all_dim`` when unset); with ``mscale_all_dim`` the softmax
    scale is multiplied by ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2``.
    """

    factor: float = 40.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    rope_parameters = getattr(hf_config, "rope_parameters", None)
    if isinstance(rope_parameters, dict):
        return rope_parameters
    return getattr(hf_config, "rope_scaling", None) or {}


def _yarn_args(hf_config: Any) -> YarnArgs | None:
    """The YaRN parameters of ``hf_config``, ``None`` for the default RoPE; any other type is refused."""
    rope = _rope_parameters(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} is not supported by this multi-head latent "
            "attention model; only the default RoPE and yarn are."
        )
    max_seq_len = getattr(hf_config, "max_position_embeddings", None)
    original = rope.get("original_max_position_embeddings") or max_seq_len
    factor = rope.get("factor")
    if factor is None:
        # As transformers does: the stretch is the ratio of the two context lengths.
        factor = max_seq_len / original
    return YarnArgs(
        factor=float(factor),
        original_max_seq_len=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def _check_supported(hf_config: Any) -> None:
    """Refuse configs whose math this implementation does not reproduce."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"This model implements SwiGLU with silu; hidden_act={act!r} is not supported.")
    n_heads = hf_config.num_attention_heads
    n_kv_heads = getattr(hf_config, "num_key_value_heads", None) or n_heads
    if n_kv_heads != n_heads:
        # kv_b_proj expands the latent into one key and value per query head; a smaller
        # num_key_value_heads would make HF repeat those heads past num_attention_heads.
        raise ValueError(
            f"num_key_value_heads={n_kv_heads} differs from num_attention_heads={n_heads}: multi-head latent "
            "attention expands the latent KV into one key/value head per query head."
        )
    if getattr(hf_config, "attention_dropout", 0.0):
        logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", hf_config.attention_dropout)


def _eos_id(hf_config: Any, default: int) -> int:
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return default if eos is None else int(eos)


def _moe_args(hf_config: Any, router_dtype: torch.dtype | None, load_balance_coeff: float | None) -> MoEArgs | None:
    """DeepSeek-V3 routing in AReaL's ``MoEArgs`` terms; ``None`` when the config has no routed experts.

    Sigmoid scores; the score-correction bias (``expert_bias``) shifts which experts are
    chosen, not their weights; the best ``topk_group`` of ``n_group`` groups (each scored
    by its two best experts) compete; the chosen scores are renormalised when
    ``norm_topk_prob`` and then multiplied by ``routed_scaling_factor``. One group is no
    limit at all, so it needs no grouping.
    """
    num_experts = getattr(hf_config, "n_routed_experts", None)
    if not num_experts:
        return None
    n_group = getattr(hf_config, "n_group", None) or 1
    topk_group = getattr(hf_config, "topk_group", None) or n_group
    return MoEArgs(
        num_experts=int(num_experts),
        num_shared_experts=int(getattr(hf_config, "n_shared_experts", None) or 0),
        top_k=int(hf_config.num_experts_per_tok),
        score_func="sigmoid",
        route_norm=bool(getattr(hf_config, "norm_topk_prob", False)),
        route_scale=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
        # HF computes the router GEMM in fp32 whatever the model dtype.
        router_dtype=router_dtype if router_dtype is not None else torch.float32,
        num_expert_groups=int(n_group) if n_group > 1 else None,
        num_limited_groups=int(topk_group) if n_group > 1 else None,
        # None: the checkpoint's bias stays as loaded; a value opts into balancing it.
        load_balance_coeff=load_balance_coeff,
    )


@dataclass
class DeepseekV3ModelArgs(BaseModelArgs):
    """DeepSeek-V3 hyper-parameters. Defaults are those of DeepSeek-V3 (671B).

    Multi-head latent attention: queries come from ``wq`` (``q_lora_rank is None``) or
    through a ``q_lora_rank`` latent (``wq_a``, ``q_norm``, ``wq_b``); keys and values
    from one ``kv_lora_rank`` latent (``wkv_a``, ``kv_norm``, ``wkv_b``) plus a single
    ``qk_rope_head_dim`` RoPE key shared by every head. A query/key head is
    ``qk_nope_head_dim + qk_rope_head_dim`` wide, a value head ``v_head_dim``.
    ``rope_interleave`` rotates adjacent feature pairs (DeepSeek's layout) instead of
    halves. There is no single ``head_dim``; ``n_kv_heads`` equals ``n_heads``.

    MoE: layer ``i`` is sparse iff ``moe_args`` is set and ``i >= first_k_dense_replace``;
    its routed and shared experts are ``moe_inter_dim`` wide, the leading dense layers'
    MLPs ``hidden_dim``. The multi-token-prediction layers of published checkpoints
    (``num_nextn_predict_layers``) are not part of the forward pass and are not built.

    ``pad_id`` (the config's ``pad_token_id``) is the embedding row HF's
    ``nn.Embedding(padding_idx=...)`` gives no gradient through its lookups; so does
    ``tok_embeddings`` here (``None``: every row trains).
    """

    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    n_kv_heads: int = 128
    vocab_size: int = 129280
    hidden_dim: int = 18432
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    depth_init: bool = True
    attention_bias: bool = False
    eos_id: int = 1
    pad_id: int | None = None
    enable_weight_tying: bool = False
    is_critic: bool = False
    num_labels: int = 1

    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    yarn: YarnArgs | None = None

    moe_inter_dim: int = 2048
    moe_args: MoEArgs | None = None
    first_k_dense_replace: int = 3

    def __post_init__(self) -> None:
        if self.attn_type not in ("varlen", "sdpa"):
            raise ValueError(f"attn_type must be 'varlen' or 'sdpa', got {self.attn_type!r}.")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must equal n_heads ({self.n_heads}) under MLA.")
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}.")

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: the no-RoPE part, then the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_enabled(self) -> bool:
        return self.moe_args is not None

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` (0-based) is a sparse MoE layer, by HF's rule."""
        return self.moe_args is not None and layer_id >= self.first_k_dense_replace

    @classmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False, **kwargs: Any) -> DeepseekV3ModelArgs:
        """Map a ``DeepseekV3Config``.

        Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``), ``num_labels``
        (outputs of a critic's ``score`` head, default 1), ``router_dtype`` (dtype of the
        router GEMM; ``None`` keeps HF's fp32) and ``load_balance_coeff`` (opts into
        auxiliary-loss-free balancing of the score-correction bias, AReaL's
        ``MoEArgs.load_balance_coeff``; by default the checkpoint's bias stays fixed in
        training). Any other keyword is ignored, as AReaL's own ``from_hf_config`` ignores
        it. ``eos_token_id`` of ``None`` keeps the default; a list takes its first id.
        """
        has_experts = bool(getattr(hf_config, "n_routed_experts", None))
        required = _REQUIRED_HF_FIELDS + (_REQUIRED_MOE_HF_FIELDS if has_experts else ())
        missing = [name for name in required if getattr(hf_config, name, None) is None]
        if missing:
            raise ValueError(
                f"{type(hf_config).__name__} lacks required field(s) {missing}; the config must set all "
                f"of {list(required)}."
            )
        _check_supported(hf_config)

        n_heads = hf_config.num_attention_heads
        q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        return cls(
            attn_type=kwargs.get("attn_type", BaseModelArgs.attn_type),
            dim=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            vocab_size=hf_config.vocab_size,
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
            q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
            kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
            yarn=_yarn_args(hf_config),
            moe_inter_dim=getattr(hf_config, "moe_intermediate_size", None) or cls.moe_inter_dim,
            moe_args=_moe_args(hf_config, kwargs.get("router_dtype"), kwargs.get("load_balance_coeff")),
            first_k_dense_replace=getattr(hf_config, "first_k_dense_replace", None) or 0,
        )
