"""What the engine writes for a family, read off the analyser's report.

The analysis (``skill.analysis``) is the one measurement of a family: every step of the
porting engine reads the :class:`~skill.analysis.report.ArchitectureReport`, and this
module is the single place where its checklist turns into the engine's decisions (which
reference, which edits, which config field feeds which args field). Nothing here probes
a model or reads a config: a fact the engine needs and the report lacks is a gap in the
analyser, fixed there.

"Portable" is decided once, by the report's ``unsupported`` list; :func:`refuse_unsupported`
is the one refusal every step and face raises.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from skill.analysis.analyze import analyze_hf_model
from skill.analysis.reference import reference_for
from skill.analysis.report import AnalyzeInput, ArchitectureReport
from skill.errors import UnsupportedFeatureError
from skill.features import (
    ConfigScalar,
    FFNKind,
    NormKind,
    NormPlacement,
    QKNormKind,
    RotaryStyle,
    RouterScoring,
    SlidingWindowKind,
)

logger = logging.getLogger(__name__)

# Activations the edits can write, by the names transformers' ACT2FN uses.
ACTIVATIONS = {"silu": "F.silu({})", "gelu_pytorch_tanh": 'F.gelu({}, approximate="tanh")', "gelu": "F.gelu({})"}
# The config fields the qwen3 reference's per-layer MoE rule reads (``is_moe_layer``).
MOE_LAYER_RULE_FIELDS = ("decoder_sparse_step", "mlp_only_layers")
ACTIVATION_FIELDS = ("hidden_activation", "hidden_act", "activation_function", "activation", "mlp_hidden_act")


def unsupported_error(model_type: str, features: list[str], step: str) -> UnsupportedFeatureError:
    """The one refusal: every unsupported feature of the report, and the way past it."""
    names = ", ".join(f.removeprefix("unsupported: ") for f in features)
    return UnsupportedFeatureError(
        f"{model_type} has feature(s) no edit supports: {names}. Nothing was written. "
        f"Pass allow_unsupported=true to {step} to apply every supported edit and leave a marker "
        "where each hand edit goes.",
        features,
    )


class PortPlan(BaseModel):
    """The engine's reading of one family's report: every decision the steps act on."""

    model_config = ConfigDict(frozen=True)

    source: str
    trust_remote_code: bool = False
    model_type: str
    config_class: str
    reference: Literal["qwen2", "qwen3"]
    unsupported: list[str] = Field(description="the report's unsupported features, verbatim")
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: Literal["none", "per_head", "full"]
    norm: Literal["rms", "rms_offset", "layernorm"]
    block: Literal["pre_norm", "sandwich", "post_norm", "parallel"]
    shared_block_norm: bool = Field(
        default=False, description="a parallel block's attention and feed-forward read one norm of the input"
    )
    mlp: Literal["gated", "plain"]
    activation: str
    activation_field: str | None
    norm_eps_field: str
    sliding_window: bool
    sliding_layer_types: bool
    attn_softcap: bool
    final_softcap: bool
    attn_scale: ConfigScalar | None = Field(description="config field setting the attention scale, if custom")
    embedding_scale: Literal["none", "sqrt_dim", "multiplier"]
    embedding_scale_field: str | None
    residual_multiplier_field: str | None
    logit_divisor_field: str | None = Field(description="config field the logits are divided by")
    logit_multiplier_field: str | None = Field(default=None, description="config field the logits are multiplied by")
    rope_type: str
    partial_rotary: bool
    rotary_interleaved: bool
    moe: bool
    all_layers_moe: bool
    shared_expert: bool
    route_norm: bool = Field(description="the router renormalises top-k weights though no config field says so")
    router_scoring: Literal["softmax", "sigmoid"] = Field(
        default="softmax", description="how the router scores experts: softmax over them, or a sigmoid each"
    )
    router_scoring_field: str | None = Field(
        default=None, description="config field naming the router's scoring function, if the config has one"
    )
    tied: bool
    kv_heads_field: str | None = Field(
        default="num_key_value_heads",
        description="config field of the KV-head count; None when every query head has its own key and value",
    )

    single_kv_head: bool = Field(
        default=False,
        description="multi-query attention no config field sets: one KV head whatever the head counts say",
    )
    ffn_width_field: str | None = Field(default=None, description="config field of the dense MLP width")

    @property
    def parallel_block(self) -> bool:
        return self.block == "parallel"

    @property
    def multipliers(self) -> list[str]:
        """Config fields of scalar factors the args carry, in a fixed order."""
        fields = [
            self.embedding_scale_field,
            self.residual_multiplier_field,
            self.attn_scale.field if self.attn_scale is not None else None,
            self.logit_divisor_field,
            self.logit_multiplier_field,
        ]
        return [f for f in fields if f]

    @property
    def portable(self) -> bool:
        return not self.unsupported


def _config_values(report: ArchitectureReport) -> dict[str, Any]:
    return {f.name: f.value for f in report.config_fields}


def plan_from_report(report: ArchitectureReport, source: str, trust_remote_code: bool = False) -> PortPlan:
    """Translate the checklist into the engine's decisions (no measurement here)."""
    cl = report.checklist
    att, ffn, moe, pos, norm, sc = cl.attention, cl.ffn, cl.moe, cl.positions, cl.norm, cl.scalars
    values = _config_values(report)
    kv_field = next((f.name for f in report.config_fields if f.archon_field == "n_kv_heads"), None)
    activation_field = next(
        (f for f in ACTIVATION_FIELDS if isinstance(values.get(f), str) and values[f] == ffn.activation), None
    )
    qk_norm: Literal["none", "per_head", "full"] = {
        QKNormKind.NONE: "none",
        QKNormKind.PER_HEAD_RMS: "per_head",
        QKNormKind.FULL_WIDTH_RMS: "full",
    }.get(att.qk_norm, "none")  # type: ignore[assignment]
    norm_kind: Literal["rms", "rms_offset", "layernorm"] = {
        NormKind.RMS_ONE_PLUS_W: "rms_offset",
        NormKind.LAYER_NORM: "layernorm",
    }.get(norm.kind, "rms")  # type: ignore[assignment]
    block: Literal["pre_norm", "sandwich", "post_norm", "parallel"] = {
        NormPlacement.SANDWICH: "sandwich",
        NormPlacement.POST_SUBLAYER: "post_norm",
        NormPlacement.PARALLEL: "parallel",
    }.get(norm.placement, "pre_norm")  # type: ignore[assignment]
    embedding: Literal["none", "sqrt_dim", "multiplier"] = "none"
    if sc.embedding_scale_kind == "sqrt_dim":
        embedding = "sqrt_dim"
    elif sc.embedding_scale_kind == "constant" and sc.embedding_scale_source is not None:
        embedding = "multiplier"
    logit = sc.logit_multiplier_source
    logit_divisor = logit.field if logit is not None and logit.relation == "1/x" else None
    scale = att.scaling_source if att.custom_scaling else None
    n_layers = moe.n_layers if moe is not None else 0
    scoring: Literal["softmax", "sigmoid"] = (
        "sigmoid" if moe is not None and moe.router_scoring is RouterScoring.SIGMOID else "softmax"
    )
    scoring_field = next(
        (
            f.name
            for f in report.config_fields
            if f.archon_field == "moe_args.score_func" and f.value in ("softmax", "sigmoid")
        ),
        None,
    )
    return PortPlan(
        source=source,
        trust_remote_code=trust_remote_code,
        model_type=report.model_type,
        config_class=report.config_class,
        reference=reference_for(att.qk_norm is QKNormKind.PER_HEAD_RMS, moe is not None),
        unsupported=list(report.unsupported),
        qkv_bias=att.q_bias or att.k_bias or att.v_bias,
        o_bias=att.o_bias,
        mlp_bias=ffn.bias,
        qk_norm=qk_norm,
        norm=norm_kind,
        block=block,
        shared_block_norm=block == "parallel" and "pre_ffn" not in norm.block_norms.values(),
        mlp="plain" if ffn.kind is FFNKind.PLAIN else "gated",
        activation=ffn.activation,
        activation_field=activation_field,
        norm_eps_field=norm.eps_field or "rms_norm_eps",
        sliding_window=att.sliding_window.kind is not SlidingWindowKind.NONE,
        sliding_layer_types=att.sliding_window.kind is SlidingWindowKind.PER_LAYER_PATTERN,
        attn_softcap=att.logit_softcap is not None,
        final_softcap=sc.final_logit_softcap is not None,
        attn_scale=scale,
        embedding_scale=embedding,
        embedding_scale_field=sc.embedding_scale_source.field
        if embedding == "multiplier" and sc.embedding_scale_source
        else None,
        residual_multiplier_field=sc.residual_multiplier_field,
        logit_divisor_field=logit_divisor,
        logit_multiplier_field=logit.field if logit is not None and logit.relation == "x" else None,
        rope_type=pos.rope_type or "default",
        partial_rotary=pos.partial_rotary_factor != 1.0,
        rotary_interleaved=pos.rotary_style is RotaryStyle.INTERLEAVED,
        moe=moe is not None,
        # Every layer routes to experts, and the config has no field of the reference's
        # per-layer rule that a checkpoint could set otherwise.
        all_layers_moe=moe is not None
        and bool(n_layers)
        and len(moe.moe_layers) == n_layers
        and not any(f in values for f in MOE_LAYER_RULE_FIELDS),
        shared_expert=moe is not None and moe.shared_expert_gate,
        route_norm=moe is not None and moe.norm_topk_prob and "norm_topk_prob" not in values,
        router_scoring=scoring,
        router_scoring_field=scoring_field if moe is not None else None,
        tied=sc.tie_word_embeddings,
        kv_heads_field=kv_field,
        single_kv_head=kv_field is None and att.n_kv_heads == 1 and (att.n_heads or 1) > 1,
        ffn_width_field=_ffn_width_field(values, ffn.intermediate_size),
    )


# Words in the name of a config field that sets the MLP width.
FFN_WIDTH_WORDS = ("intermediate", "ffn", "inner", "mlp")


def _ffn_width_field(values: dict[str, Any], width: int | None) -> str | None:
    """``intermediate_size``, else the config field holding the measured MLP width."""
    if "intermediate_size" in values:
        return "intermediate_size"
    return next(
        (
            name
            for name, value in sorted(values.items())
            if value == width and not isinstance(value, bool) and any(w in name for w in FFN_WIDTH_WORDS)
        ),
        None,
    )


def _source_stamp(source: str) -> float:
    """Changes when a folder source's config changes, so a long-lived server re-analyses it."""
    path = Path(source)
    config = path / "config.json" if path.is_dir() else path
    try:
        return os.stat(config).st_mtime_ns if config.is_file() else 0.0
    except OSError:
        return 0.0


@functools.lru_cache(maxsize=32)
def _report(source: str, trust_remote_code: bool, stamp: float) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=source, trust_remote_code=trust_remote_code))


def report_for(source: str, trust_remote_code: bool = False) -> ArchitectureReport:
    """The analysis report of ``source`` (cached per source, config and remote-code choice)."""
    return _report(source, trust_remote_code, _source_stamp(source))


def plan_for(source: str, trust_remote_code: bool = False) -> PortPlan:
    """The engine's plan for ``source``, read off its analysis report."""
    return plan_from_report(report_for(source, trust_remote_code), source, trust_remote_code)


def refuse_unsupported(plan: PortPlan, step: str) -> None:
    """The one refusal: raise naming every unsupported feature of the report."""
    if plan.unsupported:
        raise unsupported_error(plan.model_type, plan.unsupported, step)
