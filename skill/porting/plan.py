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
    ChunkedAttention,
    ConfigScalar,
    FFNKind,
    FusedQKVLayout,
    HandEditPlace,
    NormKind,
    NormPlacement,
    PositionKind,
    QKNormKind,
    QKNormPlacement,
    QueryPositionScale,
    RotaryDirection,
    RotaryStyle,
    RouterScoring,
    SlidingWindowKind,
    SparseIndexer,
    is_empty,
)
from skill.porting.hybrid_package import HYBRID_REFERENCE, hybrid_edit_names

logger = logging.getLogger(__name__)

# What the block norms (and a QK norm, each its own kind) become in the generated code.
NormVariant = Literal[
    "rms", "rms_offset", "rms_weightless", "layernorm", "layernorm_no_bias", "layernorm_weightless", "layernorm_offset"
]
NORM_VARIANTS: dict[NormKind, NormVariant] = {
    NormKind.RMS: "rms",
    NormKind.RMS_ONE_PLUS_W: "rms_offset",
    NormKind.RMS_WEIGHTLESS: "rms_weightless",
    NormKind.LAYER_NORM: "layernorm",
    NormKind.LAYER_NORM_NO_BIAS: "layernorm_no_bias",
    NormKind.LAYER_NORM_WEIGHTLESS: "layernorm_weightless",
    NormKind.LAYER_NORM_ONE_PLUS_W: "layernorm_offset",
}

# What each position encoding becomes (RoPE for the kinds no edit writes: they are refused).
POSITION_PLANS: dict[PositionKind, Literal["rope", "learned", "alibi", "sinusoidal"]] = {
    PositionKind.LEARNED: "learned",
    PositionKind.ALIBI: "alibi",
    PositionKind.SINUSOIDAL: "sinusoidal",
}

# The fields AReaL 1.0.4's MoEArgs.from_hf_config reads for the expert count and top-k.
AREAL_MOE_COUNT_FIELDS = ("num_experts", "num_local_experts")
AREAL_MOE_TOP_K_FIELD = "num_experts_per_tok"


# The steps that take ``allow_unsupported`` (apply every supported edit, mark the rest).
ALLOW_UNSUPPORTED_STEPS = ("edit_args", "edit_model")


# References whose modules no edit targets and whose copy gets no hand-edit markers: a family
# with a feature no edit supports is ported from them by hand (copy_reference copies and renames).
UNEDITED_REFERENCES = (HYBRID_REFERENCE,)


def unsupported_error(model_type: str, features: list[str], step: str, reference: str = "") -> UnsupportedFeatureError:
    """The one refusal: every unsupported feature of the report, and the way past it."""
    names = ", ".join(f.removeprefix("unsupported: ") for f in features)
    if reference in UNEDITED_REFERENCES:
        return UnsupportedFeatureError(
            f"{model_type} has feature(s) no edit supports: {names}. Nothing was written. No edit targets the "
            f"modules of the {reference} reference: a hand port runs copy_reference {reference} (it copies and "
            "renames the package) and writes the differences by hand.",
            features,
        )
    if step in ALLOW_UNSUPPORTED_STEPS:
        way = f"Pass allow_unsupported=true to {step}"
    else:
        way = f"Take the steps one by one with allow_unsupported=true passed to {' and '.join(ALLOW_UNSUPPORTED_STEPS)}"
    return UnsupportedFeatureError(
        f"{model_type} has feature(s) no edit supports: {names}. Nothing was written. "
        f"{way} to apply every supported edit and leave a marker where each hand edit goes.",
        features,
    )


class PortPlan(BaseModel):
    """The engine's reading of one family's report: every decision the steps act on."""

    model_config = ConfigDict(frozen=True)

    source: str
    trust_remote_code: bool = False
    model_type: str
    config_class: str
    reference: Literal["qwen2", "qwen3", "deepseek_v3", "qwen3_5"]
    unsupported: list[str] = Field(description="the report's unsupported features, verbatim")
    feature_modules: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        exclude_if=is_empty,
        description="the feature modules that port this family (skill.feature_modules): name -> value",
    )
    hand_edit_places: dict[str, HandEditPlace] = Field(
        default_factory=dict,
        exclude_if=is_empty,
        description="the report's measured place of each unsupported feature's hand edit",
    )
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    mqa_flag: str | None = Field(default=None, description="config switch of multi-query attention, when set")
    qkv_blocks: int | None = Field(
        default=None, description="a fused q/k/v checkpoint tensor of this many fixed blocks (CodeGen: 4)"
    )
    kv_heads_field: str | None = Field(
        default="num_key_value_heads", description="config field of the KV-head count; None when the family has none"
    )
    qk_norm: Literal["none", "per_head", "full"]
    qk_norm_variant: NormVariant | None = Field(
        default=None,
        description="what the QK norm computes (measured on its own), where it gets a class of its own; None "
        "without one or when the block norms' class computes it (the QK norms then share it)",
    )
    norm: NormVariant
    block: Literal["pre_norm", "sandwich", "post_norm", "parallel", "post_ln"]
    final_norm: bool = Field(default=True, description="a final norm before the LM head (post-LN stacks have none)")
    shared_block_norm: bool = Field(
        default=False, description="a parallel block's attention and feed-forward read one norm of the input"
    )
    mlp: Literal["gated", "plain"]
    activation: str = Field(description="an entry of skill.activations.ACTIVATIONS")
    activation_field: str | None = Field(description="config field naming the activation (none: probed)")
    ffn_width_field: str | None = Field(default=None, description="config field of the dense FFN width")
    ffn_width_multiple: int | None = Field(
        default=None, description="the width is this multiple of hidden_size when that field is None (or absent)"
    )
    ffn_width_ratio_field: str | None = Field(
        default=None, description="config field whose value times hidden_size is the width (expansion_ratio)"
    )
    norm_eps_field: str
    norm_eps_fixed: float | None = Field(
        default=None, description="the norms' epsilon when no config field sets it (a modeling-code constant)"
    )
    latent_norm_eps_from_config: bool = Field(
        default=False, description="MLA's latent norms take the block norms' epsilon (norm_eps), not 1e-6"
    )
    indexer: SparseIndexer | None = Field(
        default=None,
        description="MLA's sparse-attention indexer: its top-k keys per query mask the attention",
        exclude_if=lambda value: value is None,
    )
    clip_qkv_field: str | None = Field(default=None, description="config field that clamps q/k/v, if any")
    query_position_scale: QueryPositionScale | None = Field(
        default=None, description="queries scaled by their absolute position, and the config paths of its constants"
    )
    clip_after_qk_norm: bool = Field(
        default=False, description="q and k are clamped after the QK norm (OLMoE), not as they leave wq/wk"
    )
    sliding_window: bool
    sliding_layer_types: bool
    window_field: str = Field(default="sliding_window", description="the config field holding the window")
    layer_kinds_field: str = Field(
        default="layer_types", description="sliding_layer_types: the config field listing each layer's kind"
    )
    windowed_kind: str = Field(
        default="sliding_attention", description="sliding_layer_types: the layer kind that sees the window"
    )
    attn_softcap: bool
    qk_norm_rope_layers_only: bool = Field(
        default=False,
        description="the (weightless) per-head QK norm runs on the layers that apply RoPE only",
        exclude_if=lambda value: not value,
    )
    chunked_attention: ChunkedAttention | None = Field(
        default=None,
        description="attention inside fixed chunks of each document: the chunk's config field, and the layer_types "
        "kind of the chunked layers (None: every layer)",
        exclude_if=lambda value: value is None,
    )
    attn_sinks: bool = Field(default=False, description="a learned sink logit per head joins each softmax row")
    output_gate: str | None = Field(
        default=None,
        description="a gate projection of the block input scales the attention output before wo: "
        "<sigmoid|softplus>_per_<element|head>, or <sigmoid|softplus>_in_query (the gate is the second half "
        "of each head's rows of wq)",
    )
    output_gate_bias: bool = Field(default=False, description="the output gate's projection has a bias")
    o_bias_last_layer: bool = Field(default=False, description="the last layer's output projection alone has a bias")
    attn_sub_norm: bool = Field(
        default=False, description="a norm of the block norms' class over n_heads * head_dim on wo's input"
    )
    ffn_sub_norm: bool = Field(
        default=False, description="a norm of the block norms' class over hidden_dim on w2's input"
    )
    differential_attention: bool = Field(
        default=False,
        description="differential attention: head pairs over paired values, subtracted with a learned lambda",
        exclude_if=lambda value: not value,  # the other families' plans read as before
    )
    moe_output_norm: bool = Field(
        default=False, description="a norm of the block norms' class on the MoE's output before the residual add"
    )
    final_softcap: bool
    attn_scale: ConfigScalar | None = Field(description="config field setting the attention scale, if custom")
    attn_scale_constant: float | None = Field(
        default=None, description="a score scale no config field sets (GPT-Neo's 1.0), if custom"
    )
    embedding_scale: Literal["none", "sqrt_dim", "multiplier"]
    embedding_scale_field: str | None
    embedding_norm_module: str | None = Field(
        default=None, description="module path of a norm on the embeddings before layer 0 (its checkpoint keys)"
    )
    residual_multiplier_field: str | None
    logit_divisor_field: str | None = Field(description="config field the logits are divided by")
    positions: Literal["rope", "learned", "alibi", "sinusoidal"] = Field(
        default="rope",
        description="rotary positions, a learned or fixed sinusoidal absolute table added to the embeddings, "
        "or ALiBi score biases",
    )
    position_zero_row_field: str | None = Field(
        default=None, description="config field naming the sinusoidal table's zeroed row (pad_token_id)"
    )
    position_offset: int = Field(default=0, description="position p reads row p + offset of the learned table")
    position_table_key: str | None = Field(default=None, description="checkpoint key of the learned table")
    logit_multiplier_field: str | None = Field(default=None, description="config field the logits are multiplied by")
    rope_type: str
    partial_rotary: bool
    per_layer_rope: bool = Field(
        default=False, description="full- and sliding-attention layers rotate with their own RoPE parameters"
    )
    router_softcap_field: str | None = Field(
        default=None,
        description="config field soft-capping the router logits, off in this config: the port refuses a cap",
    )
    heads_per_layer_field: str | None = Field(
        default=None,
        description="config list of one query-head count per layer, each the head count here: the port gives "
        "every layer that count and refuses a list that differs",
    )
    layer_rotary_dims: bool = Field(
        default=False,
        description="per_layer_rope with partial rotary: full- and sliding-attention layers each rotate the "
        "share of a head their own rope_parameters give (rotary_dim, sliding_rotary_dim)",
    )
    nope_field: str | None = Field(default=None, description="config list field, 0 on the layers without RoPE")
    nope_layer_type: str | None = Field(default=None, description="the layer type whose layers apply no RoPE")
    qk_norm_after_rope: bool = Field(default=False, description="queries and keys normalised after RoPE")
    rotary_interleaved: bool
    rotary_reversed: bool = Field(
        default=False, description="each pair turns the other way: (x1, x2) -> (x2, -x1) (nanochat)"
    )
    moe: bool
    all_layers_moe: bool
    shared_expert: bool
    shared_experts_field: str | None = Field(
        default=None,
        description="config field counting shared experts each an expert wide (AReaL's num_shared_experts)",
    )
    shared_expert_width_field: str | None = Field(
        default=None,
        description="config field of an ungated shared MLP's own width (AReaL's shared_expert_intermediate_size, "
        "or the one the analysis measured)",
    )
    shared_experts_fixed: int | None = Field(
        default=None, description="shared MLPs, each an expert wide, when no config field counts them (HunYuan-MoE)"
    )
    absent_shared_experts_field: str | None = Field(
        default=None,
        description="config field counting shared experts that is 0 here: the port has none and refuses more",
    )
    hybrid_edits: list[str] = Field(
        default_factory=list,
        exclude_if=is_empty,
        description="what a hybrid's package writes on its qwen3_5 copy (skill.porting.hybrid_package)",
    )
    moe_layer_rule: str = Field(
        default="all", description="the config rule naming the MoE layers (the analysis' moe_layer_rule)"
    )
    moe_layer_fields: list[str] = Field(default_factory=list, description="config fields that rule reads")
    score_before_experts: bool = Field(
        default=False,
        description="the routing weights scale the experts' input, not their output (MoEArgs.score_before_experts)",
        exclude_if=lambda value: not value,
    )
    routed_scaling_field: str | None = Field(
        default=None, description="config field of the factor on the routed experts' weights (route_scale)"
    )
    expert_group_fields: tuple[str, str] | None = Field(
        default=None, description="config fields of the expert groups and the groups kept (grouped top-k)"
    )
    score_correction_key: str | None = Field(
        default=None, description="checkpoint key, inside a layer, of the router's score-correction bias"
    )
    group_scoring: Literal["sum_top2", "max"] = Field(
        default="sum_top2",
        description="grouped top-k: a group scored by the sum of its two best experts (AReaL's router) or by "
        "its best one (the package's MaxGroupTopKRouter)",
    )
    expert_group_switch: tuple[str, str] | None = Field(
        default=None, description="config field and value that turn the group limit on (topk_method), if any"
    )
    expert_group_switch_values: list[str] = Field(
        default_factory=list, description="every value of that field HF implements (the port refuses others)"
    )
    route_norm_fixed: bool | None = Field(
        default=None,
        description="the config's norm_topk_prob is never read: HF always (True) or never (False) renormalises",
    )
    route_norm: bool = Field(description="the router renormalises top-k weights though no config field says so")
    route_norm_field_ignored: str | None = Field(
        default=None,
        description="the renormalisation field (norm_topk_prob) the router ignores for this config's scoring: "
        "route_norm is set whatever it says, and a config turning it off under another scoring is refused",
    )
    per_layer_list_fields: list[str] = Field(
        default_factory=list, description="MoE config fields the config class accepts as per-layer lists: refused"
    )
    router_scoring: Literal["softmax", "sigmoid", "sparsemixer"] = Field(
        default="softmax",
        description="how the router scores experts: softmax over them, a sigmoid each, or sparse-mixer picks",
    )
    expert_count_field: str | None = Field(
        default=None, description="config field of the expert count, where MoEArgs.from_hf_config reads another"
    )
    top_k_field: str | None = Field(
        default=None, description="config field of experts per token, where MoEArgs.from_hf_config reads another"
    )
    expert_count_source: str | None = Field(
        default=None,
        description="the config field counting the routed experts, n_routed_experts where the config has it",
    )
    router_jitter_field: str | None = Field(
        default=None, description="sparse mixer: config field of its relative margin (jitter epsilon)"
    )
    router_scoring_field: str | None = Field(
        default=None, description="config field naming the router's scoring function, if the config has one"
    )
    expert_bias: bool = Field(
        default=False, description="the routed experts' gate, up and down projections have biases"
    )
    router_bias: bool = Field(default=False, description="the router's linear gate has a bias")
    logit_selection_bias: bool = Field(
        default=False, description="the selection bias joins the router logits before the score function"
    )
    expert_activation_fields: dict[str, str] = Field(
        default_factory=dict,
        description="clamped SwiGLU experts: their constants (alpha, limit) -> the config fields setting them; "
        "empty for SwiGLU experts",
    )
    nullable_fields: list[str] = Field(
        default_factory=list, description="config fields HF accepts as None with another forward (the analysis')"
    )
    tied: bool
    tying_field: str | None = Field(
        default="tie_word_embeddings",
        description="config field the tying follows; None: HF ties (or keeps its own head) whatever it says",
    )
    padding_idx_field: str | None = Field(
        default=None, description="config field of the embedding row HF never trains (padding_idx), if any"
    )
    lm_head_bias: bool = Field(default=False, description="the LM head (output projection) has a bias")
    embedding_projection_field: str | None = Field(
        default=None,
        description="config field of the embedding width; projections in/out where it differs from dim",
    )
    moe_layer_types_field: str | None = Field(
        default=None,
        description="config field listing each layer's MLP as 'dense' or 'sparse', when the family's MoE "
        "layers are chosen that way",
    )
    pinned_nested_fields: list[str] = Field(
        default_factory=list, description="nested config fields the forward reads, reproduced unset (refused if set)"
    )
    pinned_switches: dict[str, bool] = Field(
        default_factory=dict,
        description="boolean config fields that change the forward, with the ported value (refused if flipped)",
    )
    single_kv_head: bool = Field(
        default=False,
        description="multi-query attention no config field sets: one KV head whatever the head counts say",
    )
    rotary_style_field: str | None = Field(
        default=None, description="config field switching interleaved RoPE (deepseek_v3's rope_interleave), if any"
    )
    scalar_sources: dict[str, ConfigScalar] = Field(
        default_factory=dict,
        description="args fields of scalar factors that are no single config field (a field times a model "
        "size), and the config expression each is computed from",
    )

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
    def first_stage_modules(self) -> tuple[str, ...]:
        """Top-level modules the edits add before the first block (besides ``tok_embeddings``),
        in the order the model runs them: the first pipeline stage must keep them."""
        modules = []
        if self.positions in ("learned", "sinusoidal"):
            modules.append("pos_embeddings")
        if self.embedding_projection_field is not None:
            modules.append("project_in")
        if self.embedding_norm_module is not None:
            modules.append("embedding_norm")
        return tuple(modules)

    @property
    def last_stage_modules(self) -> tuple[str, ...]:
        """Top-level modules the edits add after the last block (besides ``norm`` and the
        head): the last pipeline stage must keep them."""
        return ("project_out",) if self.embedding_projection_field is not None else ()

    @property
    def has_shared_experts(self) -> bool:
        """Whether the MoE layers have always-active shared experts, however their width is set."""
        return self.moe and bool(
            self.shared_expert
            or self.shared_experts_field
            or self.shared_expert_width_field
            or self.shared_experts_fixed
        )

    @property
    def portable(self) -> bool:
        return not self.unsupported


def _own_qk_norm_class(width: str, qk: NormVariant | None, block: NormVariant) -> bool:
    """Whether the QK norms need a class of their own: they compute another kind than the
    block norms, or span the full width with a LayerNorm kind, whose block class (torch's
    fused layer_norm) would gather the features tensor parallelism shards."""
    return qk != block or (width == "full" and qk is not None and qk.startswith("layernorm"))


def _config_values(report: ArchitectureReport) -> dict[str, Any]:
    return {f.name: f.value for f in report.config_fields}


def plan_from_report(report: ArchitectureReport, source: str, trust_remote_code: bool = False) -> PortPlan:
    """Translate the checklist into the engine's decisions (no measurement here)."""
    cl = report.checklist
    att, ffn, moe, pos, norm, sc = cl.attention, cl.ffn, cl.moe, cl.positions, cl.norm, cl.scalars
    values = _config_values(report)
    qk_norm: Literal["none", "per_head", "full"] = (
        "none" if att.qk_norm is QKNormKind.NONE else "full" if att.qk_norm_full_width else "per_head"
    )
    norm_kind = NORM_VARIANTS.get(norm.kind, "rms")
    qk_variant = NORM_VARIANTS.get(att.qk_norm_computation) if att.qk_norm_computation is not None else None
    plan_kv_field = next((f.name for f in report.config_fields if f.archon_field == "n_kv_heads"), None)
    block: Literal["pre_norm", "sandwich", "post_norm", "parallel", "post_ln"] = {
        NormPlacement.SANDWICH: "sandwich",
        NormPlacement.POST_SUBLAYER: "post_norm",
        NormPlacement.PARALLEL: "parallel",
        NormPlacement.POST_LN: "post_ln",
    }.get(norm.placement, "pre_norm")  # type: ignore[assignment]
    embedding: Literal["none", "sqrt_dim", "multiplier"] = "none"
    if sc.embedding_scale_kind == "sqrt_dim":
        embedding = "sqrt_dim"
    elif sc.embedding_scale_kind == "constant" and sc.embedding_scale_source is not None:
        embedding = "multiplier"
    logit = sc.logit_multiplier_source
    residual = sc.residual_multiplier_source
    # A factor that also depends on a model size gets an args field of its role, computed
    # from its config expression (MiniCPM: scale_depth / sqrt(num_hidden_layers)).
    derived: dict[str, ConfigScalar] = {}
    residual_field = sc.residual_multiplier_field
    if residual is not None and residual.times is not None:
        residual_field = "residual_multiplier"
        derived[residual_field] = residual
    logit_multiplier = logit.field if logit is not None and logit.relation == "x" else None
    if logit is not None and logit.times is not None:
        logit_multiplier = "logit_multiplier"
        derived[logit_multiplier] = logit
        logit = None
    logit_divisor = logit.field if logit is not None and logit.relation == "1/x" else None
    scale = att.scaling_source if att.custom_scaling else None
    n_layers = moe.n_layers if moe is not None else 0
    scoring: Literal["softmax", "sigmoid", "sparsemixer"] = "softmax"
    if moe is not None and moe.router_scoring is RouterScoring.SIGMOID:
        scoring = "sigmoid"
    elif moe is not None and moe.router_scoring is RouterScoring.SPARSEMIXER:
        scoring = "sparsemixer"
    scoring_field = next(
        (
            f.name
            for f in report.config_fields
            if f.archon_field == "moe_args.score_func" and f.value in ("softmax", "sigmoid")
        ),
        None,
    )
    plan = PortPlan(
        source=source,
        trust_remote_code=trust_remote_code,
        model_type=report.model_type,
        config_class=report.config_class,
        reference=reference_for(
            att.per_head_qk_norm,
            moe is not None,
            mla=att.mla is not None,
            hybrid=report.checklist.linear_attention is not None,
        ),
        unsupported=list(report.unsupported),
        feature_modules=dict(report.checklist.feature_modules),
        hand_edit_places=dict(report.hand_edit_places),
        qkv_bias=att.q_bias or att.k_bias or att.v_bias,
        o_bias=att.o_bias,
        mlp_bias=ffn.bias,
        mqa_flag=att.mqa_flag,
        kv_heads_field=plan_kv_field,
        qkv_blocks=att.fused_qkv_blocks if att.fused_qkv_layout is FusedQKVLayout.BLOCKED else None,
        qk_norm=qk_norm,
        qk_norm_variant=qk_variant
        if qk_norm != "none" and _own_qk_norm_class(qk_norm, qk_variant, norm_kind)
        else None,
        norm=norm_kind,
        block=block,
        final_norm=norm.final_norm,
        shared_block_norm=block == "parallel" and "pre_ffn" not in norm.block_norms.values(),
        mlp="plain" if ffn.kind is FFNKind.PLAIN else "gated",
        activation=ffn.activation,
        activation_field=ffn.activation_field,
        ffn_width_field=ffn.intermediate_size_field,
        ffn_width_multiple=ffn.intermediate_multiple,
        ffn_width_ratio_field=ffn.intermediate_ratio_field,
        norm_eps_field=norm.eps_field or "rms_norm_eps",
        norm_eps_fixed=norm.eps if norm.eps_field is None else None,
        indexer=att.mla.indexer if att.mla is not None else None,
        latent_norm_eps_from_config=att.mla is not None
        and att.mla.latent_norm_eps_field is not None
        and att.mla.latent_norm_eps_field == norm.eps_field,
        clip_qkv_field=att.clip_qkv_field,
        query_position_scale=att.query_position_scale,
        clip_after_qk_norm=bool(att.clip_qkv_after_qk_norm) and att.qk_norm is not QKNormKind.NONE,
        sliding_window=att.sliding_window.kind is not SlidingWindowKind.NONE,
        sliding_layer_types=att.sliding_window.kind is SlidingWindowKind.PER_LAYER_PATTERN,
        window_field=att.sliding_window.size_field or "sliding_window",
        layer_kinds_field=att.sliding_window.layer_kinds_field or "layer_types",
        windowed_kind=att.sliding_window.windowed_kind or "sliding_attention",
        attn_softcap=att.logit_softcap is not None,
        chunked_attention=att.chunked,
        qk_norm_rope_layers_only=bool(att.qk_norm_rope_layers_only),
        attn_sinks=att.sinks,
        output_gate=att.output_gate_kind.value if att.output_gate and att.output_gate_kind else None,
        o_bias_last_layer=att.o_bias_last_layer_key is not None,
        attn_sub_norm=att.sub_norm is not None,
        ffn_sub_norm=ffn.sub_norm is not None,
        differential_attention=att.differential is not None,
        moe_output_norm=moe is not None and moe.output_norm is not None,
        output_gate_bias=att.output_gate_bias,
        final_softcap=sc.final_logit_softcap is not None,
        attn_scale=scale,
        attn_scale_constant=att.scaling_constant if att.custom_scaling else None,
        embedding_scale=embedding,
        embedding_scale_field=sc.embedding_scale_source.field
        if embedding == "multiplier" and sc.embedding_scale_source
        else None,
        embedding_norm_module=sc.embedding_norm_module,
        residual_multiplier_field=residual_field,
        logit_divisor_field=logit_divisor,
        positions=POSITION_PLANS.get(pos.kind, "rope"),
        position_offset=pos.table_offset,
        position_table_key=pos.table_key,
        position_zero_row_field=pos.table_zero_row_field,
        logit_multiplier_field=logit_multiplier,
        rope_type=pos.rope_type or "default",
        partial_rotary=pos.partial_rotary_factor != 1.0 or bool(pos.layer_rotary_factors),
        layer_rotary_dims=pos.per_layer_type_rope and bool(pos.layer_rotary_factors),
        rotary_interleaved=pos.rotary_style is RotaryStyle.INTERLEAVED,
        rotary_reversed=pos.rotary_direction is RotaryDirection.REVERSED,
        per_layer_rope=pos.per_layer_type_rope,
        heads_per_layer_field=att.heads_per_layer_field,
        router_softcap_field=moe.router_softcap_field if moe is not None else None,
        score_before_experts=moe is not None and bool(moe.score_before_experts),
        nope_field=att.nope_layers_field,
        nope_layer_type=att.nope_layer_type,
        qk_norm_after_rope=att.qk_norm_placement is QKNormPlacement.AFTER_ROPE,
        moe=moe is not None,
        # Every layer routes to experts, and the config has no field of a per-layer rule
        # that a checkpoint could set otherwise.
        all_layers_moe=moe is not None and bool(n_layers) and moe.moe_layer_rule == "all",
        shared_expert=moe is not None and moe.shared_expert_gate,
        shared_experts_field=moe.shared_experts_field
        if moe is not None and moe.shared_expert_width == "experts_multiple"
        else None,
        shared_expert_width_field=(moe.shared_expert_width_field or "shared_expert_intermediate_size")
        if moe is not None and moe.shared_expert_width == "own_field" and not moe.shared_expert_gate
        else None,
        shared_experts_fixed=moe.shared_experts
        if moe is not None and moe.shared_expert_width == "experts_multiple" and moe.shared_experts_field is None
        else None,
        absent_shared_experts_field=moe.shared_experts_field if moe is not None and moe.shared_experts == 0 else None,
        moe_layer_rule=moe.moe_layer_rule if moe is not None else "all",
        moe_layer_fields=list(moe.moe_layer_fields) if moe is not None else [],
        routed_scaling_field=moe.routed_scaling_field if moe is not None else None,
        expert_group_fields=(moe.n_group_field, moe.topk_group_field)
        if moe is not None and moe.n_group_field and moe.topk_group_field
        else None,
        score_correction_key=moe.score_correction_key or None if moe is not None else None,
        group_scoring="max" if moe is not None and moe.group_scoring == "max" else "sum_top2",
        expert_group_switch=(moe.group_switch_field, moe.group_switch_value)
        if moe is not None and moe.group_switch_field and moe.group_switch_value
        else None,
        expert_group_switch_values=list(moe.group_switch_values) if moe is not None else [],
        route_norm_fixed=moe.renormalises_when_ignored
        if moe is not None and moe.norm_topk_prob_ignored and moe.renormalises_when_ignored is not None
        else None,
        # norm_topk_prob read by MoEArgs.from_hf_config unless ignored; the qwen3 path forces
        # route_norm only where HF always renormalises.
        route_norm=moe is not None
        and (
            moe.renormalises_when_ignored is True
            if moe.norm_topk_prob_ignored
            else moe.norm_topk_prob and "norm_topk_prob" not in values
        ),
        route_norm_field_ignored="norm_topk_prob"
        if moe is not None and moe.norm_topk_prob_ignored and "norm_topk_prob" in values
        else None,
        per_layer_list_fields=list(moe.per_layer_list_fields) if moe is not None else [],
        router_scoring=scoring,
        router_scoring_field=scoring_field if moe is not None else None,
        expert_count_field=moe.num_experts_field
        if moe is not None and moe.num_experts_field not in (None, *AREAL_MOE_COUNT_FIELDS)
        else None,
        # DeepSeek's n_routed_experts where the config has it (DeepSeek-V2 maps num_experts onto it).
        expert_count_source=("n_routed_experts" if "n_routed_experts" in values else moe.num_experts_field)
        if moe is not None
        else None,
        top_k_field=moe.top_k_field
        if moe is not None and moe.top_k_field not in (None, AREAL_MOE_TOP_K_FIELD)
        else None,
        router_jitter_field=moe.router_jitter_field if moe is not None and scoring == "sparsemixer" else None,
        expert_bias=moe is not None and moe.expert_bias,
        router_bias=moe is not None and moe.router_bias,
        logit_selection_bias=moe is not None and moe.selection_bias_placement == "logits",
        expert_activation_fields=dict(ffn.activation_fields)
        if moe is not None and ffn.activation == "clamped_swiglu"
        else {},
        nullable_fields=list(report.checklist.nullable_fields),
        tied=sc.tie_word_embeddings,
        tying_field=sc.tying_field,
        padding_idx_field=sc.padding_idx_field,
        lm_head_bias=sc.lm_head_bias,
        embedding_projection_field=sc.embedding_projection_field,
        moe_layer_types_field=next(
            (
                name
                for name, value in values.items()
                if isinstance(value, list) and value and set(value) <= {"dense", "sparse"}
            ),
            None,
        )
        if moe is not None
        else None,
        pinned_nested_fields=list(cl.pinned_nested_fields),
        pinned_switches=dict(cl.forward_switches),
        # One KV head fixed by the attention, not read from a count: no count field, or a set
        # multi-query switch the attention reads instead (transformers 5.25's FalconConfig also
        # carries num_key_value_heads, for the KV cache only).
        single_kv_head=(plan_kv_field is None or att.mqa_flag is not None)
        and att.n_kv_heads == 1
        and (att.n_heads or 1) > 1,
        scalar_sources=derived,
        rotary_style_field="rope_interleave" if "rope_interleave" in values else None,
    )
    if report.checklist.linear_attention is not None:
        plan = plan.model_copy(update={"hybrid_edits": hybrid_edit_names(plan, report.checklist.linear_attention)})
    return plan


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
        raise unsupported_error(plan.model_type, plan.unsupported, step, plan.reference)


def refuse_unedited_reference(plan: PortPlan, step: str) -> None:
    """Refuse, in one line, to mark hand edits in a copy of a reference whose modules no edit
    targets (``allow_unsupported`` with features no edit supports)."""
    if plan.reference in UNEDITED_REFERENCES:
        raise UnsupportedFeatureError(
            f"{step} marks no hand edit in a copy of the {plan.reference} reference ({plan.model_type}): after "
            f"copy_reference {plan.reference}, write the family's differences by hand.",
            list(plan.unsupported),
        )


def skipped_features(plan: PortPlan, allow_unsupported: bool) -> list[str]:
    """What a step that took ``allow_unsupported`` left for hand edits: the report's
    ``unsupported`` list, the one fact every step (``analyze_hf_model``, ``edit_args``,
    ``edit_model``) reports; nothing when the step was not allowed past them."""
    return list(plan.unsupported) if allow_unsupported else []
