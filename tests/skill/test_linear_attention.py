"""Hybrids: Gated DeltaNet layers beside attention are measured, and served by the qwen3_5 reference.

The analysis takes a hybrid's non-attention mixer only where the qwen3_5 reference's
GatedDeltaNet, loaded with the mixer's own weights, computes the same outputs; the rest of the
family is measured on its attention-only twin. Anything else is refused with what differs.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from skill.analysis import modules as mt
from skill.analysis.analyze import analyze_hf_model
from skill.analysis.inputs import AnalysisError
from skill.analysis.linear_attention import (
    HybridRefused,
    _part_rows,
    _reference_mixer,
    _reference_weights,
    measure_hybrid,
    mixer_layers,
    split_fused,
)
from skill.analysis.report import AnalyzeInput
from skill.features import DELTANET_PROJECTIONS, Feature, FusedMixerWeight
from skill.porting.plan import UNEDITED_REFERENCES, plan_for, refuse_unedited_reference
from skill.porting.port_model import PortModelRequest, run_port
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


def test_qwen3_next_stacked_projections_are_measured_and_ported_from_the_reference():
    """Qwen3-Next stores the reference's projections stacked per key head (in_proj_qkvz: q, k,
    v, z; in_proj_ba: b, a): the analysis finds that layout by what computes HF's outputs, and
    the port writes it, with Qwen3-Next's MoE layer rule and renormalisation, on a copy of the
    reference (nothing unsupported)."""
    report = analyze_hf_model(AnalyzeInput(source="qwen3_next"))
    hybrid = report.checklist.linear_attention
    assert hybrid is not None and report.reference == "qwen3_5"
    assert hybrid.fused == [
        FusedMixerWeight(hf_name="in_proj_ba.weight", parts=["b", "a"], grouped=True),
        FusedMixerWeight(hf_name="in_proj_qkvz.weight", parts=["q", "k", "v", "z"], grouped=True),
    ]
    [delta] = [d for d in report.deltas if d.feature is Feature.LINEAR_ATTENTION]
    assert delta.supported and delta.target == "gated_deltanet, stacked by key head"
    assert report.unsupported == []
    plan = plan_for("qwen3_next")
    assert plan.hybrid_edits == ["stacked_mixer_weights", "moe_layer_rule", "router_norm_from_config"]


class _FusedMixer(torch.nn.Module):
    """A Gated DeltaNet whose checkpoint stacks the reference's projections in ``layout``: it
    computes the reference's outputs from its fused weights split that way."""

    def __init__(self, tiny, layout: list[FusedMixerWeight]):
        super().__init__()
        reference = _reference_mixer(tiny)
        self.tiny, self.layout, self._reference = tiny, layout, [reference]  # not a submodule
        fused = {projection for weight in layout for projection in weight.projections}
        for name, module in reference.named_children():
            if name not in fused:
                self.add_module(name, module)
        for name, param in reference.named_parameters(recurse=False):
            self.register_parameter(name, param)
        generator = torch.Generator().manual_seed(1)
        for weight in layout:
            rows = _part_rows(tiny, weight.grouped)
            groups = tiny.linear_num_key_heads if weight.grouped else 1
            projection = torch.nn.Linear(
                tiny.hidden_size, groups * sum(rows[part] for part in weight.parts), bias=False
            )
            torch.nn.init.normal_(projection.weight, std=0.2, generator=generator)
            self.add_module(weight.hf_name.removesuffix(".weight"), projection)

    def forward(self, x, **_):
        weights = _reference_weights(dict(self.state_dict()), self.layout, self.tiny)
        cu_seqlens = torch.tensor([0, x.shape[1]], dtype=torch.int32)
        return torch.func.functional_call(self._reference[0], weights, (x, cu_seqlens))


@pytest.mark.parametrize(
    "layout",
    [
        [
            FusedMixerWeight(hf_name="in_proj_qkvz.weight", parts=["q", "k", "v", "z"], grouped=False),
            FusedMixerWeight(hf_name="in_proj_ba.weight", parts=["a", "b"], grouped=False),
        ],
        [FusedMixerWeight(hf_name="in_proj_zqkv.weight", parts=["z", "q", "k", "v"], grouped=True)],
        [FusedMixerWeight(hf_name="in_proj_all.weight", parts=["b", "q", "k", "v", "a", "z"], grouped=True)],
    ],
    ids=["whole-parts", "z-first-by-key-head", "all-six-by-key-head"],
)
def test_any_stacking_of_the_reference_projections_is_found_by_what_it_computes(layout):
    tiny, layers = _tiny_qwen3_5()
    mixed = mixer_layers(layers)
    for index in mixed:
        name = mixed[index][0]
        setattr(layers[index], name, _FusedMixer(tiny, layout))
    mixed = mixer_layers(layers)
    measured = measure_hybrid(tiny, tiny, layers, mixed).layers.fused
    assert sorted(measured, key=lambda w: w.hf_name) == sorted(layout, key=lambda w: w.hf_name)
    assert {p for w in measured for p in w.projections} <= set(DELTANET_PROJECTIONS)


_OTHER_HYBRID_CONFIG = """from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig


class OtherHybridConfig(Qwen3_5TextConfig):
    model_type = "other_hybrid"
"""
_OTHER_HYBRID_MODEL = """from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

from .configuration_other_hybrid import OtherHybridConfig


class OtherHybridForCausalLM(Qwen3_5ForCausalLM):
    config_class = OtherHybridConfig
"""


def test_a_dense_hybrid_of_another_model_type_is_refused_by_name_before_anything_is_written(tmp_path):
    """A family identical to dense Qwen3.5 but for its model_type (remote code): a copy of the
    reference would keep its MoE machinery, so add refuses it naming that before writing
    anything, and the edit steps refuse to mark hand edits in a qwen3_5 copy, in one line."""
    folder = tmp_path / "other_hybrid"
    folder.mkdir()
    (folder / "configuration_other_hybrid.py").write_text(_OTHER_HYBRID_CONFIG)
    (folder / "modeling_other_hybrid.py").write_text(_OTHER_HYBRID_MODEL)
    config = tiny_config("qwen3_5_text").to_dict()
    config.update(
        model_type="other_hybrid",
        architectures=["OtherHybridForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_other_hybrid.OtherHybridConfig",
            "AutoModelForCausalLM": "modeling_other_hybrid.OtherHybridForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    plan = plan_for(str(folder), trust_remote_code=True)
    assert plan.reference in UNEDITED_REFERENCES
    why = "the qwen3_5 reference's MoE machinery would stay"
    assert plan.unsupported == [f"unsupported: a hybrid without experts under its own model type ({why})"]
    with pytest.raises(ValueError, match="edit_args marks no hand edit in a copy of the qwen3_5 reference"):
        refuse_unedited_reference(plan, "edit_args")
    workspace = tmp_path / "workspace"
    (workspace / "archon_models").mkdir(parents=True)
    result = run_port(PortModelRequest(source=str(folder), trust_remote_code=True, stages=[1], workspace=workspace))
    assert not result.passed and result.changed_files == []
    assert "a hybrid without experts under its own model type" in (result.error or "")
    assert sorted(p.name for p in (workspace / "archon_models").iterdir()) == []


@pytest.mark.parametrize("grouped", [False, True], ids=["whole", "by-key-head"])
def test_the_adapter_unstacks_rows_as_the_analysis_measured_them(grouped: bool):
    """One layout, two readers: the package's adapter helper (skill/snippets/adapter.py)
    unstacks a stacked weight into the parts the analysis split it into, in the projections'
    order, and stacks them back bit for bit."""
    from skill.snippets.adapter import _stack_rows, _unstack_rows

    tiny, _ = _tiny_qwen3_5()
    weight = FusedMixerWeight(hf_name="w", parts=["z", "q", "v", "k"], grouped=grouped)
    rows = _part_rows(tiny, grouped)
    groups = tiny.linear_num_key_heads if grouped else 1
    value = torch.randn(groups * sum(rows[p] for p in weight.parts), 8)
    parts = split_fused(value, weight, tiny)
    order = sorted(range(4), key=lambda i: "qkvzba".index(weight.parts[i]))
    unstacked = _unstack_rows(value, groups, [rows[p] for p in weight.parts], order)
    assert torch.equal(unstacked, torch.cat([parts[p] for p in "qkvz"]))
    assert torch.equal(_stack_rows(unstacked, groups, [rows[p] for p in weight.parts], order), value)
