"""Step 3: the args dataclass and ``from_hf_config``, checked field by field on real configs."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import operator
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from skill.analysis.reference import EDITABLE_REFERENCES
from skill.codemod import StagedTree
from skill.codemod.cst import (
    CodemodError,
    Document,
    append_to_function,
    class_field_names,
    remove_function,
    remove_method,
    remove_statements,
    replace_function,
    replace_in_function,
    replace_text,
    set_call_kwarg,
    set_class_fields,
    set_docstring,
    set_module_assign,
    upsert_function,
)
from skill.features import ConfigScalar
from skill.porting.common import (
    PackageLayout,
    SourceRequest,
    StepResult,
    require_file,
    require_package,
    staged,
    write_if_changed,
)
from skill.porting.dense_mla import dense_args
from skill.porting.hf_source import load_config
from skill.porting.hybrid_package import HYBRID_REFERENCE, hybrid_args
from skill.porting.mla_router import router_args
from skill.porting.plan import PortPlan, plan_for, refuse_unedited_reference, refuse_unsupported, skipped_features
from skill.porting.reference_choice import check_reference_fits
from skill.snippets import snippet, snippet_method
from skill.snippets.args import (
    _layer_partial_rotary_factor,
    _layer_rope_freq_scaling,
    _layer_rope_parameters,
)
from skill.snippets.moe_layers import RULES as MOE_LAYER_RULES
from skill.tiny_model import tiny_config

logger = logging.getLogger(__name__)

# max_seq_len of a family whose config has no max_position_embeddings (qwen2's default).
UNBOUNDED_MAX_SEQ_LEN = 131072
CORE_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Config flags that change which parameters exist; a port is specialised to one value.
STRUCTURAL_FLAGS = {
    "attention_bias": "qkv_bias",
    "mlp_bias": "mlp_bias",
    "use_bias": "qkv_bias",
    "use_qkv_bias": "qkv_bias",
}
# Config switches for features no edit writes: a port refuses a config that turns them on.
ABSENT_FEATURE_FLAGS = {
    "use_parallel_residual": "parallel attention and MLP residual branches",
    "qk_layernorm": "QK LayerNorm",
    "alibi": "ALiBi position biases",
    "new_decoder_architecture": "separate attention and MLP input norms with grouped KV heads",
}
# Config switches of features an edit writes: a port that has the feature refuses a config
# that turns it off (config flag -> PortPlan property, and what it switches).
PRESENT_FEATURE_FLAGS = {
    "use_parallel_residual": ("parallel_block", "parallel attention and MLP residual branches"),
    "parallel_attn": ("parallel_block", "parallel attention and MLP residual branches"),
    "multi_query": ("single_kv_head", "multi-query attention (one key and value head)"),
}
# Of the absent-feature switches, those of a QK norm: a port that has one refuses a config
# turning it off.
QK_NORM_FLAGS = ("qk_layernorm",)


@dataclass(frozen=True)
class ArgField:
    """One Archon args field: its annotation, default, the expression reading it, and
    an independent way to compute the value it must get from a config."""

    name: str
    annotation: str
    default: Any
    expression: str
    expected: Callable[[Any], Any]
    default_source: str | None = None  # written verbatim instead of the default's literal


def _eos(config: Any, default: int) -> int:
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return default if eos is None else int(eos)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def dense_width_field(profile: PortPlan, config: Any) -> str:
    """The config field ``hidden_dim`` reads: the dense MLP width, or, for a family whose
    every layer routes to experts and whose config names no dense width, the experts'."""
    if profile.all_layers_moe and not hasattr(config, "intermediate_size") and hasattr(config, "moe_intermediate_size"):
        return "moe_intermediate_size"
    return profile.ffn_width_field or "intermediate_size"


def _norm_eps_arg(profile: PortPlan, config: Any) -> ArgField:
    """``norm_eps``: the config's field, or the modeling code's constant where no field
    sets it (the default then stands; ``from_hf_config`` passes nothing)."""
    fixed = profile.norm_eps_fixed
    if fixed is not None:
        return ArgField("norm_eps", "float", fixed, "", lambda c: fixed)
    eps = profile.norm_eps_field
    return ArgField("norm_eps", "float", float(getattr(config, eps)), f"hf_config.{eps}", lambda c: getattr(c, eps))


def _dense_width_arg(profile: PortPlan, config: Any) -> ArgField:
    """``hidden_dim``: the config's width field, or, where that field may be ``None``
    (GPT-2's ``n_inner``) or there is none (Bloom), that many times the hidden size, or a
    ratio field times the hidden size (MPT's ``expansion_ratio``)."""
    ratio = profile.ffn_width_ratio_field
    if ratio is not None:

        def scaled(c: Any) -> int:
            return int(getattr(c, ratio) * c.hidden_size)

        return ArgField("hidden_dim", "int", scaled(config), f"int(hf_config.{ratio} * hf_config.hidden_size)", scaled)
    multiple = profile.ffn_width_multiple
    if multiple is not None and profile.ffn_width_field is None:
        # No config field sets the width: the modeling code's fixed multiple of the hidden size.
        return ArgField(
            "hidden_dim",
            "int",
            multiple * config.hidden_size,
            f"{multiple} * hf_config.hidden_size",
            lambda c: multiple * c.hidden_size,
        )
    dense = dense_width_field(profile, config)
    if multiple is None:
        return ArgField("hidden_dim", "int", getattr(config, dense), f"hf_config.{dense}", lambda c: getattr(c, dense))

    def width(c: Any) -> int:
        return getattr(c, dense, None) or multiple * c.hidden_size

    return ArgField(
        "hidden_dim",
        "int",
        width(config),
        f'getattr(hf_config, "{dense}", None) or {multiple} * hf_config.hidden_size',
        width,
    )


def arg_fields(profile: PortPlan, config: Any) -> list[ArgField]:
    """The fields of the family's args, defaults from ``config`` (the config class defaults)."""
    eos_default = _eos(config, 0)
    # A family whose positions no table bounds (ALiBi: Bloom) may have no such field; the
    # reference's default stands then.
    max_len = getattr(config, "max_position_embeddings", None) or UNBOUNDED_MAX_SEQ_LEN
    fields = [
        ArgField("dim", "int", config.hidden_size, "hf_config.hidden_size", lambda c: c.hidden_size),
        ArgField(
            "n_layers", "int", config.num_hidden_layers, "hf_config.num_hidden_layers", lambda c: c.num_hidden_layers
        ),
        ArgField("n_heads", "int", config.num_attention_heads, "n_heads", lambda c: c.num_attention_heads),
        ArgField(
            "n_kv_heads",
            "int",
            1 if profile.single_kv_head else getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "n_kv_heads",
            (lambda c: 1)
            if profile.single_kv_head
            else (lambda c: getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
        ),
        ArgField("vocab_size", "int", config.vocab_size, "hf_config.vocab_size", lambda c: c.vocab_size),
        ArgField("head_dim", "int", _head_dim(config), "head_dim", _head_dim),
        _dense_width_arg(profile, config),
        _norm_eps_arg(profile, config),
        *_rope_theta_fields(profile, config),
        ArgField(
            "max_seq_len",
            "int",
            max_len,
            'getattr(hf_config, "max_position_embeddings", None) or cls.max_seq_len',
            lambda c: getattr(c, "max_position_embeddings", None) or max_len,
        ),
        ArgField("depth_init", "bool", True, "", lambda c: True),
    ]
    if profile.rope_type != "default":
        fields += _rope_scaling_fields(profile, config)
    if profile.layer_rotary_dims:
        # Each layer type rotates the share of a head its own rope_parameters give.
        fields += _layer_rotary_dim_fields(config)
    elif profile.partial_rotary and isinstance(getattr(config, "rotary_dim", None), int):
        # The config names the rotated width itself (GPT-J, CodeGen: rotary_dim).
        fields.append(
            ArgField("rotary_dim", "int", config.rotary_dim, "hf_config.rotary_dim", operator.attrgetter("rotary_dim"))
        )
    elif profile.partial_rotary:
        fields.append(
            ArgField(
                "rotary_dim",
                "int",
                int(_head_dim(config) * _partial_factor(config)),
                "int(head_dim * _partial_rotary_factor(hf_config))",
                lambda c: int(_head_dim(c) * _partial_factor(c)),
            )
        )
    if profile.embedding_projection_field is not None:
        # The embeddings' (and the LM head's) width; projected to and from dim where it differs.
        width = profile.embedding_projection_field
        fields.append(
            ArgField(width, "int", int(getattr(config, width)), f"hf_config.{width}", operator.attrgetter(width))
        )
    if profile.clip_qkv_field is not None:
        clip = profile.clip_qkv_field
        fields.append(
            ArgField(
                "clip_qkv",
                "float | None",
                getattr(config, clip),
                f"hf_config.{clip}",
                operator.attrgetter(clip),
            )
        )
    if profile.query_position_scale is not None:
        # The constants of the queries' position scale (config paths, rope_parameters.<key>).
        scale = profile.query_position_scale
        fields += [
            _config_path_arg("query_scale_beta", scale.beta_field, float, config),
            _config_path_arg("query_scale_period", scale.period_field, int, config),
        ]
    if profile.position_zero_row_field is not None:
        # The row of the sinusoidal table the checkpoint's code zeroes (XGLM: pad_token_id).
        zero = profile.position_zero_row_field
        fields.append(
            ArgField(zero, "int | None", getattr(config, zero), f"hf_config.{zero}", operator.attrgetter(zero))
        )
    if profile.sliding_window:
        # None (whole documents) where HF's config class allows it and means it.
        window = profile.window_field
        nullable = window in profile.nullable_fields
        fields.append(
            ArgField(
                "sliding_window",
                "int | None" if nullable else "int",
                getattr(config, window) if nullable else int(getattr(config, window)),
                f"hf_config.{window}",
                operator.attrgetter(window),
            )
        )
    chunked = profile.chunked_attention
    if chunked is not None:
        # The chunk length of chunked local attention (on every layer, or on those of one kind).
        size = chunked.size_field
        fields.append(ArgField(size, "int", int(getattr(config, size)), f"hf_config.{size}", operator.attrgetter(size)))
    chunked_by_kind = chunked is not None and chunked.chunked_kind is not None
    if profile.sliding_layer_types or profile.per_layer_rope or profile.nope_layer_type or chunked_by_kind:
        # Each layer's kind: layer_types, or the field that marks the windowed layers (GPT-Neo's
        # attention_layers; the analysis refuses it beside RoPE or NoPE chosen by layer_types).
        kinds = profile.layer_kinds_field if profile.sliding_layer_types else "layer_types"
        fields.append(
            ArgField(
                "layer_types",
                "tuple[str, ...]",
                tuple(getattr(config, kinds)),
                f"tuple(hf_config.{kinds})",
                lambda c: tuple(getattr(c, kinds)),
            )
        )
    if profile.nope_field or profile.nope_layer_type:
        fields.append(_nope_layers_field(profile, config))
    for name, wanted in (
        ("attn_logit_softcapping", profile.attn_softcap),
        ("final_logit_softcapping", profile.final_softcap),
    ):
        if wanted and name in profile.nullable_fields:
            # None: no cap, as HF's forward reads it.
            value = getattr(config, name)
            default = None if value is None else float(value)
            fields.append(ArgField(name, "float | None", default, f"hf_config.{name}", operator.attrgetter(name)))
        elif wanted:
            fields.append(
                ArgField(name, "float", float(getattr(config, name)), f"hf_config.{name}", operator.attrgetter(name))
            )
    if profile.moe:
        from archon_models.moe import MoEArgs

        # Expert width: its own field where the family has one, else the MLP width.
        width = "moe_intermediate_size" if hasattr(config, "moe_intermediate_size") else "intermediate_size"

        def expected_moe_args(c: Any) -> Any:
            moe_args = MoEArgs.from_hf_config(c)
            if profile.route_norm:
                moe_args.route_norm = True
            if profile.shared_expert:
                # The checkpoint holds a gated shared expert; its width is the config's.
                moe_args.shared_expert_intermediate_size = c.shared_expert_intermediate_size
                moe_args.use_shared_expert_gate = True
            if profile.expert_count_field is not None:
                moe_args.num_experts = getattr(c, profile.expert_count_field)
            if profile.top_k_field is not None:
                moe_args.top_k = getattr(c, profile.top_k_field)
            if profile.shared_experts_field is not None:
                moe_args.num_shared_experts = getattr(c, profile.shared_experts_field) or 0
            if profile.shared_experts_fixed is not None:
                moe_args.num_shared_experts = profile.shared_experts_fixed
            if profile.shared_expert_width_field is not None:
                moe_args.shared_expert_intermediate_size = getattr(c, profile.shared_expert_width_field)
            if profile.router_scoring_field is not None:
                moe_args.score_func = getattr(c, profile.router_scoring_field)
            elif profile.router_scoring == "sigmoid":
                moe_args.score_func = "sigmoid"
            if profile.score_before_experts:
                moe_args.score_before_experts = True
            if profile.routed_scaling_field is not None:
                moe_args.route_scale = float(getattr(c, profile.routed_scaling_field))
            if profile.expert_group_fields is not None:
                groups, kept = (getattr(c, f) for f in profile.expert_group_fields)
                if (groups or 1) > 1:
                    moe_args.num_expert_groups, moe_args.num_limited_groups = groups, kept
            # A score-correction bias stays fixed (load_balance_coeff None) unless the caller opts in.
            return moe_args

        fields += [
            ArgField(
                "moe_inter_dim",
                "int",
                getattr(config, width),
                f"hf_config.{width}",
                lambda c: getattr(c, width),
            ),
            _moe_args_field(profile, config, expected_moe_args),
        ]
        if not profile.all_layers_moe:
            # Which layers route to experts (HF's rule); a family whose every layer is MoE has no such fields.
            fields += moe_layer_fields(profile, config)
    if profile.router_jitter_field is not None:
        # The sparse mixer's relative margin around each pick (not noise at evaluation time).
        jitter = profile.router_jitter_field
        fields.append(
            ArgField(
                jitter, "float", float(getattr(config, jitter)), f"hf_config.{jitter}", operator.attrgetter(jitter)
            )
        )
    for field_name in profile.expert_activation_fields.values():
        # The clamped SwiGLU experts' constants (alpha, limit), as the config sets them; a
        # config without the field (transformers 5.3 hard-codes the constants) gets the default.
        default = float(getattr(config, field_name))
        fields.append(
            ArgField(
                field_name,
                "float",
                default,
                f'float(getattr(hf_config, "{field_name}", cls.{field_name}))',
                functools.partial(_float_or, name=field_name, default=default),
            )
        )
    fields += [scalar_arg(profile, name, config) for name in profile.multipliers]
    fields += [
        ArgField("eos_id", "int", eos_default, "_eos_id(hf_config, cls.eos_id)", lambda c: _eos(c, eos_default)),
        _tying_arg(profile, config),
        *_padding_idx_args(profile, config),
        ArgField("is_critic", "bool", False, "is_critic", lambda c: False),
        ArgField("num_labels", "int", 1, 'kwargs.get("num_labels", cls.num_labels)', lambda c: 1),
    ]
    return fields


def moe_layer_fields(plan: PortPlan, config: Any) -> list[ArgField]:
    """The args fields the family's per-layer MoE rule reads (``plan.moe_layer_rule``)."""
    rule = plan.moe_layer_rule
    if rule == "first_k_dense":
        # The config field counting the leading dense layers, as the analysis measured it
        # (first_k_dense_replace, AFMoE's num_dense_layers).
        dense = plan.moe_layer_fields[0] if plan.moe_layer_fields else "first_k_dense_replace"
        return [
            ArgField(
                "first_k_dense_replace",
                "int",
                int(getattr(config, dense) or 0),
                f"hf_config.{dense} or 0",
                lambda c: getattr(c, dense) or 0,
            )
        ]
    if rule == "layer_types":
        return [
            ArgField(
                "mlp_layer_types",
                "tuple[str, ...]",
                tuple(config.mlp_layer_types),
                "tuple(hf_config.mlp_layer_types)",
                lambda c: tuple(c.mlp_layer_types),
            )
        ]
    if rule == "start_end_interval":
        return [
            ArgField(name, "int", int(getattr(config, name)), f"hf_config.{name}", operator.attrgetter(name))
            for name in ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
        ]
    if rule == "sparse_step":
        return [
            ArgField(
                "decoder_sparse_step",
                "int",
                1,
                'getattr(hf_config, "decoder_sparse_step", None) or 1',
                lambda c: getattr(c, "decoder_sparse_step", None) or 1,
            ),
            ArgField(
                "mlp_only_layers",
                "list[int]",
                None,
                'list(getattr(hf_config, "mlp_only_layers", None) or [])',
                lambda c: list(getattr(c, "mlp_only_layers", None) or []),
                default_source="field(default_factory=list)",
            ),
        ]
    raise ValueError(f"{plan.model_type}: no edit writes the MoE layer rule {rule!r}")


def _layer_theta(config: Any, layer_type: str) -> float:
    return float(_layer_rope_parameters(config, layer_type)["rope_theta"])


def _rope_theta_fields(profile: PortPlan, config: Any) -> list[ArgField]:
    """``rope_theta``; with per-layer-type RoPE, the full-attention layers' base, and
    ``sliding_rope_theta`` the sliding-window layers'."""
    if not profile.per_layer_rope:
        return [
            ArgField(
                "rope_theta",
                "float",
                _rope_theta(config),
                "cls._get_rope_theta(hf_config, cls.rope_theta)",
                _rope_theta,
            )
        ]
    return [
        ArgField(
            name,
            "float",
            _layer_theta(config, kind),
            f'float(_layer_rope_parameters(hf_config, "{kind}")["rope_theta"])',
            functools.partial(_layer_theta, layer_type=kind),
        )
        for name, kind in (("rope_theta", "full_attention"), ("sliding_rope_theta", "sliding_attention"))
    ]


def _layer_rotary_dim(config: Any, layer_type: str) -> int:
    return int(_head_dim(config) * _layer_partial_rotary_factor(config, layer_type))


def _layer_rotary_dim_fields(config: Any) -> list[ArgField]:
    """Per-layer-type RoPE over part of each head: ``rotary_dim``, the features the
    full-attention layers rotate, and ``sliding_rotary_dim``, those the sliding-window
    layers rotate, each from its layer type's ``partial_rotary_factor``."""
    return [
        ArgField(
            name,
            "int",
            _layer_rotary_dim(config, kind),
            f'int(head_dim * _layer_partial_rotary_factor(hf_config, "{kind}"))',
            functools.partial(_layer_rotary_dim, layer_type=kind),
        )
        for name, kind in (("rotary_dim", "full_attention"), ("sliding_rotary_dim", "sliding_attention"))
    ]


def _padding_idx_args(profile: PortPlan, config: Any) -> list[ArgField]:
    """``pad_id``: the embedding row HF gives no gradient (its ``padding_idx``), read from the
    field the analysis probed (``pad_token_id``); none where HF trains every row."""
    field = profile.padding_idx_field
    if field is None:
        return []

    def pad(c: Any) -> int | None:
        value = getattr(c, field, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return [ArgField("pad_id", "int | None", pad(config), f'getattr(hf_config, "{field}", None)', pad)]


def _tying_arg(profile: PortPlan, config: Any) -> ArgField:
    """``enable_weight_tying``: the config field HF's tying follows, or, where HF ties (or
    keeps its own head) whatever the config says, what it does (the analysis probes both)."""
    field = profile.tying_field
    if field is None:
        return ArgField("enable_weight_tying", "bool", profile.tied, repr(profile.tied), lambda c: profile.tied)
    return ArgField(
        "enable_weight_tying",
        "bool",
        bool(getattr(config, field, False)),
        f'bool(getattr(hf_config, "{field}", False))',
        lambda c: bool(getattr(c, field, False)),
    )


def _config_path_arg(name: str, path: str, cast: type[int] | type[float], config: Any) -> ArgField:
    """An args field read from a config path (a field or ``rope_parameters.<key>``)."""

    def expected(c: Any) -> int | float:
        return cast(config_path_value(c, path))

    kind = cast.__name__
    return ArgField(name, kind, expected(config), f"{kind}({config_path_expression(path)})", expected)


def config_path_value(config: Any, path: str) -> Any:
    """A config value by the analysis' path: a field, or ``rope_parameters.<key>``."""
    if path.startswith("rope_parameters."):
        return (getattr(config, "rope_parameters", None) or {}).get(path.split(".", 1)[1])
    return getattr(config, path)


def config_path_expression(path: str) -> str:
    """The generated ``from_hf_config`` expression reading ``path`` off ``hf_config``."""
    if path.startswith("rope_parameters."):
        return f'hf_config.rope_parameters["{path.split(".", 1)[1]}"]'
    return f"hf_config.{path}"


def _rope_scaling_fields(profile: PortPlan, config: Any) -> list[ArgField]:
    """``rope_freq_scaling`` (``None`` for unscaled RoPE); with per-layer-type RoPE, one
    for the full-attention layers and ``sliding_rope_freq_scaling`` for the others."""
    if not profile.per_layer_rope:
        return [
            ArgField(
                "rope_freq_scaling",
                "dict[str, float] | None",
                None,
                "_rope_freq_scaling(hf_config)",
                _rope_scaling_of,
                default_source=f"field(default_factory=lambda: {_literal(_rope_scaling_of(config))})",
            )
        ]
    return [
        ArgField(
            name,
            "dict[str, float] | None",
            None,
            f'_layer_rope_freq_scaling(hf_config, "{kind}")',
            functools.partial(_layer_rope_freq_scaling, layer_type=kind),
            default_source=f"field(default_factory=lambda: {_literal(_layer_rope_freq_scaling(config, kind))})",
        )
        for name, kind in (("rope_freq_scaling", "full_attention"), ("sliding_rope_freq_scaling", "sliding_attention"))
    ]


def _nope_layers_field(profile: PortPlan, config: Any) -> ArgField:
    """``nope_layers``: the layers that apply no RoPE, read off the config field that says so."""
    if profile.nope_field is not None:
        name = profile.nope_field

        def nope(c: Any) -> tuple[int, ...]:
            return tuple(i for i, rotates in enumerate(getattr(c, name)[: c.num_hidden_layers]) if not rotates)

        flags = f"hf_config.{name}[: hf_config.num_hidden_layers]"
        expression = f"tuple(i for i, rotates in enumerate({flags}) if not rotates)"
    else:
        kind = profile.nope_layer_type

        def nope(c: Any) -> tuple[int, ...]:
            return tuple(i for i, t in enumerate(c.layer_types) if t == kind)

        expression = f'tuple(i for i, kind in enumerate(hf_config.layer_types) if kind == "{kind}")'
    return ArgField("nope_layers", "tuple[int, ...]", nope(config), expression, nope)


def _moe_args_field(plan: PortPlan, config: Any, expected: Callable[[Any], Any]) -> ArgField:
    """``moe_args``: optional where the family mixes dense and MoE layers; where every layer
    is MoE, required, defaulting to the config class's routing (the fields that differ
    from ``MoEArgs()``)."""
    if not plan.all_layers_moe:
        return ArgField("moe_args", "MoEArgs | None", None, "moe_args", expected)
    import dataclasses

    from archon_models.moe import MoEArgs

    default, base = expected(config), MoEArgs()
    changed = {
        f.name: getattr(default, f.name)
        for f in dataclasses.fields(MoEArgs)
        if f.init and getattr(default, f.name) != getattr(base, f.name)
    }
    call = "MoEArgs(" + ", ".join(f"{k}={_literal(v)}" for k, v in changed.items()) + ")"
    return ArgField(
        "moe_args", "MoEArgs", None, "moe_args", expected, default_source=f"field(default_factory=lambda: {call})"
    )


def _partial_factor(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))


def _float_or(config: Any, name: str, default: float) -> float:
    return float(getattr(config, name, default))


def _rope_scaling_of(config: Any) -> dict[str, float] | None:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") == "default":
        return None
    # Flags (YaRN's truncate) as 0.0 / 1.0: the RoPE reads their truth value.
    skip = ("rope_type", "rope_theta")
    return {k: float(v) for k, v in rope.items() if k not in skip and isinstance(v, (int, float))}


def _literal(value: Any) -> str:
    if isinstance(value, tuple) and len(value) > 3:
        # A per-layer pattern reads best as its period times the repeat count.
        for period in range(1, len(value) // 2 + 1):
            if len(value) % period == 0 and value == value[:period] * (len(value) // period):
                return f"{_literal(value[:period])} * {len(value) // period}"
    if isinstance(value, float):
        if value >= 1e5 and value == int(value):
            return f"{int(value):_}.0"
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"{value:_}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        inner = ", ".join(_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def required_fields(profile: PortPlan, config: Any) -> tuple[str, ...]:
    moe: tuple[str, ...] = ()
    if profile.moe:
        moe = ("moe_intermediate_size",) if hasattr(config, "moe_intermediate_size") else ()
        moe += (profile.top_k_field or "num_experts_per_tok",)
    width = () if profile.ffn_width_multiple or profile.ffn_width_ratio_field else (dense_width_field(profile, config),)
    eps = () if profile.norm_eps_fixed is not None else (profile.norm_eps_field,)
    return tuple(dict.fromkeys((*CORE_REQUIRED, *width, *eps, *moe)))


MOE_SETUP = """moe_args = MoEArgs.from_hf_config(hf_config)
router_dtype: torch.dtype | None = kwargs.get("router_dtype")
if router_dtype is not None:
    moe_args.router_dtype = router_dtype
"""


def nullable_split(profile: PortPlan, fields: list[ArgField] | None, config: Any = None) -> tuple[list[str], list[str]]:
    """The analysis' nullable fields (HF's forward treats their ``None`` apart from the
    config's value): those the args map (a generated stage case with ``None`` proves each),
    and those they do not (``_check_supported`` refuses ``None``, naming the field).

    A field is mapped when an args field keeps its ``None`` (an optional annotation reading
    it), or when the args field of that name computes a value from a config holding ``None``
    (``head_dim``: ``hidden_size // num_attention_heads``, as HF derives it). ``fields`` is
    ``None`` for a reference's own mapping (deepseek_v3), which reads what it reproduces:
    every one is a case."""
    if fields is None:
        return list(profile.nullable_fields), []

    def derives(name: str) -> bool:
        field = next((f for f in fields if f.name == name), None)
        if field is None or config is None:
            return False
        without = copy.deepcopy(config)
        setattr(without, name, None)
        try:
            return field.expected(without) is not None
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return False

    mapped = [
        name
        for name in profile.nullable_fields
        if any("None" in f.annotation and re.search(rf'(hf_config\.{name}\b|"{name}")', f.expression) for f in fields)
        or derives(name)
    ]
    return mapped, [name for name in profile.nullable_fields if name not in mapped]


def nullable_cases(profile: PortPlan, config: Any) -> list[str]:
    """The nullable fields a generated stage case sets to ``None`` (see :func:`nullable_split`)."""
    fields = arg_fields(profile, config) if profile.reference in EDITABLE_REFERENCES else None
    return nullable_split(profile, fields, config)[0]


def check_supported_source(
    profile: PortPlan, config: Any, camel: str, read: str = "", refused_none: list[str] | None = None
) -> str:
    """``_check_supported``: refuse configs whose math the port does not reproduce.

    ``read``: the code of ``from_hf_config``'s field expressions; a forward switch it reads
    is mapped, not pinned. ``refused_none``: fields whose ``None`` HF's forward treats apart
    and the port does not map (see :func:`nullable_split`)."""
    lines = [
        "def _check_supported(hf_config: Any) -> None:",
        '    """Refuse configs whose math this implementation does not reproduce."""',
    ]
    for name in refused_none or []:
        lines += [
            f'    if getattr(hf_config, "{name}", 0) is None:',
            "        raise ValueError(",
            f'            "{name}=None is not supported by {camel} in Archon: HF\'s forward treats it apart "',
            '            "from every value this port maps."',
            "        )",
        ]
    act_field = profile.activation_field
    if act_field is not None:
        # The table's name and the checkpoint's own spelling of the same function (gelu_new).
        accepted = list(dict.fromkeys((profile.activation, str(getattr(config, act_field, profile.activation)))))
        quoted = ", ".join(f'"{a}"' for a in accepted)
        condition = f"act != {quoted}" if len(accepted) == 1 else f"act not in ({quoted})"
        lines += [
            f'    act = getattr(hf_config, "{act_field}", "{profile.activation}")',
            f"    if {condition}:",
            "        raise ValueError(",
            f'            f"{camel} in Archon implements the {profile.activation} activation; "',
            f'            f"{act_field}={{act!r}} is not supported."',
            "        )",
        ]
    lines += _check_layer_rope_types(profile, camel) if profile.per_layer_rope else _check_rope_type(profile, camel)
    for flag, feature in STRUCTURAL_FLAGS.items():
        if hasattr(config, flag):
            value = bool(getattr(profile, feature))
            lines += [
                f'    if bool(getattr(hf_config, "{flag}", {value})) is not {value}:',
                "        raise ValueError(",
                f'            "{flag}={not value} is not supported: {camel} checkpoints have {"" if value else "no "}"',
                '            "such bias; port that variant as its own family."',
                "        )",
            ]
    for flag, (feature, title) in PRESENT_FEATURE_FLAGS.items():
        if hasattr(config, flag) and getattr(config, flag) and getattr(profile, feature):
            lines += [
                f'    if not getattr(hf_config, "{flag}", True):',
                "        raise ValueError(",
                f'            "{flag}=False is not supported: {camel} in Archon has "',
                f'            "{title}; port that variant as its own family."',
                "        )",
            ]
    for flag, feature in ABSENT_FEATURE_FLAGS.items():
        if hasattr(config, flag) and not getattr(config, flag):
            lines += [
                f'    if getattr(hf_config, "{flag}", False):',
                "        raise ValueError(",
                f'            "{flag}=True ({feature}) "',
                f'            "is not supported by {camel} in Archon."',
                "        )",
            ]
        elif hasattr(config, flag) and flag in QK_NORM_FLAGS and profile.qk_norm != "none":
            # The port has the feature the switch turns on: a config turning it off is refused.
            lines += [
                f'    if not getattr(hf_config, "{flag}", True):',
                "        raise ValueError(",
                f'            "{flag}=False (no {feature}) "',
                f'            "is not supported by {camel} in Archon, whose attention normalises q and k."',
                "        )",
            ]
    for path in profile.pinned_nested_fields:
        parent, key = path.split(".", 1)
        lines += [
            f'    {parent} = getattr(hf_config, "{parent}", None)',
            f'    {key} = {parent}.get("{key}") if isinstance({parent}, dict) else getattr({parent}, "{key}", None)',
            f"    if {key} is not None:",
            "        raise ValueError(",
            f'            f"{path}={{{key}!r}} is not supported by {camel} in Archon, "',
            '            "which reproduces it unset (None)."',
            "        )",
        ]
    if profile.heads_per_layer_field is not None:
        field = profile.heads_per_layer_field
        lines += [
            f'    heads_per_layer = getattr(hf_config, "{field}", None) or []',
            "    if any(heads != hf_config.num_attention_heads for heads in heads_per_layer):",
            "        raise ValueError(",
            f'            f"{field}={{heads_per_layer!r}} (a query-head count per layer) is not supported: "',
            f'            "{camel} in Archon gives every layer num_attention_heads query heads."',
            "        )",
        ]
    if profile.router_softcap_field is not None:
        field = profile.router_softcap_field
        lines += [
            f'    router_cap = getattr(hf_config, "{field}", None)',
            "    if router_cap:",
            "        raise ValueError(",
            f'            f"{field}={{router_cap!r}} is not supported: the router of {camel} in Archon "',
            '            "reads its logits uncapped (0 or None)."',
            "        )",
        ]
    for field in profile.per_layer_list_fields:
        lines += [
            f'    if isinstance(getattr(hf_config, "{field}", None), (list, tuple)):',
            "        raise ValueError(",
            f'            f"{field}={{hf_config.{field}!r}} (one value per layer) is not supported: "',
            f'            "{camel} in Archon gives every MoE layer the same {field}."',
            "        )",
        ]
    if profile.route_norm and profile.route_norm_field_ignored and profile.router_scoring_field is not None:
        field, scoring = profile.route_norm_field_ignored, profile.router_scoring
        lines += [
            f'    scoring = getattr(hf_config, "{profile.router_scoring_field}", "{scoring}")',
            f'    if not getattr(hf_config, "{field}", True) and scoring != "{scoring}":',
            "        raise ValueError(",
            f'            f"{field}=False with {profile.router_scoring_field}={{scoring!r}} is not supported: "',
            f'            "{camel} in Archon always renormalises the top-k weights, as the {scoring} router does."',
            "        )",
        ]
    lines += _pinned_switch_lines(profile, camel, read, "\n".join(lines))
    if profile.absent_shared_experts_field is not None:
        field = profile.absent_shared_experts_field
        lines += [
            f'    if getattr(hf_config, "{field}", 0):',
            "        raise ValueError(",
            f'            f"{field}={{hf_config.{field}!r}} is not supported: {camel} in Archon has no "',
            '            "shared experts; port that variant as its own family."',
            "        )",
        ]
    if profile.mqa_flag is not None:
        lines += [
            f'    if not getattr(hf_config, "{profile.mqa_flag}", True):',
            "        raise ValueError(",
            f'            "{profile.mqa_flag}=False is not supported: {camel} in Archon reads the fused q/k/v "',
            '            "projection as [queries, one key head, one value head]; port that variant as its own family."',
            "        )",
        ]
    if not profile.sliding_window and hasattr(config, "sliding_window"):
        if hasattr(config, "use_sliding_window"):
            condition = 'getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None)'
        elif hasattr(config, "layer_types"):
            # The window applies only to layers marked sliding_attention (Dots1: none by default).
            condition = '"sliding_attention" in (getattr(hf_config, "layer_types", None) or ())'
        else:
            condition = 'getattr(hf_config, "sliding_window", None)'

        lines += [
            f"    if {condition}:",
            "        raise ValueError(",
            f'            "sliding-window attention is not supported by {camel} in Archon, "',
            '            "which attends over whole documents."',
            "        )",
        ]
    lines += [
        '    dropout = getattr(hf_config, "attention_dropout", 0.0)',
        "    if dropout:",
        '        logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", dropout)',
    ]
    return "\n".join(lines) + "\n"


def _pinned_switch_lines(profile: PortPlan, camel: str, read: str, written: str) -> list[str]:
    """Pin each boolean config switch the analysis found to change the forward to the value
    the family is ported from; a switch another check already guards (a bias flag, a
    feature switch) or that ``from_hf_config`` reads is left to that."""
    lines: list[str] = []
    for name, value in sorted(profile.pinned_switches.items()):
        if f'"{name}"' in written or re.search(rf"\b{re.escape(name)}\b", read) or name == profile.mqa_flag:
            continue
        lines += [
            f'    if bool(getattr(hf_config, "{name}", {value})) is not {value}:',
            "        raise ValueError(",
            f'            "{name}={not value} is not supported: {camel} in Archon reproduces "',
            f'            "{name}={value} (the forward differs); port that variant as its own family."',
            "        )",
        ]
    return lines


def _check_rope_type(profile: PortPlan, camel: str) -> list[str]:
    """Refuse a RoPE scaling type the package does not implement."""
    lines = [
        '    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}',
        "    rope_type = (",
        '        rope_parameters.get("rope_type", "default") if isinstance(rope_parameters, dict) else "default"',
        "    )",
    ]
    if profile.rope_type == "default":
        return [
            *lines,
            '    if rope_type != "default":',
            "        raise ValueError(",
            f"            f\"rope_parameters['rope_type']={{rope_type!r}} is not supported by {camel} in Archon; \"",
            '            "only the default RoPE is. Port the variant with `archon-port add`."',
            "        )",
        ]
    return [
        *lines,
        f'    if rope_type not in ("default", "{profile.rope_type}"):',
        "        raise ValueError(",
        f"            f\"rope_parameters['rope_type']={{rope_type!r}} is not supported by {camel} in Archon; \"",
        f'            "only the default and {profile.rope_type} RoPE are. "',
        '            "Port the variant with `archon-port add`."',
        "        )",
    ]


def _check_layer_rope_types(profile: PortPlan, camel: str) -> list[str]:
    """Per-layer-type RoPE: refuse a layer type whose scaling the package does not implement."""
    allowed = '("default",)' if profile.rope_type == "default" else f'("default", "{profile.rope_type}")'
    only = "the default RoPE is" if profile.rope_type == "default" else f"the default and {profile.rope_type} RoPE are"
    return [
        '    for layer_type in ("full_attention", "sliding_attention"):',
        '        rope_type = _layer_rope_parameters(hf_config, layer_type).get("rope_type", "default")',
        f"        if rope_type not in {allowed}:",
        "            raise ValueError(",
        "                f\"rope_parameters[{layer_type!r}]['rope_type']={rope_type!r} is not supported by \"",
        f'                f"{camel} in Archon; only {only}. Port the variant with `archon-port add`."',
        "            )",
    ]


SHARED_EXPERT_SETUP = """# One always-active shared expert, scaled by sigmoid(shared_expert_gate(x)). AReaL's
# MoEArgs.from_hf_config reads neither field, so the package sets them.
moe_args.shared_expert_intermediate_size = hf_config.shared_expert_intermediate_size
moe_args.use_shared_expert_gate = True
"""


DENSE_LAYER_REFUSAL = """if self.moe_args is not None and not all(self.is_moe_layer(i) for i in range(self.n_layers)):
    raise ValueError(
        "a dense layer is not supported: {camel} in Archon ports its MoE layers only (the dense "
        "MLP's clamped SwiGLU and its width are unmeasured); port that variant as its own family."
    )
"""


# The from_hf_config keyword that opts a family with a score-correction bias into AReaL's
# auxiliary-loss-free balancing of it (``MoEArgs.load_balance_coeff``: the step a trainer that
# updates the bias takes; AReaL 1.0.4's engine takes none). Without it the bias stays as loaded.
BALANCING_KWARG = "load_balance_coeff"


def router_setup(plan: PortPlan) -> str:
    """Statements after ``MoEArgs.from_hf_config`` (which scores with softmax, as AReaL's
    does) that give the router the family's scoring (the config's field, or a sigmoid the
    analysis measured when no field names it), routed scaling factor, expert groups and
    score-correction bias, each in AReaL's ``MoEArgs`` terms, and the expert counts from the
    config's own fields where AReaL's reads others. Nothing for a plain softmax router."""
    lines = []
    for name, field in (("num_experts", plan.expert_count_field), ("top_k", plan.top_k_field)):
        if field is not None:
            lines += [
                f"# The config names {name} {field}; MoEArgs.from_hf_config reads another field.",
                f"moe_args.{name} = hf_config.{field}",
            ]
    if plan.router_scoring_field is not None:
        lines += [
            "# The router scores experts as the config says: softmax over them, or a sigmoid each.",
            f"moe_args.score_func = hf_config.{plan.router_scoring_field}",
        ]
    elif plan.router_scoring == "sigmoid":
        lines += [
            "# The router scores each expert with its own sigmoid; no config field says so.",
            'moe_args.score_func = "sigmoid"',
        ]
    if plan.score_before_experts:
        lines += [
            "# The routing weights scale what the experts read, not what they return.",
            "moe_args.score_before_experts = True",
        ]
    if plan.routed_scaling_field is not None:
        lines += [
            "# The (renormalised) top-k weights are multiplied by the routed scaling factor.",
            f"moe_args.route_scale = float(hf_config.{plan.routed_scaling_field})",
        ]
    if plan.expert_group_fields is not None:
        groups, kept = plan.expert_group_fields
        lines += [
            f"# Grouped top-k: only the best {kept} of {groups} expert groups, each scored by the",
            "# sum of its two best experts, compete for the token (one group: plain top-k).",
            f"if (hf_config.{groups} or 1) > 1:",
            f"    moe_args.num_expert_groups = hf_config.{groups}",
            f"    moe_args.num_limited_groups = hf_config.{kept}",
        ]
    if plan.score_correction_key is not None:
        key = plan.score_correction_key.rsplit(".", 1)[-1]
        shifted = "logits (before the score function)" if plan.logit_selection_bias else "scores"
        lines += [
            f"# The checkpoint's {key} shifts the {shifted} that choose experts, not the",
            "# weights (the MoE's expert_bias); it stays as loaded in training unless the caller",
            f"# opts into balancing it with {BALANCING_KWARG} (AReaL's MoEArgs field of that name).",
            f'moe_args.load_balance_coeff = kwargs.get("{BALANCING_KWARG}")',
        ]
    if plan.shared_experts_field is not None:
        lines += [
            f"# {plan.shared_experts_field} always-active shared experts, each as wide as a routed one.",
            f"moe_args.num_shared_experts = hf_config.{plan.shared_experts_field} or 0",
        ]
    if plan.shared_experts_fixed is not None:
        lines += [
            "# An always-active shared MLP as wide as a routed expert; no config field counts it.",
            f"moe_args.num_shared_experts = {plan.shared_experts_fixed}",
        ]
    if plan.shared_expert_width_field is not None:
        lines += [
            f"# An always-active shared MLP, {plan.shared_expert_width_field} wide, its output added ungated.",
            f"moe_args.shared_expert_intermediate_size = hf_config.{plan.shared_expert_width_field}",
        ]
    return "".join(f"{line}\n" for line in lines)


def from_hf_config_source(
    fields: list[ArgField],
    camel: str,
    config_class: str,
    moe: bool = False,
    correction_bias: bool = False,
    route_norm: bool = False,
    route_norm_field_ignored: str | None = None,
    shared_expert: bool = False,
    router: str = "",
    kv_heads_field: str | None = "num_key_value_heads",
    single_kv_head: bool = False,
) -> str:
    if single_kv_head:
        kv_heads = "1  # multi-query attention: one key and value head for every query head"
    elif kv_heads_field:
        kv_heads = f'getattr(hf_config, "{kv_heads_field}", None) or n_heads'
    else:
        kv_heads = "n_heads  # every query head has its own key and value head"
    args = "\n".join(f"        {f.name}={f.expression}," for f in fields if f.expression)
    kwargs_doc = (
        'Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``), ``num_labels``\n'
        "    (outputs of a critic's ``score`` head, default 1), ``router_dtype`` (dtype of the\n"
        "    router GEMM; reaches ``MoEArgs.router_dtype``) and ``load_balance_coeff`` (opts\n"
        "    into auxiliary-loss-free balancing of the score-correction bias, AReaL's\n"
        "    ``MoEArgs.load_balance_coeff``; by default the checkpoint's bias stays fixed in\n"
        "    training). Any other keyword is ignored, as AReaL's own ``from_hf_config`` ignores it."
        if moe and correction_bias
        else 'Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``), ``num_labels``\n'
        "    (outputs of a critic's ``score`` head, default 1) and ``router_dtype`` (dtype of\n"
        "    the router GEMM; reaches ``MoEArgs.router_dtype``). Any other keyword is ignored,\n"
        "    as AReaL's own ``from_hf_config`` ignores it."
        if moe
        else 'Keyword arguments: ``attn_type`` (``"varlen"`` or ``"sdpa"``) and\n'
        "    ``num_labels`` (outputs of a critic's ``score`` head, default 1). Others that\n"
        "    AReaL's engine passes (``router_dtype``) are ignored, as AReaL's own\n"
        "    ``from_hf_config`` ignores them: a dense model has no router."
    )
    moe_setup = MOE_SETUP
    if route_norm:
        reason = (
            f"# The router rescales its top-k weights to sum to 1 whatever {route_norm_field_ignored} says\n"
            "# (a softmax over the top-k logits).\n"
            if route_norm_field_ignored
            else "# The router always rescales its top-k weights to sum to 1; no config field says so.\n"
        )
        moe_setup = moe_setup.replace(
            "moe_args = MoEArgs.from_hf_config(hf_config)\n",
            "moe_args = MoEArgs.from_hf_config(hf_config)\n" + reason + "moe_args.route_norm = True\n",
        )
    if shared_expert:
        moe_setup += SHARED_EXPERT_SETUP
    if router:
        moe_setup = moe_setup.replace(
            "moe_args = MoEArgs.from_hf_config(hf_config)\n",
            "moe_args = MoEArgs.from_hf_config(hf_config)\n" + router,
            1,
        )
    setup = "".join(f"    {line}\n" if line else "\n" for line in moe_setup.splitlines()) if moe else ""
    return f'''@classmethod
def from_hf_config(cls, hf_config: Any, is_critic: bool = False, **kwargs: Any) -> {camel}ModelArgs:
    """Map a ``{config_class}``.

    {kwargs_doc}
    ``eos_token_id`` of ``None`` keeps the default; a list takes its first id.
    """
    missing = [name for name in _REQUIRED_HF_FIELDS if getattr(hf_config, name, None) is None]
    if missing:
        raise ValueError(
            f"{{type(hf_config).__name__}} lacks required field(s) {{missing}}; a {camel} config "
            f"must set all of {{list(_REQUIRED_HF_FIELDS)}}."
        )
    _check_supported(hf_config)
{setup}    n_heads = hf_config.num_attention_heads
    n_kv_heads = {kv_heads}
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    return cls(
        attn_type=kwargs.get("attn_type", BaseModelArgs.attn_type),
{args}
    )
'''


class EditArgsRequest(SourceRequest):
    allow_unsupported: bool = Field(
        default=False,
        description="write the args even when the family has unsupported features (they are returned); "
        "fields those features need are added by hand",
    )


class FieldCheck(BaseModel):
    config: str = Field(description="'default' (the config class defaults) or 'tiny'")
    field: str
    expected: Any
    actual: Any
    passed: bool


class EditArgsResult(StepResult):
    fields: dict[str, str] = Field(description="field -> annotation and default")
    checks: list[FieldCheck]
    skipped_features: list[str] = Field(default_factory=list, description="unsupported features, for a hand edit")


def edit_args(request: EditArgsRequest) -> EditArgsResult:
    """Write the args dataclass fields and from_hf_config of archon_models/<model_name>/
    for the family of `source`, then check every field it maps against a real config
    instance (the config class defaults and a tiny config). Fails naming the field."""
    with staged(request.workspace) as tree:
        return apply_edit_args(tree, request)


def apply_edit_args(tree: StagedTree, request: EditArgsRequest, profile: PortPlan | None = None) -> EditArgsResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    text = require_file(tree, layout.args, "run copy_reference first.")
    profile = profile or plan_for(request.source, request.trust_remote_code)
    if not request.allow_unsupported:
        refuse_unsupported(profile, "edit_args")
    elif profile.unsupported:
        refuse_unedited_reference(profile, "edit_args")
    skipped = skipped_features(profile, request.allow_unsupported)
    check_reference_fits(profile, text)
    config = load_config(request.source, request.trust_remote_code)
    camel = layout.names.camel
    if profile.reference not in EDITABLE_REFERENCES:
        return _reference_mapping_args(tree, layout, text, profile, config, skipped)
    fields = arg_fields(profile, config)
    doc = Document(text)
    spec = {f.name: f"{f.annotation} = {f.default_source or _literal(f.default)}" for f in fields}
    stale = [n for n in class_field_names(doc, layout.args_class) if n not in spec]
    doc = set_class_fields(doc, layout.args_class, spec, remove=stale)
    doc = set_docstring(
        doc,
        layout.args_class,
        f"{camel} hyper-parameters. Defaults are those of transformers' ``{profile.config_class}``.",
    )
    doc = set_docstring(
        doc, None, f"{camel} hyper-parameters and their mapping from a transformers ``{profile.config_class}``."
    )
    required = "".join(f'\n    "{n}",' for n in required_fields(profile, config))
    doc = set_module_assign(doc, "_REQUIRED_HF_FIELDS", f"({required}\n)")
    doc = upsert_function(
        doc,
        "_check_supported",
        check_supported_source(
            profile,
            config,
            camel,
            read=" ".join(f.expression for f in fields),
            refused_none=nullable_split(profile, fields, config)[1],
        ),
        before_class=layout.args_class,
    )
    if profile.partial_rotary and not profile.layer_rotary_dims:
        helper = snippet("args", "_partial_rotary_factor")
        doc = upsert_function(doc, "_partial_rotary_factor", helper, before_class=layout.args_class)
    if profile.per_layer_rope:
        helper_source = snippet("args", "_layer_rope_parameters")
        doc = upsert_function(doc, "_layer_rope_parameters", helper_source, before_class=layout.args_class)
    if profile.layer_rotary_dims:
        helper = snippet("args", "_layer_partial_rotary_factor")
        doc = upsert_function(doc, "_layer_partial_rotary_factor", helper, before_class=layout.args_class)
    if profile.rope_type != "default":
        helper = "_layer_rope_freq_scaling" if profile.per_layer_rope else "_rope_freq_scaling"
        doc = upsert_function(doc, helper, snippet("args", helper), before_class=layout.args_class)
        doc = replace_text(doc, "\nfrom dataclasses import dataclass\n", "\nfrom dataclasses import dataclass, field\n")
    doc = replace_function(
        doc,
        layout.args_class,
        "from_hf_config",
        from_hf_config_source(
            fields,
            camel,
            profile.config_class,
            profile.moe,
            correction_bias=profile.score_correction_key is not None,
            route_norm=profile.route_norm,
            route_norm_field_ignored=profile.route_norm_field_ignored,
            shared_expert=profile.shared_expert,
            router=router_setup(profile),
            kv_heads_field=profile.kv_heads_field,
            single_kv_head=profile.single_kv_head,
        ),
    )
    if profile.moe and not profile.all_layers_moe and profile.moe_layer_rule != "sparse_step":
        # The family's own per-layer rule replaces the reference's decoder_sparse_step rule.
        doc = replace_function(
            doc,
            layout.args_class,
            "is_moe_layer",
            snippet_method("moe_layers", MOE_LAYER_RULES[profile.moe_layer_rule], "is_moe_layer"),
        )
        doc = _drop_sparse_step_check(doc, layout.args_class)
    if profile.all_layers_moe:
        # Every layer routes to experts: the per-layer rule and its check go.
        doc = remove_method(doc, layout.args_class, "is_moe_layer")
        doc = _drop_sparse_step_check(doc, layout.args_class)
    if profile.moe and not profile.all_layers_moe and profile.expert_activation_fields:
        # The clamped SwiGLU is ported for the experts only: a dense layer's MLP is unmeasured.
        doc = append_to_function(doc, layout.args_class, "__post_init__", DENSE_LAYER_REFUSAL.format(camel=camel))
    # The reference's MoE-detection helpers are dead once the family's MoE is fixed.
    doc = remove_function(doc, "_num_experts")
    doc = remove_statements(doc, lambda code: code.startswith("_REQUIRED_MOE_HF_FIELDS"))
    checks = verify_args_source(doc.code, layout.args_class, fields, request.source, request.trust_remote_code)
    failed = [c for c in checks if not c.passed]
    if failed:
        detail = "; ".join(
            f"{c.field} on the {c.config} config: expected {c.expected!r}, got {c.actual!r}" for c in failed
        )
        raise ValueError(f"from_hf_config maps fields wrongly: {detail}.")
    changed: list[str] = []
    write_if_changed(tree, layout.args, doc.code, changed)
    return EditArgsResult(fields=spec, checks=checks, skipped_features=skipped, changed_files=changed)


# factor = relation(field): where the field goes in a quotient, and the power it is raised to.
_RELATION_TERMS = {"x": (True, ""), "1/x": (False, ""), "sqrt(x)": (True, "**0.5"), "x**-0.5": (False, "**0.5")}


def source_expression(source: ConfigScalar) -> str:
    """The ``from_hf_config`` expression of a factor: ``hf_config.scale_depth / hf_config.num_hidden_layers**0.5``."""
    numerator: list[str] = []
    denominator: list[str] = []
    part: ConfigScalar | None = source
    while part is not None:
        upper, power = _RELATION_TERMS[part.relation]
        (numerator if upper else denominator).append(f"hf_config.{part.field}{power}")
        part = part.times
    top = " * ".join(numerator) or "1.0"
    if not denominator:
        return f"float({top})"
    bottom = denominator[0] if len(denominator) == 1 else f"({' * '.join(denominator)})"
    return f"{top} / {bottom}"


def source_value(source: ConfigScalar, config: Any) -> float:
    """The factor a config gives, computed independently of :func:`source_expression`."""
    value = 1.0
    part: ConfigScalar | None = source
    while part is not None:
        field_value = float(getattr(config, part.field))
        value *= {"x": field_value, "1/x": 1.0 / field_value, "sqrt(x)": field_value**0.5}.get(
            part.relation, field_value**-0.5
        )
        part = part.times
    return value


def scalar_arg(profile: PortPlan, name: str, config: Any) -> ArgField:
    """The args field of a scalar factor: a config field as is, or a derived factor's expression."""
    source = profile.scalar_sources.get(name)
    if source is None:
        return ArgField(name, "float", float(getattr(config, name)), f"hf_config.{name}", operator.attrgetter(name))
    return ArgField(
        name, "float", source_value(source, config), source_expression(source), lambda c: source_value(source, c)
    )


def mla_scalar_fields(text: Document, args_class: str, profile: PortPlan, config: Any) -> Document:
    """The scalar factors' args fields on a copied deepseek_v3 args module (its mapping is
    kept, so each factor adds one dataclass field and one keyword of the ``cls(...)`` call)."""
    fields = [scalar_arg(profile, name, config) for name in profile.multipliers]
    if not fields:
        return text
    spec = {f.name: f"{f.annotation} = {_literal(f.default)}" for f in fields}
    text = set_class_fields(text, args_class, spec)
    for f in fields:
        text = set_call_kwarg(text, "cls", f.name, f.expression)
    return text


def indexer_args(text: Document, args_class: str, profile: PortPlan) -> Document:
    """The sparse-attention indexer's sizes on a copied deepseek_v3 args module, read from the
    config fields the analysis measured (one dataclass field and one ``cls(...)`` keyword each)."""
    indexer = profile.indexer
    if indexer is None:
        return text
    fields = {
        "index_topk": indexer.topk_field,
        "index_n_heads": indexer.n_heads_field,
        "index_head_dim": indexer.head_dim_field,
    }
    # The defaults are filled in from the config class's by the caller.
    text = set_class_fields(text, args_class, dict.fromkeys(fields, "int = 0"))
    for name, field in fields.items():
        text = set_call_kwarg(text, "cls", name, f"hf_config.{field}")
    return text


def _drop_sparse_step_check(text: Document, args_class: str) -> Document:
    """Remove the reference's ``decoder_sparse_step`` check (the family has no such field)."""
    return replace_in_function(
        text,
        args_class,
        "__post_init__",
        "if self.moe_args is not None and self.decoder_sparse_step < 1:\n"
        "    raise ValueError("
        'f"decoder_sparse_step must be >= 1 for a MoE model, got {self.decoder_sparse_step}.")',
        "",
    )


def verify_args_source(
    text: str, class_name: str, fields: list[ArgField], source: str, trust_remote_code: bool = False
) -> list[FieldCheck]:
    """Execute the generated args module and compare each field with the expected value."""
    name = f"_archon_port_args_check_{class_name}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses resolves annotations through sys.modules
    try:
        exec(compile(text, f"<generated {class_name}>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    args_class = getattr(module, class_name)
    checks: list[FieldCheck] = []
    base = load_config(source, trust_remote_code)
    required = getattr(module, "_REQUIRED_HF_FIELDS", ())
    for label, config in (("default", base), ("tiny", tiny_config(base))):
        if label == "default" and any(getattr(config, name, None) is None for name in required):
            # The config class's defaults are no model (Dots1Config leaves its expert counts
            # unset); from_hf_config refuses them, and stage 1 proves that it does.
            continue
        args = args_class.from_hf_config(config)
        for f in fields:
            expected = f.expected(config)
            actual = getattr(args, f.name)
            checks.append(
                FieldCheck(
                    config=label, field=f.name, expected=expected, actual=actual, passed=_same_value(expected, actual)
                )
            )
    return checks


def _same_value(expected: Any, actual: Any) -> bool:
    """Equal values; a dataclass (``YarnArgs``) compares by class name and fields, since the
    generated module executed here defines its own class of the reference's name."""
    if dataclasses.is_dataclass(expected) and dataclasses.is_dataclass(actual):
        return type(expected).__name__ == type(actual).__name__ and dataclasses.asdict(
            expected  # type: ignore[arg-type]
        ) == dataclasses.asdict(actual)  # type: ignore[arg-type]
    return bool(expected == actual)


# Fields the caller of from_hf_config sets, not the config.
CALLER_ARGS = frozenset({"attn_type", "is_critic", "num_labels"})


def _literal_default(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _exec_args_class(text: str, class_name: str) -> Any:
    name = f"_archon_port_args_check_{class_name}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses resolves annotations through sys.modules
    try:
        exec(compile(text, f"<generated {class_name}>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return getattr(module, class_name)


def _missing_moe_fields(text: str, class_name: str, config: Any) -> list[str]:
    """The MoE fields the copied args require (``_REQUIRED_MOE_HF_FIELDS``) that ``config``
    leaves unset; a missing field of any other kind is no config the package serves."""
    name = f"_archon_port_args_check_{class_name}"
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(text, f"<generated {class_name}>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    moe_fields = tuple(getattr(module, "_REQUIRED_MOE_HF_FIELDS", ()))
    return [n for n in moe_fields if getattr(config, n, None) is None]


def _moe_fields_filled(config: Any, missing: list[str]) -> Any:
    """``config`` with its unset MoE fields taken from its tiny config, only to read the
    args' literal defaults: those fields reach ``moe_args`` alone, which has no literal
    default (checked by the caller's field-by-field comparison on the tiny config)."""
    if not missing:
        return config
    filled = copy.deepcopy(config)
    tiny = tiny_config(config)
    for name in missing:
        setattr(filled, name, getattr(tiny, name))
    return filled


# The deepseek_v3 reference's MoE layer rule (leading dense layers) and what replaces it when
# the family lists each layer's MLP kind instead.
_LEADING_DENSE_RULE = (
    ("    first_k_dense_replace: int = 3\n", "    {field}: list[str] = field(default_factory=list)\n"),
    (
        'first_k_dense_replace=getattr(hf_config, "first_k_dense_replace", None) or 0,',
        "{field}=list(hf_config.{field}),",
    ),
    (
        "return self.moe_args is not None and layer_id >= self.first_k_dense_replace",
        'return self.moe_args is not None and self.{field}[layer_id] == "sparse"',
    ),
    ("is set and ``i >= first_k_dense_replace``;", 'is set and\n    ``{field}[i] == "sparse"``;'),
    ("from dataclasses import dataclass\n", "from dataclasses import dataclass, field\n"),
)


def _moe_layers_by_type(text: Document, field_name: str) -> Document:
    """The reference's leading-dense rule replaced by the family's per-layer list of MLP kinds."""
    for old, new in _LEADING_DENSE_RULE:
        if text.code.count(old) != 1:
            raise CodemodError(f"the copied args do not hold the reference's MoE layer rule ({old.strip()!r}).")
        text = replace_text(text, old, new.format(field=field_name))
    return text


def _reference_mapping_args(
    tree: StagedTree,
    layout: PackageLayout,
    text: str,
    profile: PortPlan,
    config: Any,
    skipped: list[str],
) -> EditArgsResult:
    """Args of a family copied from a reference no edit targets (deepseek_v3, qwen3_5): its mapping as is.

    The analysis found no feature the reference does not produce from the config (beyond
    ``skipped``, the unsupported features a hand edit writes), so the copied
    ``from_hf_config`` (which reads every field by name and refuses what it does not
    reproduce) is the family's. Only the defaults change, to the family's config class
    defaults, read through that mapping; each field is then checked against the mapping on
    the default and on the tiny config.
    """
    doc = Document(text)
    if profile.reference == HYBRID_REFERENCE:
        rule = moe_layer_fields(profile, config) if "moe_layer_rule" in profile.hybrid_edits else []
        doc = hybrid_args(doc, layout.args_class, profile, rule)
        doc = set_docstring(
            doc,
            None,
            f"{layout.names.camel} hyper-parameters and their mapping from a transformers ``{profile.config_class}``.",
        )
    else:
        if profile.moe_layer_types_field is not None:
            doc = _moe_layers_by_type(doc, profile.moe_layer_types_field)
        if not profile.moe:
            # A dense family keeps none of the reference's MoE machinery.
            doc = dense_args(doc, layout.args_class)
        doc = router_args(doc, profile, layout.names.camel)
        doc = mla_scalar_fields(doc, layout.args_class, profile, config)
        doc = indexer_args(doc, layout.args_class, profile)
        if profile.rotary_style_field is None:
            # The config has no switch of the rotation's pairing: the measured one is fixed.
            interleaved = "True" if profile.rotary_interleaved else "False"
            doc = set_call_kwarg(doc, "cls", "rope_interleave", interleaved)
    if profile.tying_field != "tie_word_embeddings":
        # HF's tying follows another field, or none (probed): the reference reads tie_word_embeddings.
        doc = set_call_kwarg(doc, "cls", "enable_weight_tying", _tying_arg(profile, config).expression)
    args_class = _exec_args_class(doc.code, layout.args_class)
    missing = _missing_moe_fields(doc.code, layout.args_class, config)
    defaults = args_class.from_hf_config(_moe_fields_filled(config, missing))
    own_fields = class_field_names(doc, layout.args_class)
    spec: dict[str, str] = {}
    for f in dataclasses.fields(args_class):
        value = getattr(defaults, f.name)
        if f.name in CALLER_ARGS or not _literal_default(value) or f.name not in own_fields:
            continue
        spec[f.name] = f"{f.type} = {_literal(value)}"
    doc = set_class_fields(doc, layout.args_class, spec)
    _, _, rest = (args_class.__doc__ or "").partition("\n")
    summary = f"{layout.names.camel} hyper-parameters. Defaults are those of transformers' ``{profile.config_class}``."
    doc = set_docstring(doc, layout.args_class, summary + ("\n" + rest if rest.strip() else ""))
    written = _exec_args_class(doc.code, layout.args_class)
    checks: list[FieldCheck] = []
    # The config class's defaults lack an MoE field from_hf_config requires (DeepseekV2Config
    # leaves num_experts_per_tok unset): it refuses them, and stage 1 proves that it does.
    configs = (("tiny", tiny_config(config)),) if missing else (("default", config), ("tiny", tiny_config(config)))
    for label, cfg in configs:
        expected, actual = args_class.from_hf_config(cfg), written.from_hf_config(cfg)
        for f in dataclasses.fields(written):
            want, got = getattr(expected, f.name), getattr(actual, f.name)
            shown = (want, got) if _literal_default(want) and _literal_default(got) else (repr(want), repr(got))
            checks.append(
                FieldCheck(
                    config=label, field=f.name, expected=shown[0], actual=shown[1], passed=_same_value(want, got)
                )
            )
    default_args = written()
    for name in spec:
        want, got = getattr(defaults, name), getattr(default_args, name)
        checks.append(
            FieldCheck(config="class default", field=name, expected=want, actual=got, passed=_same_value(want, got))
        )
    failed = [c for c in checks if not c.passed]
    if failed:
        detail = "; ".join(f"{c.field} ({c.config}): expected {c.expected!r}, got {c.actual!r}" for c in failed)
        raise ValueError(f"the {profile.reference} args mapping does not fit {profile.config_class}: {detail}.")
    changed: list[str] = []
    write_if_changed(tree, layout.args, doc.code, changed)
    return EditArgsResult(fields=spec, checks=checks, skipped_features=skipped, changed_files=changed)
