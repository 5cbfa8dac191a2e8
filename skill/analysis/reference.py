"""The nearest hand-written reference and the ordered feature deltas from it.

The references (``qwen2``; ``qwen3`` with its ``qwen3_moe`` variant) are analysed by the
same rules as any family, so their feature values are measured, not typed in. Which
reference a family starts from is one structural rule (:func:`reference_for`) that the
porting engine shares; a delta is supported when some
reference already has the target value or an engine edit produces it
(``skill.features.SUPPORTED_EDITS``).
"""

from __future__ import annotations

import functools
import logging

from skill.analysis.measure import build_checklist
from skill.features import (
    FEATURE_TITLES,
    Checklist,
    Feature,
    FeatureDelta,
    QKNormKind,
    feature_values,
    is_supported,
)

logger = logging.getLogger(__name__)

# Reference name -> the model types whose analysis gives its feature values (dense first).
REFERENCES: dict[str, tuple[str, ...]] = {"qwen2": ("qwen2",), "qwen3": ("qwen3", "qwen3_moe")}


@functools.cache
def reference_values(model_type: str) -> dict[Feature, str]:
    """Feature values of a reference model type, measured by the analyser itself."""
    return feature_values(build_checklist(model_type))


def _values_for(reference: str, moe: bool) -> dict[Feature, str]:
    types = REFERENCES[reference]
    chosen = types[-1] if moe and len(types) > 1 else types[0]
    return reference_values(chosen)


def all_reference_values() -> dict[Feature, set[str]]:
    """Every value any reference has, per feature (what needs no edit at all)."""
    merged: dict[Feature, set[str]] = {}
    for types in REFERENCES.values():
        for model_type in types:
            for feature, value in reference_values(model_type).items():
                merged.setdefault(feature, set()).add(value)
    return merged


def deltas_from(reference: str, checklist: Checklist) -> list[FeatureDelta]:
    """Features whose value differs from ``reference``, in :class:`Feature` order."""
    target = feature_values(checklist)
    ref = _values_for(reference, checklist.moe is not None)
    covered = all_reference_values()
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
                supported=is_supported(feature, want, frozenset(covered.get(feature, set()))),
            )
        )
    return deltas


def reference_for(per_head_qk_norm: bool, moe: bool) -> str:
    """The one rule for which reference a family starts from (the analyser and the engine).

    qwen3 carries per-head QK norm and MoE; every other family starts from qwen2. A
    full-width QK norm (OLMo2) is an edit on qwen2: qwen3's norm sits after the heads
    split, and a dense family copied from qwen3 would keep its MoE machinery.
    """
    return "qwen3" if per_head_qk_norm or moe else "qwen2"


def nearest_reference(checklist: Checklist) -> tuple[str, list[FeatureDelta]]:
    """The reference the engine copies for this family, and the deltas from it."""
    reference = reference_for(checklist.attention.qk_norm is QKNormKind.PER_HEAD_RMS, checklist.moe is not None)
    return reference, deltas_from(reference, checklist)


def engine_limits(checklist: Checklist) -> list[str]:
    """Values the vocabulary marks supported whose port still needs a fact the engine lacks:
    a factor no config field explains (the port reads every factor from the config), a
    checkpoint without a norm epsilon, experts outside the MoE block the adapter maps."""
    limits = []
    att, sc, norm, moe = checklist.attention, checklist.scalars, checklist.norm, checklist.moe
    if norm.eps_field is None:
        limits.append("norm epsilon with no config field (the port reads eps from the config)")
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
        and (att.scaling_source is None or att.scaling_source.relation not in ("x", "x**-0.5"))
    ):
        limits.append("attention scale that no config field explains")
    if moe is not None:
        if checklist.ffn.activation != "silu":
            limits.append(f"MoE experts with the {checklist.ffn.activation!r} activation (shared experts run SiLU)")
        template = moe.expert_key_template
        if template and not any(f".{block}.experts." in template for block in ("mlp", "block_sparse_moe")):
            limits.append(f"MoE experts stored under another module than mlp or block_sparse_moe ({template})")
    return limits


def unsupported_names(checklist: Checklist, deltas: list[FeatureDelta]) -> list[str]:
    """Plain names of what no reference or edit covers: "unsupported: attention sinks"."""
    names = [f"unsupported: {limit}" for limit in engine_limits(checklist)]
    for delta in deltas:
        if delta.supported:
            continue
        if delta.feature is Feature.OTHER:
            names.extend(f"unsupported: {item}" for item in checklist.other)
        elif delta.target in ("true", "false"):
            names.append(f"unsupported: {delta.title}" + ("" if delta.target == "true" else " (absent)"))
        else:
            names.append(f"unsupported: {delta.title} = {delta.target}")
    return names
