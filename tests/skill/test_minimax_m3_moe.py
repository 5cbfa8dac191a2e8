"""MiniMax-M3's MoE block (issue 22), on the family's real transformers classes: a shared
expert whose width a field of its own sets (``shared_intermediate_size``, measured by moving
it), its gate and up fused in one projection, and the clamped SwiGLU its MLP and experts
compute inline while the config says ``hidden_act="silu"``.

The analyser's facts are read off the tiny model; the inserted code (``snippets/experts.py``)
is run against HF's ``MiniMaxM3VLDenseMLP`` and ``MiniMaxM3VLExperts`` on the same weights
with the clamps biting; the committed port against HF's model with pre-activations far past
the limit; and what the edits do not cover (a dense layer's MLP) is refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from skill.analysis.detect import _gated_mlp_computes
from skill.analysis.reference import engine_limits
from skill.features import Feature, feature_values
from skill.harness.case import ModelCase
from skill.harness.models import build_hf_config, build_hf_model, load_archon_model, save_hf_checkpoint
from skill.harness.models import unknown_model_type as _unknown
from skill.porting.model_edits import select_edits
from skill.porting.plan import plan_for, report_for
from skill.snippets.experts import (
    ClampedSwiGLUFeedForward,
    ClampedSwiGLUGroupedExperts,
    clamped_swiglu,
    split_concatenated_gate_up,
)

FAMILY = "minimax_m3_vl_text"
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(_unknown(FAMILY) is not None, reason=_unknown(FAMILY) or "")

E, DIM, HIDDEN, TOP_K = 4, 8, 6, 2
ALPHA, LIMIT = 1.702, 0.5  # a small limit: the clamps bite on unit-scale inputs


@functools.cache
def _report():
    return report_for(FAMILY)


# ------------------------------------------------------------- the analyser's facts


def test_the_shared_experts_width_is_measured_on_their_own_field() -> None:
    report = _report()
    moe = report.checklist.moe
    assert moe is not None and moe.shared_experts == 1 and not moe.shared_expert_gate
    # Neither a multiple of an expert's width nor AReaL's shared_expert_intermediate_size:
    # the field whose move moves the shared down projection's input width.
    assert moe.shared_expert_width == "own_field"
    assert moe.shared_expert_width_field == "shared_intermediate_size"
    assert any("shared_intermediate_size" in line for line in report.evidence)
    assert feature_values(report.checklist)[Feature.SHARED_EXPERTS] == "true"
    assert report.unsupported == []
    assert plan_for(FAMILY).shared_expert_width_field == "shared_intermediate_size"


def test_a_family_without_its_own_field_keeps_its_report() -> None:
    """The new fact is left out of the serialised report where absent (every other family)."""
    moe = report_for("qwen2_moe").checklist.moe
    assert moe is not None and moe.shared_expert_width == "own_field"
    assert moe.shared_expert_width_field is None
    assert "shared_expert_width_field" not in moe.model_dump()


def test_the_mlp_computes_the_clamped_swiglu_whatever_hidden_act_says() -> None:
    report = _report()
    ffn = report.checklist.ffn
    # The config normalises hidden_act to "silu" (a fallback the MLP never calls).
    assert next(f.value for f in report.config_fields if f.name == "hidden_act") == "silu"
    assert ffn.activation == "clamped_swiglu"
    assert ffn.activation_fields == {"alpha": "swiglu_alpha", "limit": "swiglu_limit"}
    assert plan_for(FAMILY).expert_activation_fields == {"alpha": "swiglu_alpha", "limit": "swiglu_limit"}


def test_the_shared_experts_fused_gate_up_is_split_into_w1_and_w3() -> None:
    fused = _report().checkpoint.fused_modules
    assert fused["model.layers.{}.mlp.shared_experts.gate_up_proj"] == [
        "layers.{}.moe.shared_experts.w1",
        "layers.{}.moe.shared_experts.w3",
    ]


def test_a_plain_swiglu_mlp_is_not_read_as_clamped() -> None:
    mlp = LlamaMLP(LlamaConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2))
    assert _gated_mlp_computes(mlp, DIM, lambda gate, up: F.silu(gate) * up)
    assert not _gated_mlp_computes(mlp, DIM, lambda gate, up: clamped_swiglu(gate, up, ALPHA, 7.0))


def test_the_edits_cover_it_and_refuse_what_they_do_not() -> None:
    checklist = _report().checklist
    assert engine_limits(checklist) == []
    edits = select_edits(plan_for(FAMILY), (REPO / "archon_models/qwen3/model/model.py").read_text())
    assert "clamped_swiglu_experts" in edits and "activation" not in edits
    moe = checklist.moe
    assert moe is not None
    dense = checklist.model_copy(update={"moe": moe.model_copy(update={"moe_layers": moe.moe_layers[1:]})})
    assert any("clamped SwiGLU experts beside dense layers" in line for line in engine_limits(dense))
    gated = checklist.model_copy(update={"moe": moe.model_copy(update={"shared_expert_gate": True})})
    assert any("gated shared expert as wide as shared_intermediate_size" in line for line in engine_limits(gated))


# ------------------------------------------------------------- the inserted code vs HF


def _hf_modules():
    from transformers import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLDenseMLP, MiniMaxM3VLExperts

    config = MiniMaxM3VLTextConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        shared_intermediate_size=HIDDEN,
        num_local_experts=E,
        num_experts_per_tok=TOP_K,
        swiglu_limit=LIMIT,
        num_hidden_layers=1,
    )
    mlp, experts = MiniMaxM3VLDenseMLP(config, intermediate_size=HIDDEN), MiniMaxM3VLExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in [*mlp.parameters(), *experts.parameters()]:
            param.copy_(torch.randn(param.shape, generator=generator))
    return mlp, experts


def test_the_shared_experts_feed_forward_matches_hf_with_its_gradients() -> None:
    hf, _ = _hf_modules()
    ours = ClampedSwiGLUFeedForward(DIM, HIDDEN, alpha=ALPHA, limit=LIMIT)
    with torch.no_grad():
        w1, w3 = split_concatenated_gate_up(hf.gate_up_proj.weight[None])
        ours.w1.weight.copy_(w1[0])
        ours.w3.weight.copy_(w3[0])
        ours.w2.weight.copy_(hf.down_proj.weight)
    x = torch.randn(10, DIM, generator=torch.Generator().manual_seed(1)) * 2
    expected, got = hf(x), ours(x)
    torch.testing.assert_close(got, expected)
    gate, up = hf.gate_up_proj(x).chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (up.abs() > LIMIT).any()  # the clamps bite
    probe = torch.randn_like(expected)
    (theirs,) = torch.autograd.grad((expected * probe).sum(), [hf.gate_up_proj.weight])
    mine = torch.autograd.grad((got * probe).sum(), [ours.w1.weight, ours.w3.weight])
    torch.testing.assert_close(torch.cat(mine, dim=0), theirs)


def test_the_unbiased_clamped_experts_match_hf_experts() -> None:
    _, hf = _hf_modules()
    ours = ClampedSwiGLUGroupedExperts(DIM, HIDDEN, E, alpha=ALPHA, limit=LIMIT, use_grouped_mm=False)
    with torch.no_grad():
        w1, w3 = split_concatenated_gate_up(hf.gate_up_proj)
        ours.w1.copy_(w1)
        ours.w3.copy_(w3)
        ours.w2.copy_(hf.down_proj)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(10, DIM, generator=generator) * 2
    indices = torch.stack([torch.randperm(E, generator=generator)[:TOP_K] for _ in range(10)])
    weights = torch.softmax(torch.randn(10, TOP_K, generator=generator), dim=-1)
    expected = hf(x, indices, weights)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // TOP_K]
    out = torch.zeros(x.shape[0] * TOP_K, DIM).index_copy(0, order, ours(rows, torch.bincount(flat, minlength=E)))
    got = (out.view(-1, TOP_K, DIM) * weights.unsqueeze(-1)).sum(dim=1)
    torch.testing.assert_close(got, expected)


# ------------------------------------------------------------- the committed port


def test_the_port_matches_hf_with_pre_activations_far_past_the_limit(tmp_path: Path) -> None:
    case = ModelCase(model_type=FAMILY, config_overrides={"num_key_value_heads": 2})
    config = build_hf_config(case)
    hf = build_hf_model(case, config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "gate_up_proj" in name:
                param.mul_(60.0)  # routed and shared experts: |gate|, |up| up to ~90, limit 7
    seen: list[float] = []
    shared = hf.model.layers[0].mlp.shared_experts.gate_up_proj
    shared.register_forward_hook(lambda module, args, out: seen.append(float(out.abs().max())))
    archon = load_archon_model(config, save_hf_checkpoint(hf, tmp_path / "hf"))
    tokens = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        got = archon.model(tokens, torch.arange(12)[None], torch.tensor([0, 12], dtype=torch.int32), 12)
    assert seen and seen[0] > 4 * config.swiglu_limit
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_port_refuses_a_dense_layer() -> None:
    from archon_models import get_model_spec

    args_class = get_model_spec(FAMILY).model_args_class
    config = build_hf_config(ModelCase(model_type=FAMILY, config_overrides={"mlp_layer_types": ["dense", "sparse"]}))
    with pytest.raises(ValueError, match="a dense layer is not supported"):
        args_class.from_hf_config(config)
    sparse = build_hf_config(ModelCase(model_type=FAMILY))
    assert args_class.from_hf_config(sparse).moe_args.shared_expert_intermediate_size == sparse.shared_intermediate_size
