"""The nearest hand-written reference and the ordered feature deltas from it.

The references (``qwen2``; ``qwen3`` with its ``qwen3_moe`` variant; ``deepseek_v3`` for
multi-head latent attention; ``qwen3_5`` for Gated DeltaNet layers beside full attention) are
analysed by the same rules as any family, so their
feature values are measured, not typed in. Which reference a family starts from is one
structural rule (:func:`reference_for`) that the porting engine shares. From ``qwen2`` or
``qwen3`` a delta is supported when one of those two already has the target value or an
engine edit produces it (``skill.features.SUPPORTED_EDITS``); the edits are written
against their module contract. From ``deepseek_v3`` a delta is supported where the
reference itself has the value, or one of the few edits written for its block contract
produces it (``REFERENCE_EDITS``): no edit applies to its attention or router yet.
"""

from __future__ import annotations

import functools
import logging

from skill.activations import ACTIVATIONS
from skill.analysis.measure import build_checklist, build_variant_checklist
from skill.feature_modules import MODULES_BY_NAME
from skill.features import (
    EDITABLE_REFERENCES,
    FEATURE_TITLES,
    HYBRID_LINEAR_ATTENTION,
    MLA_SUPPORTED_EDITS,
    Checklist,
    ExpertLayout,
    Feature,
    FeatureDelta,
    FFNKind,
    NormKind,
    PositionKind,
    QKNormKind,
    QKNormPlacement,
    RotaryDirection,
    feature_values,
    is_supported,
)

logger = logging.getLogger(__name__)

# Reference name -> the model types whose analysis gives its feature values (dense first).
REFERENCES: dict[str, tuple[str, ...]] = {
    "qwen2": ("qwen2",),
    "qwen3": ("qwen3", "qwen3_moe"),
    "deepseek_v3": ("deepseek_v3",),
    "qwen3_5": ("qwen3_5_text", "qwen3_5_moe_text"),
}
# Of a reference no edit of the whole table targets, the feature values the edits that do
# apply to it produce (skill.features.MLA_SUPPORTED_EDITS, model_edits.MLA_MODEL_EDITS).
REFERENCE_EDITS: dict[str, dict[Feature, frozenset[str]]] = {
    "deepseek_v3": MLA_SUPPORTED_EDITS,
    # A hybrid's package (skill.porting.hybrid_package): stacked mixer weights, a MoE layer rule.
    "qwen3_5": {
        Feature.LINEAR_ATTENTION: HYBRID_LINEAR_ATTENTION,
        Feature.MOE_LAYER_PATTERN: frozenset({"all", "interleaved", "leading_dense"}),
    },
}
# Config fields a reference's own code reads, set otherwise than in its default config: the
# values measured on these variants are values the reference produces without an edit
# (each variant is a case of the reference's stage tests, tests/archon/test_<reference>.py).
REFERENCE_VARIANTS: dict[str, tuple[tuple[tuple[str, object], ...], ...]] = {
    # A head_dim other than hidden_size / num_attention_heads (Qwen3.5-MoE's 256 on 2048 / 16).
    "qwen3_5": ((("head_dim", 32),),),
    "deepseek_v3": (
        # One expert group (no group limit), no renormalisation, MoE from layer 0, half-rotation
        # RoPE, tied embeddings.
        (
            ("n_group", 1),
            ("topk_group", 1),
            ("norm_topk_prob", False),
            ("first_k_dense_replace", 0),
            ("rope_interleave", False),
            ("tie_word_embeddings", True),
        ),
        # YaRN with mscale / mscale_all_dim.
        (
            (
                "rope_parameters",
                {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 0.8,
                    "mscale_all_dim": 1.0,
                },
            ),
        ),
    ),
}


@functools.cache
def reference_values(model_type: str) -> dict[Feature, str]:
    """Feature values of a reference model type, measured by the analyser itself."""
    return feature_values(build_checklist(model_type))


def _values_for(reference: str, moe: bool) -> dict[Feature, str]:
    types = REFERENCES[reference]
    chosen = types[-1] if moe and len(types) > 1 else types[0]
    return reference_values(chosen)


@functools.cache
def variant_values(reference: str, index: int) -> dict[Feature, str]:
    """Feature values of ``REFERENCE_VARIANTS[reference][index]``, measured."""
    return feature_values(build_variant_checklist(REFERENCES[reference][0], REFERENCE_VARIANTS[reference][index]))


def all_reference_values(references: tuple[str, ...] = EDITABLE_REFERENCES) -> dict[Feature, set[str]]:
    """Every value any of ``references`` has, per feature (what needs no edit at all)."""
    merged: dict[Feature, set[str]] = {}
    for reference in references:
        measured = [reference_values(model_type) for model_type in REFERENCES[reference]]
        measured += [variant_values(reference, i) for i in range(len(REFERENCE_VARIANTS.get(reference, ())))]
        for values in measured:
            for feature, value in values.items():
                merged.setdefault(feature, set()).add(value)
    return merged


def deltas_from(reference: str, checklist: Checklist) -> list[FeatureDelta]:
    """Features whose value differs from ``reference``, in :class:`Feature` order, then those a
    feature module ports (none of which a reference has)."""
    target = feature_values(checklist)
    ref = _values_for(reference, checklist.moe is not None)
    editable = reference in EDITABLE_REFERENCES
    covered = all_reference_values() if editable else all_reference_values((reference,))
    deltas = []
    for feature in Feature:
        if feature not in target:
            # The target has no such part (no RoPE details without RoPE): the delta on the
            # enclosing feature (position kind, MoE) already says it.
            continue
        want = target.get(feature, "n/a")
        have = ref.get(feature, "n/a")
        if want == have:
            continue
        if feature is Feature.OTHER and want == "":
            continue
        deltas.append(
            FeatureDelta(
                feature=feature,
                title=FEATURE_TITLES[feature],
                reference=have,
                target=want,
                supported=is_supported(feature, want, frozenset(covered.get(feature, set())))
                if editable
                else want in covered.get(feature, set()) | REFERENCE_EDITS.get(reference, {}).get(feature, set()),
            )
        )
    for name, value in checklist.feature_modules.items():
        module = MODULES_BY_NAME[name]
        deltas.append(
            FeatureDelta(
                feature=name,
                title=module.title,
                reference="none",
                target=module.describe(value),
                supported=reference in module.references,
            )
        )
    return deltas


def reference_for(per_head_qk_norm: bool, moe: bool, mla: bool = False, hybrid: bool = False) -> str:
    """The one rule for which reference a family starts from (the analyser and the engine).

    Linear-attention layers beside attention (``Feature.LINEAR_ATTENTION``, a hybrid) start
    from qwen3_5, the only reference with a Gated DeltaNet. Multi-head latent attention
    (``Feature.MLA``) starts from deepseek_v3, whose attention is the only one with query/KV
    latents and a shared RoPE key. Otherwise qwen3 carries MoE (and per-head QK norm); every
    dense family starts from qwen2, whose copy gets a per-head or full-width QK norm by an
    edit: a dense family copied from qwen3 would keep its MoE machinery. ``per_head_qk_norm``
    no longer decides it.
    """
    if hybrid:
        return "qwen3_5"
    if mla:
        return "deepseek_v3"
    return "qwen3" if moe else "qwen2"


def nearest_reference(checklist: Checklist) -> tuple[str, list[FeatureDelta]]:
    """The reference the engine copies for this family, and the deltas from it."""
    reference = reference_for(
        checklist.attention.per_head_qk_norm,
        checklist.moe is not None,
        mla=checklist.attention.mla is not None,
        hybrid=checklist.linear_attention is not None,
    )
    return reference, deltas_from(reference, checklist)


def _differential_limits(checklist: Checklist) -> list[str]:
    """What differential attention does not compose with: the port orders wq/wk/wv's heads so
    that each head pair and its two KV heads sit side by side (a tensor-parallel rank holds
    whole pairs), so whatever else is laid out per head or over all heads' rows is refused."""
    att = checklist.attention
    assert att.differential is not None
    beside = {
        "a fused q/k/v projection": att.fused_qkv,
        "Conv1D-stored projections": bool(checklist.transposed_weights),
        "attention sinks": att.sinks,
        "ALiBi": checklist.positions.kind is PositionKind.ALIBI,
        "a gated attention output": att.output_gate,
        "a norm before the output projection": att.sub_norm is not None,
        "a full-width QK norm": att.qk_norm is not QKNormKind.NONE and att.qk_norm_full_width,
    }
    limits = [f"differential attention with {what}" for what, present in beside.items() if present]
    block_eps = checklist.norm.eps
    if block_eps is None or abs(att.differential.norm_eps - block_eps) > 1e-3 * block_eps:
        limits.append(
            f"differential attention whose pair norm's epsilon ({att.differential.norm_eps:g}) is not the "
            f"block norms' ({'unmeasured' if block_eps is None else f'{block_eps:g}'})"
        )
    return limits


def engine_limits(checklist: Checklist) -> list[str]:
    """Values the vocabulary marks supported whose port still needs a fact the engine lacks:
    a factor no config field explains (the port reads every factor from the config), a
    checkpoint without a norm epsilon, experts outside the MoE block the adapter maps."""
    limits = []
    att, sc, norm, moe = checklist.attention, checklist.scalars, checklist.norm, checklist.moe
    if att.qk_norm is not QKNormKind.NONE and att.qk_norm_computation in (None, NormKind.OTHER):
        # The QK norm is built as what it computes (model_edits.qk_norm_kind): a kind of the
        # norm vocabulary, whatever the block norms compute.
        limits.append("QK norm computing no kind of the norm vocabulary")
    clipped = att.clip_qkv is not None or att.clip_qkv_field is not None
    if clipped and att.qk_norm is not QKNormKind.NONE:
        # The clip edit clamps q/k before or after the QK norm, in the order the probe measured.
        if att.clip_qkv_after_qk_norm is None:
            limits.append("q/k/v clipping together with a QK norm (their order is not measured)")
        elif att.clip_qkv_after_qk_norm and att.qk_norm_placement is QKNormPlacement.AFTER_ROPE:
            limits.append("q/k clipped after a QK norm that follows RoPE")
    if norm.eps_field is None and norm.eps is None:
        limits.append("norm epsilon with no config field that no probe measured")
    if sc.embedding_scale_kind == "constant" and sc.embedding_scale_source is None:
        limits.append(f"embedding scale {sc.embedding_scale} that no config field explains")
    if sc.embedding_scale_source is not None and sc.embedding_scale_source.relation != "x":
        limits.append(f"embedding scale {sc.embedding_scale_source.relation} of {sc.embedding_scale_source.field}")
    if sc.logit_multiplier is not None and (
        sc.logit_multiplier_source is None or sc.logit_multiplier_source.relation not in ("x", "1/x")
    ):
        limits.append(f"logit factor {sc.logit_multiplier:.4g} that is no config field or its reciprocal")
    if (
        att.custom_scaling
        and att.mla is None
        and att.scaling_constant is None
        and (att.scaling_source is None or att.scaling_source.relation not in ("x", "x**-0.5"))
    ):
        limits.append("attention scale that no config field explains")
    if checklist.positions.kind is PositionKind.ALIBI and att.sinks:
        # (A sliding window and a soft-cap compose: WindowedAlibiAttention, SoftCappedAlibiAttention.)
        limits.append("ALiBi together with attention sinks (no kernel has both)")
    if att.differential is not None:
        limits.extend(_differential_limits(checklist))
    if att.qk_norm_placement is QKNormPlacement.AFTER_ROPE and att.qk_norm_full_width:
        # The full-width norm reads wq's output before the heads split; only a per-head one,
        # of any kind, moves after RoPE.
        limits.append("full-width QK norm after RoPE (only a per-head one moves after it)")
    pos = checklist.positions
    if pos.rotary_direction is RotaryDirection.REVERSED and pos.per_layer_type_rope:
        # The edit negates the sine of the one [cos | sin] cache; a cache per layer type is built
        # by two branches. (On the MLA reference no edit turns it: the delta says so.)
        limits.append("RoPE turning each pair the other way with RoPE parameters per layer type")
    if pos.per_layer_type_rope and not att.sliding_window.layer_pattern:
        limits.append("per-layer-type RoPE without a per-layer layer_types pattern")
    kinds_field = att.sliding_window.layer_kinds_field
    if kinds_field is not None and (pos.per_layer_type_rope or att.nope_layer_type is not None):
        # The args carry one per-layer kinds tuple; these read layer_types, the window another field.
        limits.append(f"a window chosen by {kinds_field} beside RoPE or NoPE chosen by layer_types")
    if sc.embedding_norm is not None and sc.embedding_norm is not norm.kind:
        limits.append(f"embedding norm of kind {sc.embedding_norm.value} beside {norm.kind.value} block norms")
    # The sub-norm edits build the block norms' class over the projection's input width.
    if att.sub_norm is not None and att.sub_norm is not norm.kind:
        limits.append(
            f"norm before the attention output projection of kind {att.sub_norm.value} "
            f"beside {norm.kind.value} block norms"
        )
    if checklist.ffn.sub_norm is not None and checklist.ffn.sub_norm is not norm.kind:
        limits.append(
            f"norm before the down projection of kind {checklist.ffn.sub_norm.value} "
            f"beside {norm.kind.value} block norms"
        )
    if moe is not None and moe.output_norm is not None and moe.output_norm is not norm.kind:
        limits.append(
            f"norm on the MoE block's output of kind {moe.output_norm.value} beside {norm.kind.value} block norms"
        )
    if checklist.ffn.sub_norm is not None and moe is not None:
        # FeedForward also builds the shared experts, whose MLP has no such norm measured.
        limits.append("norm before the down projection of a MoE family's dense MLP")
    pos = checklist.positions
    if pos.kind is PositionKind.LEARNED:
        if pos.table_key is None:
            limits.append("learned position table saved under no key of its module")
        if pos.table_rows_field != "max_position_embeddings":
            limits.append(
                f"learned position table sized by {pos.table_rows_field or 'no config field'}"
                " (the port sizes it by max_position_embeddings)"
            )
    ffn = checklist.ffn
    if ffn.activation == "clamped_swiglu":
        # The clamped SwiGLU is an experts' activation: the edit subclasses the routed experts
        # (biased or not) and the shared experts' FeedForward, not a dense layer's MLP.
        if moe is None:
            limits.append("clamped SwiGLU in a dense MLP (only routed and shared experts get it)")
        elif moe.n_layers and len(moe.moe_layers) != moe.n_layers:
            limits.append("clamped SwiGLU experts beside dense layers (the dense MLP's activation is unmeasured)")
        if set(ffn.activation_fields) != {"alpha", "limit"}:
            limits.append("clamped SwiGLU whose alpha and limit no config field sets")
    if moe is not None and moe.shared_expert_gate and moe.shared_expert_width_field is not None:
        limits.append(
            f"gated shared expert as wide as {moe.shared_expert_width_field} (the gated shared expert's edit"
            " reads shared_expert_intermediate_size)"
        )
    if moe is not None:
        if ffn.activation in ACTIVATIONS and ACTIVATIONS[ffn.activation].module:
            # A learned activation is a module with parameters: the grouped experts have none per expert.
            limits.append(f"MoE experts with the learned {ffn.activation!r} activation (no per-expert parameters)")
        if moe.expert_bias and moe.expert_layout is not ExpertLayout.FUSED_3D:
            limits.append("expert projection biases stored per expert (the adapter maps fused 3D ones)")
        elif moe.expert_bias and checklist.ffn.kind is not FFNKind.GATED:
            limits.append("expert projection biases on ungated experts")
        elif moe.expert_bias and (len(moe.expert_bias_key_templates) != 2 or not all(moe.expert_bias_key_templates)):
            limits.append("expert projection biases the analyser cannot place on the in- and down projection")
        template = moe.expert_key_template
        if checklist.attention.mla is not None and template and ".{}.mlp.experts." not in template:
            # The MLA reference's adapter is not derived from the checkpoint: it reads DeepSeek's names.
            limits.append(f"MoE experts of an MLA family stored under another module than mlp ({template})")
    return limits


def hybrid_limits(checklist: Checklist, model_type: str) -> list[str]:
    """What a hybrid of another model type than the qwen3_5 reference's needs that the engine
    cannot write (skill.porting.hybrid_package writes the rest): a package without experts (the
    reference's MoE machinery would stay), and a router renormalising otherwise than Qwen3.5's
    (always) or as ``norm_topk_prob`` says."""
    if checklist.linear_attention is None or model_type in REFERENCES["qwen3_5"]:
        return []
    moe = checklist.moe
    if moe is None:
        return ["a hybrid without experts under its own model type (the qwen3_5 reference's MoE machinery would stay)"]
    if moe.norm_topk_prob_ignored and moe.renormalises_when_ignored is not True:
        return ["a hybrid's router that never renormalises its top-k weights, whatever norm_topk_prob says"]
    return []


def unsupported_names(checklist: Checklist, deltas: list[FeatureDelta], model_type: str) -> list[str]:
    """Plain names of what no reference or edit covers: "unsupported: attention sinks"."""
    limits = engine_limits(checklist) + hybrid_limits(checklist, model_type)
    names = [f"unsupported: {limit}" for limit in limits]
    for delta in deltas:
        if delta.supported:
            continue
        if delta.feature == Feature.OTHER:
            names.extend(f"unsupported: {item}" for item in checklist.other)
        elif delta.target in ("true", "false"):
            names.append(f"unsupported: {delta.title}" + ("" if delta.target == "true" else " (absent)"))
        else:
            names.append(f"unsupported: {delta.title} = {delta.target}")
    return names
