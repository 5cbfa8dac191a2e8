"""A norm the HF MoE block applies to its own output (A.X-K1's ``post_mlp_layernorm`` on the routed
plus shared experts' sum): measured by the analysis on the HF model
(:func:`skill.analysis.places.moe_output_norm_place`), written by the ``moe_output_norm`` edit in
the block where it adds the MoE's output to the residual (MoE layers only; inside Archon's MoE
module its output is a partial sum under TP), planned per token by the TP plan."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from skill.analysis import modules as mt
from skill.analysis.places import MOE_BRANCH_ADD, moe_output_norm_place
from skill.analysis.reference import engine_limits
from skill.features import Feature, NormKind
from skill.porting.model_edits import EditContext, apply_model_edits, select_edits
from skill.porting.plan import plan_for, report_for
from skill.tiny_model import build_tiny_model, tiny_config

REPO = Path(__file__).resolve().parents[2]
QWEN3_MODEL = (REPO / "archon_models" / "qwen3" / "model" / "model.py").read_text()


def test_axk1s_moe_output_norm_is_a_measured_feature_an_edit_writes() -> None:
    report = report_for("axk1")
    assert report.unsupported == []
    assert report.checklist.moe is not None and report.checklist.moe.output_norm is NormKind.RMS
    deltas = {d.feature: (d.target, d.supported) for d in report.deltas}
    assert deltas[Feature.MOE_OUTPUT_NORM] == ("rms", True)
    # Saved at the layer, not under the MoE block that holds it in memory.
    assert report.checkpoint.module_map["model.layers.{}.post_mlp_layernorm"] == "layers.{}.moe_output_norm"
    assert plan_for("axk1").moe_output_norm
    assert "moe_output_norm" in select_edits(plan_for("axk1"), QWEN3_MODEL)


def test_a_moe_family_without_it_reports_none() -> None:
    moe = report_for("qwen3_moe").checklist.moe
    assert moe is not None and moe.output_norm is None
    assert "output_norm" not in moe.model_dump(exclude_none=True)
    assert not plan_for("qwen3_moe").moe_output_norm


def test_the_place_is_measured_on_axk1s_classes() -> None:
    """One forward of the tiny HF model: the norm reads the routed plus shared experts' sum, its
    output is the MoE block's, and the layer adds that to its residual."""
    config = tiny_config(AutoConfig.for_model("axk1"))
    model = build_tiny_model(config)
    layer = next(layer for layer in model.model.layers if mt.layer_has_experts(layer))
    moe = layer.mlp
    branches = [moe.experts, moe.shared_experts]
    assert moe_output_norm_place(model, config, layer, moe, moe.post_mlp_layernorm, branches) == MOE_BRANCH_ADD
    # Without the shared experts the norm's input is not the branches' sum: no place.
    assert moe_output_norm_place(model, config, layer, moe, moe.post_mlp_layernorm, [moe.experts]) is None


def test_a_moe_output_norm_of_another_kind_than_the_block_norms_is_refused_by_name() -> None:
    checklist = report_for("axk1").checklist
    assert checklist.moe is not None
    other = checklist.model_copy(update={"moe": checklist.moe.model_copy(update={"output_norm": NormKind.LAYER_NORM})})
    assert engine_limits(checklist) == []
    assert engine_limits(other) == ["norm on the MoE block's output of kind layer_norm beside rms block norms"]


def _load(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module


@pytest.mark.parametrize("all_layers_moe", [False, True])
@pytest.mark.parametrize("block", ["pre_norm", "sandwich"])
def test_the_block_normalises_the_moe_output_on_moe_layers_only(all_layers_moe: bool, block: str) -> None:
    """On the qwen3 reference, with a per-layer MoE rule or every layer MoE, composed with the
    sandwich norms (which wrap it): the MoE layers' feed-forward branch is
    ``moe_output_norm(moe(ffn_norm(x)))``, a dense layer's is its feed-forward's output."""
    from archon_models.qwen3.model.args import Qwen3ModelArgs

    plan = plan_for("qwen3_moe").model_copy(
        update={"moe_output_norm": True, "all_layers_moe": all_layers_moe, "block": block}
    )
    ctx = EditContext(camel="Toy", model_class="Qwen3Model", profile=plan)
    names = select_edits(plan, QWEN3_MODEL)
    text = apply_model_edits(QWEN3_MODEL, ctx, names)
    assert apply_model_edits(text, ctx, names) == text
    if block == "sandwich":
        assert "self.post_ffn_norm(self.moe_output_norm(" in text
    from archon_models.moe import MoEArgs

    args = Qwen3ModelArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        head_dim=8,
        hidden_dim=48,
        moe_args=MoEArgs(num_experts=4, top_k=2),
        moe_inter_dim=16,
        decoder_sparse_step=1 if all_layers_moe else 2,
    )
    model = _load(text, f"_moe_output_norm_{block}_{all_layers_moe}").Qwen3Model(args)
    for index, layer in model.layers.items():
        norm = layer.moe_output_norm
        if layer.moe_enabled:
            assert [n for n, _ in norm.named_parameters()] == ["weight"], index
        else:
            assert isinstance(norm, torch.nn.Identity), index
