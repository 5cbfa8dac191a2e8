"""Routed experts on disk and special routers: fused 3D expert tensors (placed by shape,
gate/up order probed, orientation), expert and router biases, and sparse-mixer routing.

Each fact is checked against what transformers computes: the fused layouts against the
experts' own forward formulas (GraniteMoeParallelExperts: ``chunk(2, dim=-1)`` of
``x @ W.T``; GptOssExperts: ``gate_up[..., ::2]``, ``gate_up[..., 1::2]`` of ``x @ W``;
AriaExperts: ``chunk(2, dim=-1)`` of ``x @ W``), the router against ``sparsemixer``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.phimoe.modeling_phimoe import sparsemixer

from skill.analysis.source_scan import scan_file
from skill.codemod.cst import Document
from skill.features import (
    SUPPORTED_EDITS,
    ExpertLayout,
    Feature,
    GateUpOrder,
    MoEFeatures,
    RouterScoring,
    WeightOrientation,
    feature_values,
)
from skill.porting.common import PackageLayout
from skill.porting.edit_adapter_map import apply_fused_experts_adapter, fused_expert_keys
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import (
    plan_for,
    report_for,  # cached: each family is analysed once
)
from skill.snippets.experts import (
    merge_concatenated_gate_up,
    merge_interleaved_gate_up,
    split_concatenated_gate_up,
    split_interleaved_gate_up,
)
from skill.snippets.router import SparseMixerRouter

REPO = Path(__file__).resolve().parents[2]
E, DIM, HIDDEN = 3, 8, 5

# ------------------------------------------------------------- the analyser, on real families

EXPECTED = {
    # model_type: (layout, orientation, gate/up order, experts gated, expert bias, router bias)
    "granitemoe": (ExpertLayout.FUSED_3D, WeightOrientation.OUT_IN, GateUpOrder.CONCATENATED, True, False, False),
    "aria_text": (ExpertLayout.FUSED_3D, WeightOrientation.IN_OUT, GateUpOrder.CONCATENATED, True, False, False),
    "gpt_oss": (ExpertLayout.FUSED_3D, WeightOrientation.IN_OUT, GateUpOrder.INTERLEAVED, True, True, True),
    "olmoe": (ExpertLayout.PER_EXPERT_2D, WeightOrientation.OUT_IN, GateUpOrder.SEPARATE, True, False, False),
}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_expert_layout_of_real_families(model_type: str) -> None:
    checklist = report_for(model_type).checklist
    moe = checklist.moe
    assert moe is not None
    layout, orientation, order, gated, bias, router_bias = EXPECTED[model_type]
    assert (moe.expert_layout, moe.expert_orientation, moe.expert_gate_up) == (layout, orientation, order)
    assert (moe.expert_bias, moe.router_bias) == (bias, router_bias)
    assert (checklist.ffn.kind.value == "gated") is gated
    # Both keys are named: the gate/up (or per-expert) template and the down projection's.
    assert moe.expert_key_template and moe.expert_down_key_template
    assert moe.expert_key_template != moe.expert_down_key_template


def test_granite_fused_experts_are_not_reported_missing() -> None:
    """Granite's experts live in input_linear/output_linear (no ``.experts.`` in the key):
    the layout is fused, not "none", and the port is not refused for it."""
    report = report_for("granitemoe")
    moe = report.checklist.moe
    assert moe is not None
    assert moe.expert_key_template == "model.layers.{}.block_sparse_moe.input_linear.weight"
    assert moe.expert_down_key_template == "model.layers.{}.block_sparse_moe.output_linear.weight"
    assert not report.unsupported


def test_gpt_oss_expert_and_router_biases_and_clamped_swiglu_are_supported() -> None:
    values = feature_values(report_for("gpt_oss").checklist)
    assert values[Feature.EXPERT_BIAS] == "true" and values[Feature.ROUTER_BIAS] == "true"
    # GptOssExperts calls no activation function: clamp, sigmoid gate, (up + 1).
    assert values[Feature.ACTIVATION] == "clamped_swiglu"
    for feature in (Feature.EXPERT_BIAS, Feature.ROUTER_BIAS, Feature.ACTIVATION):
        assert values[feature] in SUPPORTED_EDITS[feature]
    assert report_for("gpt_oss").unsupported == []


def test_phimoe_router_is_a_sparse_mixer_with_its_margin_field() -> None:
    moe = report_for("phimoe").checklist.moe
    assert moe is not None
    assert moe.router_scoring is RouterScoring.SPARSEMIXER
    assert moe.router_jitter_field == "router_jitter_noise"
    assert not report_for("phimoe").unsupported


def test_sparse_mixer_and_clamped_experts_are_read_from_structure_not_names() -> None:
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.phimoe.modeling_phimoe as phimoe

    assert scan_file(phimoe.__file__).router_sparse_mixer()
    assert not scan_file(mixtral.__file__).router_sparse_mixer()
    assert scan_file(gpt_oss.__file__).experts_clamped_glu()
    assert not any(scan_file(m.__file__).experts_clamped_glu() for m in (mixtral, phimoe))


# ------------------------------------------------------------- the gate/up snippets vs HF formulas


def test_concatenated_split_matches_granite_and_aria() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, DIM)
    out_in = torch.randn(E, 2 * HIDDEN, DIM)  # granite input_linear: F.linear(x, W[e])
    w1, w3 = split_concatenated_gate_up(out_in)
    for e in range(E):
        gate, up = F.linear(x, out_in[e]).chunk(2, dim=-1)
        torch.testing.assert_close(F.silu(x @ w1[e].t()) * (x @ w3[e].t()), F.silu(gate) * up)
    assert torch.equal(merge_concatenated_gate_up(w1, w3), out_in)
    in_out = torch.randn(E, DIM, 2 * HIDDEN)  # aria fc1: x @ W[e]
    w1, w3 = split_concatenated_gate_up(in_out.transpose(1, 2))
    gate, up = (x @ in_out[1]).chunk(2, dim=-1)
    torch.testing.assert_close(x @ w1[1].t(), gate)
    torch.testing.assert_close(x @ w3[1].t(), up)


def test_interleaved_split_matches_gpt_oss() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, DIM)
    in_out = torch.randn(E, DIM, 2 * HIDDEN)  # gpt-oss gate_up_proj: x @ W[e], gate ::2, up 1::2
    w1, w3 = split_interleaved_gate_up(in_out.transpose(1, 2))
    for e in range(E):
        gate_up = x @ in_out[e]
        torch.testing.assert_close(x @ w1[e].t(), gate_up[..., ::2])
        torch.testing.assert_close(x @ w3[e].t(), gate_up[..., 1::2])
    assert torch.equal(merge_interleaved_gate_up(w1, w3).transpose(1, 2), in_out)
    # The two orders are different layouts: splitting one as the other is wrong.
    c1, _ = split_concatenated_gate_up(in_out.transpose(1, 2))
    assert not torch.equal(c1, w1)


# ------------------------------------------------------------- the generated adapter


def _moe(order: GateUpOrder, orientation: WeightOrientation) -> MoEFeatures:
    return MoEFeatures(
        num_experts=E,
        top_k=2,
        expert_layout=ExpertLayout.FUSED_3D,
        expert_orientation=orientation,
        expert_gate_up=order,
        expert_key_template="model.layers.{}.mlp.experts.gate_up_proj",
        expert_down_key_template="model.layers.{}.mlp.experts.down_proj",
    )


def _generated_adapter(tmp_path: Path, moe: MoEFeatures):
    """The qwen3 adapter with the fused-experts edit, imported from a scratch file."""
    text = (REPO / "archon_models/qwen3/model/state_dict_adapter.py").read_text()
    layout = PackageLayout.for_name("qwen3")
    edited = apply_fused_experts_adapter(Document(text), layout, fused_expert_keys(moe), moe).code
    # Idempotent: the edit applied twice changes nothing more.
    assert apply_fused_experts_adapter(Document(edited), layout, fused_expert_keys(moe), moe).code == edited
    assert "_stack_experts" not in edited and "MoEWeightConverter" not in edited
    path = tmp_path / f"adapter_{moe.expert_gate_up.value}_{moe.expert_orientation.value}.py"
    path.write_text(edited)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=DIM,
        intermediate_size=16,
        moe_intermediate_size=HIDDEN,
        num_experts=E,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=32,
    )
    return module.Qwen3StateDictAdapter(config)


@pytest.mark.parametrize("orientation", [WeightOrientation.IN_OUT, WeightOrientation.OUT_IN])
@pytest.mark.parametrize("order", [order for order in GateUpOrder if order is not GateUpOrder.SEPARATE])
def test_generated_adapter_splits_and_fuses_experts(tmp_path, order, orientation) -> None:
    adapter = _generated_adapter(tmp_path, _moe(order, orientation))
    torch.manual_seed(1)
    in_out = orientation is WeightOrientation.IN_OUT
    gate_up = torch.randn(E, DIM, 2 * HIDDEN) if in_out else torch.randn(E, 2 * HIDDEN, DIM)
    down = torch.randn(E, HIDDEN, DIM) if in_out else torch.randn(E, DIM, HIDDEN)
    key, down_key = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    parts = adapter._experts_from_hf(key, "model.layers.{}.mlp.experts.gate_up_proj", ["0"], gate_up)
    w1, w3 = parts["layers.0.moe.experts.w1"], parts["layers.0.moe.experts.w3"]
    assert w1.shape == w3.shape == (E, HIDDEN, DIM)
    canonical = gate_up.transpose(1, 2) if in_out else gate_up
    interleaved = order in (GateUpOrder.INTERLEAVED, GateUpOrder.INTERLEAVED_UP_FIRST)
    first_rows = slice(0, None, 2) if interleaved else slice(0, HIDDEN)
    second_rows = slice(1, None, 2) if interleaved else slice(HIDDEN, None)
    up_first = order in (GateUpOrder.CONCATENATED_UP_FIRST, GateUpOrder.INTERLEAVED_UP_FIRST)
    gate_rows, up_rows = (second_rows, first_rows) if up_first else (first_rows, second_rows)
    assert torch.equal(w1, canonical[:, gate_rows]) and torch.equal(w3, canonical[:, up_rows])
    (w2,) = adapter._experts_from_hf(down_key, "model.layers.{}.mlp.experts.down_proj", ["0"], down).values()
    assert w2.shape == (E, DIM, HIDDEN)
    # Back to the checkpoint: exactly the tensors it holds, and through the per-parameter path too.
    assert torch.equal(adapter._experts_to_hf(key, {0: w1, 1: w3}), gate_up)
    assert torch.equal(adapter._experts_to_hf(down_key, {0: w2}), down)
    singles = [
        t
        for name in ("layers.0.moe.experts.w1", "layers.0.moe.experts.w3")
        for _, t in adapter.convert_single_to_hf(
            name, {"layers.0.moe.experts.w1": w1, "layers.0.moe.experts.w3": w3}[name]
        )
    ]
    assert [k for k, _ in adapter.convert_single_to_hf("layers.0.moe.experts.w1", w1)] == [key]
    assert torch.equal(adapter.join_single_to_hf(key, singles), gate_up)
    # A tensor of another expert count is refused, naming the key.
    with pytest.raises(KeyError, match="gate_up_proj"):
        adapter._experts_from_hf(key, "model.layers.{}.mlp.experts.gate_up_proj", ["0"], gate_up[:2])


# ------------------------------------------------------------- sparse mixer


def _router(seed: int = 0) -> SparseMixerRouter:
    torch.manual_seed(seed)
    router = SparseMixerRouter(DIM, 6, 2, jitter_eps=0.01)
    torch.nn.init.normal_(router.gate.weight, std=0.5)
    return router


def test_sparse_mixer_matches_hf_evaluation_routing_and_gradients() -> None:
    router = _router()
    x = torch.randn(64, DIM)
    weights, selected, counts = router(x)
    hf_weights, hf_selected = sparsemixer(router.gate(x), jitter_eps=0.01, training=False, top_k=2)
    assert torch.equal(selected, hf_selected)
    torch.testing.assert_close(weights, hf_weights)
    assert counts.tolist() == torch.bincount(selected.reshape(-1), minlength=6).tolist()
    loss_weights = torch.randn_like(weights)
    (ours,) = torch.autograd.grad((weights * loss_weights).sum(), router.gate.weight)
    (theirs,) = torch.autograd.grad(
        (sparsemixer(router.gate(x), jitter_eps=0.01, training=False)[0] * loss_weights).sum(), router.gate.weight
    )
    torch.testing.assert_close(ours, theirs)
    # The margin matters: a plain top-2 softmax weights differently.
    plain = torch.softmax(router.gate(x), dim=-1).topk(2).values
    assert not torch.allclose(weights, plain)


def test_sparse_mixer_refuses_what_it_cannot_route() -> None:
    with pytest.raises(ValueError, match="exactly 2"):
        SparseMixerRouter(DIM, 6, 3, jitter_eps=0.01)
    with pytest.raises(ValueError, match="load-balancing"):
        _router()(torch.randn(4, DIM), torch.zeros(6))


@pytest.mark.parametrize("others", [(), ("residual_multiplier", "layer_norm"), ("layer_norm", "all_layers_moe")])
def test_sparse_mixer_edit_composes_with_the_moe_block_edits(others) -> None:
    """The router edit lands after the MoE is built, whether or not every layer is MoE and
    whatever else edits the block; named in any order, one result."""
    plan = plan_for("phimoe").model_copy(update={"residual_multiplier_field": "residual_multiplier"})
    text = (REPO / "archon_models/qwen3/model/model.py").read_text()
    ctx = EditContext(camel="Toy", model_class="Qwen3Model", profile=plan)
    names = ["all_layers_moe", "sparse_mixer_router", *others]
    first = apply_model_edits(text, ctx, names)
    assert apply_model_edits(text, ctx, list(reversed(names))) == first
    assert first.count("self.moe.router = SparseMixerRouter(") == 1
    assert "class SparseMixerRouter(TokenChoiceTopKRouter):" in first
    assert first.index("self.moe = MoE(") < first.index("self.moe.router = SparseMixerRouter(")
    compile(first, "model.py", "exec")


@pytest.mark.parametrize("order", [GateUpOrder.INTERLEAVED, GateUpOrder.CONCATENATED])
def test_generated_adapter_splits_and_fuses_expert_biases(tmp_path, order) -> None:
    """[E, 2 * hidden] gate/up biases split in the weights' order, [E, dim] down biases kept,
    neither transposed (the weights are stored (in, out)); both fused back exactly."""
    moe = _moe(order, WeightOrientation.IN_OUT).model_copy(
        update={
            "expert_bias": True,
            "expert_bias_key_templates": [
                "model.layers.{}.mlp.experts.gate_up_proj_bias",
                "model.layers.{}.mlp.experts.down_proj_bias",
            ],
        }
    )
    adapter = _generated_adapter(tmp_path, moe)
    torch.manual_seed(2)
    gate_up_bias, down_bias = torch.randn(E, 2 * HIDDEN), torch.randn(E, DIM)
    key, down_key = "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_bias"
    parts = adapter._experts_from_hf(key, "model.layers.{}.mlp.experts.gate_up_proj_bias", ["0"], gate_up_bias)
    b1, b3 = parts["layers.0.moe.experts.w1_bias"], parts["layers.0.moe.experts.w3_bias"]
    gate = slice(0, None, 2) if order is GateUpOrder.INTERLEAVED else slice(0, HIDDEN)
    up = slice(1, None, 2) if order is GateUpOrder.INTERLEAVED else slice(HIDDEN, None)
    assert torch.equal(b1, gate_up_bias[:, gate]) and torch.equal(b3, gate_up_bias[:, up])
    (b2,) = adapter._experts_from_hf(down_key, "model.layers.{}.mlp.experts.down_proj_bias", ["0"], down_bias).values()
    assert torch.equal(b2, down_bias)
    assert torch.equal(adapter._experts_to_hf(key, {0: b1, 1: b3}), gate_up_bias)
    assert torch.equal(adapter._experts_to_hf(down_key, {0: b2}), down_bias)
    # The 3D weights are still transposed.
    weight = torch.randn(E, DIM, 2 * HIDDEN)
    parts = adapter._experts_from_hf(
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.{}.mlp.experts.gate_up_proj", ["0"], weight
    )
    assert parts["layers.0.moe.experts.w1"].shape == (E, HIDDEN, DIM)
    assert torch.equal(
        adapter._experts_to_hf(
            "model.layers.0.mlp.experts.gate_up_proj",
            {0: parts["layers.0.moe.experts.w1"], 1: parts["layers.0.moe.experts.w3"]},
        ),
        weight,
    )
