"""Per-layer-type RoPE with a rotated width per layer type (issue 22, laguna).

Laguna's full-attention layers rotate half of each head (``partial_rotary_factor`` 0.5 in
``rope_parameters["full_attention"]``) and its sliding-window layers the whole head. The
analysis measures each layer type's width on HF's rotary tables, the plan turns that into
``rotary_dim`` and ``sliding_rotary_dim``, and the ``per_layer_rope`` edit builds each
layer type's cache that wide, on either reference. Families whose layer types rotate whole
heads (gemma3_text, olmo3, mellum) keep their reports and packages as they were.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
from transformers import LagunaConfig, MellumConfig
from transformers.utils import logging as hf_logging

from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model
from skill.porting.edit_args import arg_fields, check_supported_source
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import plan_for, plan_from_report
from skill.snippets.args import _layer_rope_parameters

hf_logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
REFERENCES = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}


@functools.cache
def _report(source: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=source))


def _folder(tmp_path: Path, config: object) -> Path:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.to_dict()))  # type: ignore[attr-defined]
    return folder


def test_laguna_is_ported_with_each_layer_types_rotated_width():
    """On main the analysis refused laguna ("a different partial rotary factor on each layer
    type"); now it measures the widths, probed on the rotary tables of a tiny model whose
    layers take both types (the default's layers are all full attention)."""
    report = _report("laguna")
    assert report.unsupported == []
    positions = report.checklist.positions
    assert positions.layer_rotary_factors == {"full_attention": 0.5, "sliding_attention": 1.0}
    assert any("sliding_attention_inv_freq (probe)" in line for line in report.evidence)
    delta = {d.feature.value: d for d in report.deltas}["partial_rotary"]
    assert (delta.target, delta.supported) == ("per_layer_type", True)
    plan = plan_from_report(report, "laguna")
    assert plan.per_layer_rope and plan.partial_rotary and plan.layer_rotary_dims


def test_laguna_args_read_each_layer_types_width():
    """``rotary_dim`` and ``sliding_rotary_dim`` come from each layer type's own factor (the
    class default's, and any other config's), not from a top-level factor laguna lacks."""
    plan = plan_for("laguna")
    default = LagunaConfig()
    fields = {f.name: f for f in arg_fields(plan, default)}
    assert (fields["rotary_dim"].default, fields["sliding_rotary_dim"].default) == (64, 128)
    other = LagunaConfig(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
        }
    )
    assert (fields["rotary_dim"].expected(other), fields["sliding_rotary_dim"].expected(other)) == (32, 96)
    assert '_layer_partial_rotary_factor(hf_config, "sliding_attention")' in fields["sliding_rotary_dim"].expression


def test_laguna_refuses_what_it_does_not_compute():
    """Per-layer head counts and a router soft-cap are measured too (off, or uniform, in the
    default config): the port refuses a config that turns them on, naming the field."""
    report = _report("laguna")
    assert report.checklist.attention.heads_per_layer_field == "num_attention_heads_per_layer"
    assert report.checklist.moe is not None
    assert report.checklist.moe.router_softcap_field == "moe_router_logit_softcapping"
    source = check_supported_source(plan_for("laguna"), LagunaConfig(), "Laguna")
    # The generated check reads the layer types' RoPE parameters through args.py's helper.
    namespace: dict = {"_layer_rope_parameters": _layer_rope_parameters}
    exec(compile("from typing import Any\n" + source, "<check>", "exec"), namespace)
    check = namespace["_check_supported"]
    check(LagunaConfig())
    with pytest.raises(ValueError, match=r"num_attention_heads_per_layer=.*\(a query-head count per layer\)"):
        check(LagunaConfig(num_attention_heads_per_layer=[48] * 39 + [64]))
    with pytest.raises(ValueError, match=r"moe_router_logit_softcapping=5\.0 is not supported"):
        check(LagunaConfig(moe_router_logit_softcapping=5.0))


def test_laguna_stage_tests_show_both_layer_types():
    """The default config's layers are all full attention: the stage tests' tiny model takes
    both types, so the sliding layers' width (and window) is proven."""
    from skill.porting.test_file import shown_layer_types

    assert shown_layer_types(plan_for("laguna"), LagunaConfig()) == ["full_attention", "sliding_attention"]
    # Mellum has the same default layers, but one width: its tests stay as they were.
    assert shown_layer_types(plan_for("mellum"), MellumConfig()) is None


def test_whole_head_families_keep_their_reports():
    """A per-layer-type family whose layer types rotate whole heads has no width per type:
    nothing in its report or plan changes."""
    report = _report("mellum")
    assert report.checklist.positions.layer_rotary_factors is None
    assert "layer_rotary_factors" not in report.model_dump(mode="json")["checklist"]["positions"]
    plan = plan_from_report(report, "mellum")
    assert plan.per_layer_rope and not plan.partial_rotary and not plan.layer_rotary_dims


def test_full_layers_whole_sliding_layers_partial(tmp_path):
    """The measured widths, not the first layer type's: full-attention layers rotating whole
    heads and sliding ones a quarter still make a partial-rotary port, each type its width."""
    config = LagunaConfig(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 1.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        }
    )
    folder = _folder(tmp_path, config)
    report = analyze_hf_model(AnalyzeInput(source=str(folder)))
    assert report.unsupported == []
    assert report.checklist.positions.partial_rotary_factor == 1.0
    assert report.checklist.positions.layer_rotary_factors == {"full_attention": 1.0, "sliding_attention": 0.25}
    plan = plan_from_report(report, str(folder))
    assert plan.partial_rotary and plan.layer_rotary_dims
    fields = {f.name: f for f in arg_fields(plan, config)}
    assert (fields["rotary_dim"].default, fields["sliding_rotary_dim"].default) == (128, 32)


def test_a_flat_key_beside_the_layer_types_dicts_keeps_rope_per_layer_type(tmp_path):
    """A saved checkpoint's config (Laguna-XS.2's) keeps original_max_position_embeddings
    beside the layer types' dicts, and scales the full-attention layers with YaRN. Read as
    one flat RoPE it would port as unscaled default RoPE with one theta; it is per layer
    type, YaRN on the full-attention layers, each type its width."""
    rope = {
        "full_attention": {
            "rope_type": "yarn",
            "rope_theta": 5e5,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 64.0,
            "beta_slow": 1.0,
            "attention_factor": 1.0,
            "partial_rotary_factor": 0.5,
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
        "original_max_position_embeddings": 4096,
    }
    config = LagunaConfig(rope_parameters=rope, layer_types=["full_attention"] + ["sliding_attention"] * 39)
    report = analyze_hf_model(AnalyzeInput(source=str(_folder(tmp_path, config))))
    assert report.unsupported == []
    positions = report.checklist.positions
    assert positions.per_layer_type_rope and positions.rope_type == "yarn"
    assert positions.rope_layer_types == ["full_attention", "sliding_attention"]
    assert positions.layer_rotary_factors == {"full_attention": 0.5, "sliding_attention": 1.0}
    assert any("original_max_position_embeddings beside the per-layer-type dicts" in e for e in report.evidence)


@pytest.mark.parametrize("reference,model_class", [("qwen2", "Qwen2Model"), ("qwen3", "Qwen3Model")])
def test_each_layer_types_width_composes_on_either_reference(reference, model_class):
    """The edit is written on the module contract: on either reference, beside the other
    RoPE-side edits in any order, the sliding cache is ``sliding_rotary_dim`` wide and the
    full one ``rotary_dim``; without the feature both stay ``rotary_dim`` (as before)."""
    update = {
        "reference": reference,
        "per_layer_rope": True,
        "sliding_window": True,
        "sliding_layer_types": True,
        "partial_rotary": True,
        "layer_rotary_dims": True,
        "nope_layer_type": "full_attention",
        "qk_norm": "per_head",
        "qk_norm_after_rope": True,
    }
    plan = plan_for("llama").model_copy(update=update)
    edits = ["per_layer_rope", "nope_layers", "qk_norm_after_rope"]
    if reference == "qwen2":
        edits.append("per_head_qk_norm")
    ctx = EditContext(camel="Toy", model_class=model_class, profile=plan)
    texts = {tuple(order): apply_model_edits(REFERENCES[reference], ctx, list(order)) for order in (edits, edits[::-1])}
    (text,) = set(texts.values())
    compile(text, "<generated>", "exec")
    assert "precompute_rope_cache(args.sliding_rotary_dim, args.max_seq_len, args.sliding_rope_theta)" in text
    assert "precompute_rope_cache(args.rotary_dim, args.max_seq_len, args.rope_theta)" in text
    assert "if self.use_rope:" in text
    one_width = EditContext(
        camel="Toy", model_class=model_class, profile=plan.model_copy(update={"layer_rotary_dims": False})
    )
    before = apply_model_edits(REFERENCES[reference], one_width, ["per_layer_rope"])
    assert "sliding_rotary_dim" not in before
    assert "precompute_rope_cache(args.rotary_dim, args.max_seq_len, args.sliding_rope_theta)" in before


@pytest.mark.slow
def test_mellum_with_a_width_per_layer_type_ports_and_matches_hf(tmp_path):
    """Another family: Mellum's rotary reads each layer type's factor too. A Mellum checkpoint
    whose sliding layers rotate half of each head ports with zero hand edits (its own edits:
    projection bias, eager attention) and matches HF in stage 4, both layer types in the
    tiny model."""
    from skill.porting.port_model import PortModelRequest, port_model
    from skill.porting.run_test_stage import run_stage_subprocess

    root = tmp_path / "ws"
    shutil.copytree(REPO / "archon_models", root / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests/archon").mkdir(parents=True)
    for rel in ("tests/__init__.py", "tests/archon/__init__.py", "tests/archon/conftest.py", "pyproject.toml"):
        shutil.copy(REPO / rel, root / rel)
    config = MellumConfig(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        }
    )
    folder = _folder(tmp_path, config)
    result = port_model(PortModelRequest(source=str(folder), overwrite=True, stages=[], workspace=root))
    assert result.passed, result.error
    assert "per_layer_rope" in result.edits
    args = (root / "archon_models/mellum/model/args.py").read_text()
    assert "sliding_rotary_dim: int = 64" in args and "rotary_dim: int = 128" in args
    test_file = (root / "tests/archon/test_mellum.py").read_text()
    assert '"layer_types": ["full_attention", "sliding_attention"]' in test_file
    stages = run_stage_subprocess(root, "mellum", [1, 4])
    assert stages.passed, stages.output_tail
