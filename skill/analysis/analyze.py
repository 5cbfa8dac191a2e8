"""Step 1 of the playbook: ``analyze_hf_model``, the guide's checklist, automated.

Reads the config, builds a tiny seeded instance, saves it to see the on-disk keys,
walks its module tree, probes it numerically and scans its modeling source; then names
the nearest reference, the feature deltas from it, and what no edit supports yet.
Nothing is written except a temporary directory that is removed before returning.
"""

from __future__ import annotations

import logging
import time

from skill.analysis.config_fields import config_fields
from skill.analysis.detect import checkpoint_modules, expert_count
from skill.analysis.ignored_keys import ignore_patterns, ignored_checkpoint_keys
from skill.analysis.inputs import AnalysisError, check_decoder_only, resolve_source, variant_types
from skill.analysis.measure import Analysis, analyse, layer_prefix, one_thread
from skill.analysis.reference import nearest_reference, unsupported_names
from skill.analysis.report import AnalyzeInput, ArchitectureReport, CheckpointKeys, KeyShape
from skill.tiny_model import (
    read_safetensors_shapes,
)

logger = logging.getLogger(__name__)


def _checkpoint(analysis: Analysis) -> CheckpointKeys:
    ctx = analysis.context
    prefix = ctx.layer_prefix
    stack = prefix.removesuffix("0.")
    top = [KeyShape(key=k, shape=list(s)) for k, s in ctx.saved_keys.items() if not (stack and k.startswith(stack))]
    layer0 = [KeyShape(key=k, shape=list(s)) for k, s in ctx.saved_keys.items() if prefix and k.startswith(prefix)]
    from_files: list[KeyShape] = []
    folder = analysis.resolved.folder
    if folder is not None and any(folder.glob("*.safetensors")):
        shapes = read_safetensors_shapes(folder)
        file_prefix = layer_prefix(list(shapes), int(ctx.config.num_hidden_layers))
        file_stack = file_prefix[:-2]
        from_files = [
            KeyShape(key=k, shape=list(s))
            for k, s in shapes.items()
            if k.startswith(file_prefix) or not (file_stack and k.startswith(file_stack))
        ]
    sizes = {
        name: getattr(ctx.tiny, name)
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_hidden_layers",
            "vocab_size",
        )
        if isinstance(getattr(ctx.tiny, name, None), int)
    }
    anatomy = ctx.anatomy
    roles = {"tok_embeddings": anatomy.embedding, "norm": anatomy.final_norm, "output": anatomy.lm_head}
    paths = {id(module): name for name, module in ctx.model.named_modules()}
    top_modules = {
        paths[id(module)]: archon
        for archon, module in roles.items()
        if module is not None and f"{paths.get(id(module))}.weight" in ctx.saved_keys
    }
    module_map, fused_modules = checkpoint_modules(ctx)
    return CheckpointKeys(
        top_modules=dict(sorted(top_modules.items())),
        layer_prefix=prefix,
        module_map=module_map,
        fused_modules=fused_modules,
        top_level=top,
        layer0=layer0,
        n_keys=len(ctx.saved_keys),
        tiny_sizes=sizes,
        from_files=from_files,
        ignored_unexpected=ignored_checkpoint_keys(ctx.model, ctx.saved_location),
        load_ignore_patterns=ignore_patterns(ctx.model),
    )


def _variants(model_type: str, has_moe: bool) -> list[str]:
    """The family's other model types one package serves: decoder-only, and MoE only when
    the measured family routes to experts itself (a dense port cannot load a MoE checkpoint)."""
    from transformers import AutoConfig

    kept = []
    for variant in variant_types(model_type) or [model_type]:
        if variant == model_type:
            kept.append(variant)
            continue
        try:
            config = AutoConfig.for_model(variant)
            check_decoder_only(config)
        except (AnalysisError, ValueError):
            continue
        if expert_count(config) and not has_moe:
            continue
        kept.append(variant)
    return kept


def analyze_hf_model(request: AnalyzeInput) -> ArchitectureReport:
    """Analyse a HuggingFace decoder-only family: the porting guide's step-1 checklist.

    Give a model_type of the installed transformers (``mistral``), a checkpoint folder
    with ``config.json``, or a ``config.json`` path. Returns every config field with the
    Archon args field it maps to, the checklist (attention, FFN, MoE, positions, norm,
    scalars) in the fixed vocabulary of ``skill.features``, the on-disk checkpoint keys
    of the top level and layer 0, the nearest reference (qwen2 or qwen3) with the
    feature deltas from it, and the features no edit supports yet. Use it first, before
    select/copy/edit steps. No network; remote code only with ``trust_remote_code``.
    """
    started = time.perf_counter()
    resolved = resolve_source(request.source, request.trust_remote_code)
    with one_thread():
        analysis = analyse(resolved, request.trust_remote_code)
        reference, deltas = nearest_reference(analysis.checklist)
    config = resolved.config
    unsupported = unsupported_names(analysis.checklist, deltas, config.model_type)
    return ArchitectureReport(
        model_type=config.model_type,
        config_class=type(config).__name__,
        source_kind=resolved.kind,
        variant_types=_variants(config.model_type, analysis.checklist.moe is not None),
        config_fields=config_fields(config),
        checklist=analysis.checklist,
        checkpoint=_checkpoint(analysis),
        reference=reference,
        deltas=deltas,
        unsupported=unsupported,
        hand_edit_places={
            name: place for name, place in analysis.context.places.items() if f"unsupported: {name}" in unsupported
        },
        evidence=analysis.context.evidence,
        seconds=round(time.perf_counter() - started, 3),
    )
