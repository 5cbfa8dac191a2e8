"""GPT-Neo's attention, measured on its real HF classes: the projections live one module
down (``attn.attention``, a wrapper choosing the local or global class), the window applies
on the layers ``attention_layers`` marks ``local`` with its size in ``window_size``, and the
scores are not scaled at all. Each is a fact of the analysis report, read by the port.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPTNeoConfig
from transformers.utils import logging as hf_logging

from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model, probes
from skill.analysis import modules as mt
from skill.codemod.workspace import Workspace
from skill.features import SlidingWindow, SlidingWindowKind
from skill.session import normalise_result
from skill.tiny_model import build_tiny_model, tiny_config

hf_logging.set_verbosity_error()


@functools.cache
def report_for(source: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=source))


def _tiny_gpt_neo() -> tuple[Any, torch.nn.Module]:
    config = tiny_config("gpt_neo")
    return config, build_tiny_model(config, seed=0)


def test_the_attention_inside_a_wrapper_is_the_one_measured() -> None:
    config, model = _tiny_gpt_neo()
    anatomy = mt.anatomy(model, config.num_hidden_layers)
    assert anatomy.attention_name == "attn.attention"
    assert type(anatomy.attention).__name__ == "GPTNeoSelfAttention"

    report = report_for("gpt_neo")
    attention = report.checklist.attention
    # Only the output projection has a bias (out_proj), read on the inner module.
    assert (attention.q_bias, attention.k_bias, attention.v_bias, attention.o_bias) == (False, False, False, True)
    assert not any("submodule outside the vocabulary" in item for item in report.checklist.other)
    module_map = report.checkpoint.module_map
    assert module_map["transformer.h.{}.attn.attention.q_proj"] == "layers.{}.attention.wq"
    assert module_map["transformer.h.{}.attn.attention.out_proj"] == "layers.{}.attention.wo"


def test_the_window_follows_the_layers_attention_layers_marks_local() -> None:
    report = report_for("gpt_neo")
    window = report.checklist.attention.sliding_window
    default = GPTNeoConfig()
    assert window.kind is SlidingWindowKind.PER_LAYER_PATTERN
    assert window.size == default.window_size
    assert (window.size_field, window.layer_kinds_field, window.windowed_kind) == (
        "window_size",
        "attention_layers",
        "local",
    )
    assert window.layer_pattern == list(default.attention_layers)
    assert report.unsupported == []


def test_unscaled_scores_are_measured_as_a_constant() -> None:
    attention = report_for("gpt_neo").checklist.attention
    assert attention.custom_scaling
    assert attention.scaling_source is None
    assert attention.scaling_constant == 1.0


def test_the_score_scale_probe() -> None:
    config, model = _tiny_gpt_neo()
    inner = mt.anatomy(model, config.num_hidden_layers).attention
    assert probes.probe_score_scale(model, inner, inner.q_proj, inner.k_proj, config) == pytest.approx(1.0, rel=1e-6)
    # Rotated queries and keys are no plain scaled q . k: no scale is claimed.
    llama_config = tiny_config("llama")
    llama = build_tiny_model(llama_config, seed=0)
    attention = llama.model.layers[0].self_attn
    assert probes.probe_score_scale(llama, attention, attention.q_proj, attention.k_proj, llama_config) is None


def test_facts_a_family_lacks_stay_out_of_its_serialised_report(tmp_path: Path) -> None:
    """Reports (and the sessions recording them) of families without these facts are unchanged."""
    assert set(SlidingWindow().model_dump()) == {"kind", "size", "layer_pattern", "evidence"}
    report = report_for("mistral")
    attention = report.checklist.attention.model_dump()
    assert "scaling_constant" not in attention
    assert "size_field" not in attention["sliding_window"]
    (tmp_path / "archon_models").mkdir()
    recorded = normalise_result(report, Workspace(tmp_path))["checklist"]["attention"]
    assert "scaling_constant" not in recorded
    assert set(recorded["sliding_window"]) == {"kind", "size", "layer_pattern", "evidence"}
    gpt_neo = normalise_result(report_for("gpt_neo"), Workspace(tmp_path))["checklist"]["attention"]
    assert gpt_neo["scaling_constant"] == 1.0
    assert gpt_neo["sliding_window"]["layer_kinds_field"] == "attention_layers"
