"""The measurement behind ``analyze_hf_model``: a family's checklist.

Reads the config, builds a tiny seeded instance, saves it to see the on-disk keys,
walks its module tree, probes it numerically and scans its modeling source. The
references' checklists come from here too (``skill.analysis.reference`` measures them
with :func:`build_checklist`), so this module knows nothing of references; the report
(:mod:`skill.analysis.analyze`) puts the measurement and the nearest reference together.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from skill.analysis import detect, probes
from skill.analysis import modules as mt
from skill.analysis.inputs import (
    AnalysisError,
    ResolvedSource,
    check_decoder_only,
    hybrid_refusal,
    non_attention_config_fields,
    resolve_source,
)
from skill.analysis.linear_attention import HybridRefused, HybridStack, measure_hybrid, mixer_layers
from skill.analysis.rope_layer_qk_norm import qk_norm_on_rope_layers
from skill.analysis.source_scan import scan_model_source
from skill.feature_modules import MODULES_BY_NAME, claim_facts
from skill.features import Checklist
from skill.tiny_model import (
    TinyModelError,
    build_tiny_model,
    saved_checkpoint_keys,
    tiny_config,
)

logger = logging.getLogger(__name__)

# Deeper stacks than this are not instantiated (even on the meta device) to list MoE
# and no-RoPE layers; the tiny stack's pattern is reported instead.
MAX_DEEP_LAYERS = 256


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the tiny probes on one intra-op thread.

    Tiny matrices gain nothing from threads, and on a busy machine the thread pool's
    spinning makes each forward ten times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Analysis:
    resolved: ResolvedSource
    checklist: Checklist
    context: detect.Context


def layer_prefix(keys: list[str], n_layers: int) -> str:
    """The key prefix of layer 0: the path whose numeric segment runs over every layer."""
    indices: dict[str, set[int]] = {}
    for key in keys:
        match = re.match(r"^(.*?\.)(\d+)\.", key)
        if match:
            indices.setdefault(match.group(1), set()).add(int(match.group(2)))
    for prefix, seen in sorted(indices.items(), key=lambda item: (-len(item[1]), item[0])):
        if seen == set(range(n_layers)):
            return f"{prefix}0."
    for prefix, seen in indices.items():
        if 0 in seen:
            return f"{prefix}0."
    return ""


def _deep_model(
    config: PretrainedConfig, tiny: PretrainedConfig, model: PreTrainedModel, trust_remote_code: bool
) -> nn.Module | None:
    """Tiny widths at full depth, seeded on the CPU: which layers are MoE, which skip RoPE,
    which differ from layer 0. At 64 wide, a few hundred layers build and run in well under
    a second."""
    n_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_layers, int) or n_layers > MAX_DEEP_LAYERS:
        return None
    if n_layers == tiny.num_hidden_layers:
        return model  # the tiny stack is already full depth
    try:
        deep = tiny_config(config, num_hidden_layers=n_layers)
        return build_tiny_model(deep, seed=0, trust_remote_code=trust_remote_code)
    except Exception as exc:
        logger.debug("full-depth model of %s failed: %s", config.model_type, exc)
        return None


def analyse(resolved: ResolvedSource, trust_remote_code: bool, attention_twin: bool = False) -> Analysis:
    """The family's checklist. ``attention_twin``: ``resolved`` is a hybrid's attention-only twin
    (:mod:`skill.analysis.linear_attention`), whose config still holds its mixers' fields."""
    config = resolved.config
    check_decoder_only(config, mixers_measured=True)
    evidence = [] if attention_twin else non_attention_config_fields(config)
    try:
        tiny = tiny_config(config)
        model = build_tiny_model(tiny, seed=0, trust_remote_code=trust_remote_code)
    except TinyModelError as exc:
        if evidence:
            raise hybrid_refusal(config.model_type, f"config: {', '.join(evidence[:4])}") from exc
        if not _builds_at_full_size(config, trust_remote_code):
            raise AnalysisError(
                f"transformers cannot instantiate {config.model_type!r} from this config even at full size "
                f"({exc.__cause__ or exc}); analyse a published checkpoint's config.json of the family instead"
            ) from exc
        raise AnalysisError(
            f"{config.model_type!r}: a tiny instance cannot be built ({exc}); "
            "check the config's sizes, or report the family to the archon-port maintainers"
        ) from exc
    if not attention_twin:
        hybrid = _hybrid_stack(config, tiny, model, evidence)
        if hybrid is not None:
            twin = analyse(replace(resolved, config=hybrid.attention_only), trust_remote_code, attention_twin=True)
            checklist = twin.checklist.model_copy(update={"linear_attention": hybrid.layers})
            return Analysis(resolved, checklist, twin.context)
    try:
        return _inspect(config, tiny, model, resolved, trust_remote_code)
    except AnalysisError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise AnalysisError(
            f"{config.model_type!r}: probing the tiny instance failed ({type(exc).__name__}: {exc}); "
            "the family needs a hand analysis, or a tiny_config override that fits its constraints"
        ) from exc


def _hybrid_stack(
    config: PretrainedConfig, tiny: PretrainedConfig, model: PreTrainedModel, evidence: list[str]
) -> HybridStack | None:
    """The measured linear-attention layers of a hybrid; ``None`` for an attention-only stack.

    Refuses, naming it, a non-attention mixer the qwen3_5 reference does not compute, and a
    config that shows such mixers (``evidence``) where the module tree holds none."""
    try:
        _, layers = mt.find_layers(model, tiny.num_hidden_layers)
    except LookupError:
        return None  # _inspect names it
    mixed = mixer_layers(layers)
    if not mixed:
        if evidence:
            raise hybrid_refusal(config.model_type, f"config: {', '.join(evidence[:4])}")
        return None
    classes = ", ".join(sorted({type(module).__name__ for _, module in mixed.values()}))
    try:
        return measure_hybrid(config, tiny, layers, mixed)
    except HybridRefused as exc:
        raise hybrid_refusal(config.model_type, f"{classes}: {exc}") from exc


def _builds_at_full_size(config: PretrainedConfig, trust_remote_code: bool) -> bool:
    """Whether transformers can build the unshrunk config (on the meta device, no memory)."""
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:
        return False
    return True


def _inspect(
    config: PretrainedConfig,
    tiny: PretrainedConfig,
    model: PreTrainedModel,
    resolved: ResolvedSource,
    trust_remote_code: bool,
) -> Analysis:
    try:
        anatomy = mt.anatomy(model, tiny.num_hidden_layers)
    except LookupError as exc:
        raise AnalysisError(
            f"{config.model_type!r} has no stack of decoder layers ({exc}); it is not a decoder-only transformer"
        ) from exc
    mixers = mt.non_attention_mixers(anatomy.layers)
    if mixers or anatomy.attention is None:
        raise hybrid_refusal(config.model_type, ", ".join(mixers) if mixers else "no attention module in layer 0")
    if not probes.probe_is_causal(model, tiny):
        raise AnalysisError(
            f"{config.model_type!r} attends to later tokens with this config (bidirectional, an encoder); Archon "
            "ports causal decoders. Use a decoder config of the family (e.g. is_decoder=True) or another family"
        )
    anatomy.final_norm = probes.final_norm_after_stack(model, anatomy, tiny)
    keys = saved_checkpoint_keys(model)
    prefix = layer_prefix(list(keys), tiny.num_hidden_layers)
    ctx = detect.Context(
        config=config,
        tiny=tiny,
        model=model,
        anatomy=anatomy,
        source=scan_model_source(model),
        saved_keys=keys,
        layer_prefix=prefix,
        deep_model=_deep_model(config, tiny, model, trust_remote_code),
        trust_remote_code=trust_remote_code,
    )
    attention = detect.attention_features(ctx)
    ffn = detect.ffn_features(ctx)
    moe = detect.moe_features(ctx)
    if moe is not None:
        # The port activates routed and shared experts as the FFN: each is measured on its own.
        ctx.other.extend(detect.expert_activation_mismatches(detect.moe_block(ctx)[1], ffn.activation))
    positions = detect.position_features(ctx)
    norm = detect.norm_features(ctx)
    scalars = detect.scalar_features(ctx)
    rope_layer_qk_norms = qk_norm_on_rope_layers(ctx, attention)
    if rope_layer_qk_norms:
        attention = attention.model_copy(update={"qk_norm_rope_layers_only": True})
    ctx.other.extend(detect.per_layer_differences(ctx, exempt=rope_layer_qk_norms))
    ctx.other.extend(detect.layer_stack_structure(ctx))
    ctx.other.extend(detect.head_transform(ctx, scalars))
    pinned = detect.nested_forward_fields(ctx)
    switches = detect.forward_switches(ctx)
    scale = attention.query_position_scale
    if scale is not None and scale.switch_field is not None:
        # The switch of a query scale the tiny model's positions never reach: pinned like the others.
        switches[scale.switch_field] = True
    nullable = detect.nullable_fields(ctx)
    other, ported = claim_facts(ctx.other, ctx.facts)
    for name in ported:
        ctx.evidence.append(f"{MODULES_BY_NAME[name].title}: ported by the feature module {name}")
    checklist = Checklist(
        attention=attention,
        ffn=ffn,
        moe=moe,
        positions=positions,
        norm=norm,
        scalars=scalars,
        transposed_weights=detect.transposed_weights(ctx),
        pinned_nested_fields=pinned,
        nullable_fields=nullable,
        forward_switches=switches,
        other=sorted(set(other)),
        feature_modules=ported,
    )
    return Analysis(resolved, checklist, ctx)


@functools.lru_cache(maxsize=8)
def build_checklist(model_type: str) -> Checklist:
    """The checklist of a model_type's default config (used for the references)."""
    return analyse(resolve_source(model_type), trust_remote_code=False).checklist


def build_variant_checklist(model_type: str, overrides: tuple[tuple[str, object], ...]) -> Checklist:
    """The checklist of a model_type's default config with ``overrides`` set on it.

    A reference's code reads some choices from config fields (one expert group, no top-k
    renormalisation, ...); measuring it with those fields set gives the values it also
    produces, by the same rules as every other measurement.
    """
    resolved = resolve_source(model_type)
    for name, value in overrides:
        setattr(resolved.config, name, value)
    return analyse(resolved, trust_remote_code=False).checklist
