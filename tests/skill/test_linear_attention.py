"""Hybrids: Gated DeltaNet layers beside attention are measured, and served by the qwen3_5 reference.

The analysis takes a hybrid's non-attention mixer only where the qwen3_5 reference's
GatedDeltaNet, loaded with the mixer's own weights, computes the same outputs; the rest of the
family is measured on its attention-only twin. Anything else is refused with what differs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from skill.analysis import modules as mt
from skill.analysis.analyze import analyze_hf_model
from skill.analysis.inputs import AnalysisError
from skill.analysis.linear_attention import HybridRefused, measure_hybrid, mixer_layers
from skill.analysis.report import AnalyzeInput
from skill.features import Feature
from skill.tiny_model import build_tiny_model, tiny_config


def _tiny_qwen3_5():
    tiny = tiny_config("qwen3_5_text")
    model = build_tiny_model(tiny, seed=0)
    _, layers = mt.find_layers(model, tiny.num_hidden_layers)
    return tiny, layers


def test_qwen3_5_text_is_a_hybrid_served_by_the_qwen3_5_reference():
    report = analyze_hf_model(AnalyzeInput(source="qwen3_5_text"))
    config = AutoConfig.for_model("qwen3_5_text")
    hybrid = report.checklist.linear_attention
    assert hybrid is not None
    assert hybrid.kind == "gated_deltanet" and hybrid.kind_field == "layer_types" and hybrid.mixer_name == "linear_attn"
    assert hybrid.layers == [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    assert (hybrid.linear_kind, hybrid.attention_kind) == ("linear_attention", "full_attention")
    assert report.reference == "qwen3_5" and report.deltas == [] and report.unsupported == []
    # The attention layers' own features are measured on the attention-only twin.
    assert report.checklist.attention.output_gate and report.checklist.positions.partial_rotary_factor == 0.25


def test_a_mixer_that_computes_something_else_is_refused():
    tiny, layers = _tiny_qwen3_5()
    mixed = mixer_layers(layers)
    assert sorted(mixed) == [0, 1, 2]
    measure_hybrid(tiny, tiny, layers, mixed)  # the family itself is taken
    mixer = mixed[0][1]
    plain = type(mixer).forward
    mixer.forward = lambda hidden_states, **kw: plain(mixer, hidden_states, **kw) * 1.001  # type: ignore[method-assign]
    with pytest.raises(HybridRefused, match="computes something else"):
        measure_hybrid(tiny, tiny, layers, mixed)


def test_layers_that_differ_beyond_their_mixer_are_refused():
    tiny, layers = _tiny_qwen3_5()
    mixed = mixer_layers(layers)
    layers[0].add_module("extra_norm", torch.nn.LayerNorm(tiny.hidden_size))
    with pytest.raises(HybridRefused, match="differ beyond their token mixer"):
        measure_hybrid(tiny, tiny, layers, mixed)


@pytest.mark.parametrize(
    ("model_type", "named"),
    [
        # Qwen3-Next's Gated DeltaNet fuses q/k/v/z and b/a into other projections.
        ("qwen3_next", "in_proj_qkvz.weight"),
        # OLMo-Hybrid's Gated DeltaNet projects q, k, v apart (and its layers norm differently).
        ("olmo_hybrid", "q_proj.weight"),
        # A state-space model: no Gated DeltaNet sizes at all.
        ("mamba", "MambaMixer"),
    ],
)
def test_other_hybrids_are_refused_by_what_differs(model_type: str, named: str):
    with pytest.raises(AnalysisError, match="hybrid, state-space or recurrent") as refused:
        analyze_hf_model(AnalyzeInput(source=model_type))
    assert named in str(refused.value)


def test_the_moe_variant_is_served_by_the_same_reference():
    report = analyze_hf_model(AnalyzeInput(source="qwen3_5_moe_text"))
    assert report.reference == "qwen3_5" and report.checklist.linear_attention is not None
    assert report.checklist.moe is not None and report.deltas == [] and report.unsupported == []
    assert Feature.LINEAR_ATTENTION not in {d.feature for d in report.deltas}
