"""Routed experts with projection biases, the clamped SwiGLU, a biased router gate, and the
YaRN ``truncate`` flag: gpt-oss's MoE, taught as composable edits.

The analyser's facts are checked on the real transformers family; the inserted code
(``snippets/experts.py``, ``snippets/router.py``) against HF's own ``GptOssExperts`` and
``GptOssTopKRouter`` run on the same weights, with inputs large enough that the clamps
bite; the edits on the qwen3 reference in every order, beside the other MoE edits.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssRotaryEmbedding, GptOssTopKRouter

from archon_models.gpt_oss.model.rope import precompute_rope_cache
from archon_models.moe import MoEArgs
from archon_models.moe.router import TokenChoiceTopKRouter
from skill.analysis.reference import engine_limits
from skill.analysis.source_scan import scan_file
from skill.features import SUPPORTED_EDITS, ExpertLayout, Feature, FFNKind, feature_values
from skill.porting.edit_args import _rope_scaling_of
from skill.porting.model_edits import EditContext, apply_model_edits, select_edits
from skill.porting.plan import plan_for, report_for
from skill.snippets.args import _rope_freq_scaling
from skill.snippets.experts import (
    BiasedGroupedExperts,
    ClampedSwiGLUExperts,
    clamped_swiglu,
    split_interleaved_gate_up,
)
from skill.snippets.router import BiasedRouterGate

REPO = Path(__file__).resolve().parents[2]

E, DIM, HIDDEN, TOP_K = 4, 8, 6, 2
ALPHA, LIMIT = 1.702, 0.5  # a small limit: the clamps bite on unit-scale inputs


# ------------------------------------------------------------- the analyser on gpt_oss


def test_gpt_oss_is_portable_with_every_moe_feature_named() -> None:
    report = report_for("gpt_oss")
    assert report.unsupported == []
    checklist = report.checklist
    moe = checklist.moe
    assert moe is not None
    values = feature_values(checklist)
    assert values[Feature.ACTIVATION] == "clamped_swiglu"
    assert values[Feature.EXPERT_BIAS] == values[Feature.ROUTER_BIAS] == "true"
    for feature in (Feature.ACTIVATION, Feature.EXPERT_BIAS, Feature.ROUTER_BIAS):
        assert values[feature] in SUPPORTED_EDITS[feature]
    # The constants the experts class reads from the config, by what the code does with them.
    assert checklist.ffn.activation_fields == {"alpha": "swiglu_alpha", "limit": "swiglu_limit"}
    # The biases' keys, placed on the in- and down projection by their widths.
    assert moe.expert_bias_key_templates == [
        "model.layers.{}.mlp.experts.gate_up_proj_bias",
        "model.layers.{}.mlp.experts.down_proj_bias",
    ]
    # The attention's per-head sinks (as many as the tiny model's experts) are no selection bias.
    assert not moe.score_correction_bias and moe.score_correction_key == ""
    # Softmax over the top-k logits == softmax over all, top-k, renormalised.
    assert moe.router_scoring.value == "softmax" and moe.norm_topk_prob


def test_clamped_glu_constants_come_from_the_code_not_the_names() -> None:
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss
    import transformers.models.mixtral.modeling_mixtral as mixtral

    assert scan_file(gpt_oss.__file__).clamped_glu_fields() == {"alpha": "swiglu_alpha", "limit": "swiglu_limit"}
    assert scan_file(mixtral.__file__).clamped_glu_fields() == {}


def test_gpt_oss_plan_selects_the_moe_edits() -> None:
    plan = plan_for("gpt_oss")
    assert plan.expert_bias and plan.router_bias and plan.route_norm
    assert plan.expert_activation_fields == {"alpha": "swiglu_alpha", "limit": "swiglu_limit"}
    text = (REPO / "archon_models/qwen3/model/model.py").read_text()
    edits = select_edits(plan, text)
    assert {"expert_bias", "clamped_swiglu_experts", "router_bias", "all_layers_moe"} <= set(edits)
    assert "activation" not in edits  # the dense activation edit has no clamped SwiGLU


@pytest.mark.parametrize(
    ("change", "limit"),
    [
        (lambda c: c.model_copy(update={"moe": None}), "clamped SwiGLU in a dense MLP"),
        (
            lambda c: c.model_copy(update={"moe": c.moe.model_copy(update={"moe_layers": c.moe.moe_layers[1:]})}),
            "clamped SwiGLU experts beside dense layers",
        ),
        (
            lambda c: c.model_copy(update={"ffn": c.ffn.model_copy(update={"activation_fields": {}})}),
            "clamped SwiGLU whose alpha and limit no config field sets",
        ),
        (
            lambda c: c.model_copy(
                update={"moe": c.moe.model_copy(update={"expert_layout": ExpertLayout.PER_EXPERT_2D})}
            ),
            "expert projection biases stored per expert",
        ),
        (
            lambda c: c.model_copy(update={"ffn": c.ffn.model_copy(update={"kind": FFNKind.PLAIN})}),
            "expert projection biases on ungated experts",
        ),
        (
            lambda c: c.model_copy(update={"moe": c.moe.model_copy(update={"expert_bias_key_templates": []})}),
            "expert projection biases the analyser cannot place",
        ),
    ],
)
def test_what_the_edits_do_not_cover_is_refused(change, limit: str) -> None:
    checklist = report_for("gpt_oss").checklist
    assert not engine_limits(checklist)
    assert any(limit in line for line in engine_limits(change(checklist)))


# ------------------------------------------------------------- the inserted code vs HF


def _hf_experts() -> GptOssExperts:
    config = GptOssConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_local_experts=E,
        num_experts_per_tok=TOP_K,
        swiglu_limit=LIMIT,
    )
    experts = GptOssExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return experts


def _ours_from(hf: GptOssExperts, cls: type[BiasedGroupedExperts]) -> BiasedGroupedExperts:
    """Our experts holding HF's weights, as the generated adapter converts them."""
    ours = (
        ClampedSwiGLUExperts(DIM, HIDDEN, E, alpha=ALPHA, limit=LIMIT, use_grouped_mm=False)
        if cls is ClampedSwiGLUExperts
        else cls(DIM, HIDDEN, E, use_grouped_mm=False)
    )
    with torch.no_grad():
        w1, w3 = split_interleaved_gate_up(hf.gate_up_proj.transpose(1, 2))
        b1, b3 = split_interleaved_gate_up(hf.gate_up_proj_bias)
        ours.w1.copy_(w1)
        ours.w3.copy_(w3)
        ours.w2.copy_(hf.down_proj.transpose(1, 2))
        ours.w1_bias.copy_(b1)
        ours.w3_bias.copy_(b3)
        ours.w2_bias.copy_(hf.down_proj_bias)
    return ours


def _routed(ours: BiasedGroupedExperts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):
    """The MoE block's use of the experts: rows grouped by expert, outputs weighted and summed."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    rows = x[order // TOP_K]
    out = torch.zeros(x.shape[0] * TOP_K, DIM).index_copy(0, order, ours(rows, counts))
    return (out.view(-1, TOP_K, DIM) * weights.unsqueeze(-1)).sum(dim=1)


def test_clamped_swiglu_experts_match_gpt_oss_experts_with_their_gradients() -> None:
    hf = _hf_experts()
    ours = _ours_from(hf, ClampedSwiGLUExperts)
    x = torch.randn(10, DIM) * 2
    indices = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(10)])
    weights = torch.softmax(torch.randn(10, TOP_K), dim=-1)
    expected = hf(x, indices, weights)
    got = _routed(ours, x, indices, weights)
    torch.testing.assert_close(got, expected)
    # The clamps bite (else the limit is untested): some gate and up values pass the limit.
    gate_up = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()
    probe = torch.randn_like(expected)
    theirs = torch.autograd.grad((expected * probe).sum(), [hf.gate_up_proj_bias, hf.down_proj_bias])
    mine = torch.autograd.grad((got * probe).sum(), [ours.w1_bias, ours.w3_bias, ours.w2_bias])
    b1, b3 = split_interleaved_gate_up(theirs[0])
    torch.testing.assert_close(mine[0], b1)
    torch.testing.assert_close(mine[1], b3)
    torch.testing.assert_close(mine[2], theirs[1])
    # Plain SwiGLU with the same biases is a different function.
    plain = _routed(_ours_from(hf, BiasedGroupedExperts), x, indices, weights)
    assert not torch.allclose(plain, expected, atol=1e-3)


def test_clamped_swiglu_formula() -> None:
    gate = torch.tensor([-20.0, 0.3, 20.0])
    up = torch.tensor([-20.0, 0.3, 20.0])
    expected = torch.stack(
        [
            (-LIMIT + 1) * (-20.0 * torch.sigmoid(torch.tensor(-20.0 * ALPHA))),
            (0.3 + 1) * 0.3 * torch.sigmoid(torch.tensor(0.3 * ALPHA)),
            (LIMIT + 1) * LIMIT * torch.sigmoid(torch.tensor(LIMIT * ALPHA)),
        ]
    )
    torch.testing.assert_close(clamped_swiglu(gate, up, ALPHA, LIMIT), expected)


def test_biased_experts_init_zeroes_the_biases() -> None:
    experts = BiasedGroupedExperts(DIM, HIDDEN, E, use_grouped_mm=False)
    experts.init_weights(0.02)
    for bias in (experts.w1_bias, experts.w2_bias, experts.w3_bias):
        assert torch.count_nonzero(bias) == 0
    assert experts.w1.std() > 0


@pytest.mark.parametrize("router_dtype", [None, torch.float64])
def test_biased_router_routes_as_gpt_oss(router_dtype) -> None:
    """gpt-oss: top-k of the biased logits, softmax over those k. AReaL's softmax router with
    route_norm (softmax over all, top-k, renormalised) picks and weights the same."""
    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=DIM, num_local_experts=E, num_experts_per_tok=TOP_K)
    hf = GptOssTopKRouter(config)
    torch.nn.init.normal_(hf.weight)
    torch.nn.init.normal_(hf.bias)
    args = MoEArgs(num_experts=E, top_k=TOP_K, score_func="softmax", route_norm=True)
    router = TokenChoiceTopKRouter(DIM, E, TOP_K, score_func=args.score_func, route_norm=args.route_norm)
    router.gate = BiasedRouterGate(DIM, E, router_dtype=router_dtype)
    with torch.no_grad():
        router.gate.weight.copy_(hf.weight)
        router.gate.bias.copy_(hf.bias)
    x = torch.randn(32, DIM)
    _, hf_scores, hf_indices = hf(x)
    scores, indices, counts = router(x)
    # Same experts per token (any order), same weight for each.
    order, hf_order = indices.argsort(dim=-1), hf_indices.argsort(dim=-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    # Judged at HF's fp32 precision: a float64 router is closer to the truth than HF by ~1e-7.
    torch.testing.assert_close(scores.gather(1, order).float(), hf_scores.gather(1, hf_order).float())
    assert counts.sum() == 32 * TOP_K
    # Without the bias the routing differs.
    with torch.no_grad():
        router.gate.bias.zero_()
    assert not torch.equal(router(x)[1].sort(dim=-1).values, hf_indices.sort(dim=-1).values)


# ------------------------------------------------------------- the edits compose


def _edited(plan, order: tuple[str, ...]) -> str:
    text = (REPO / "archon_models/qwen3/model/model.py").read_text()
    return apply_model_edits(text, EditContext(camel="Qwen3", model_class="Qwen3Model", profile=plan), list(order))


MOE_EDITS = ("expert_bias", "clamped_swiglu_experts", "router_bias")


def _indent_of(text: str, statement: str) -> int:
    """The indentation of the line holding ``statement``."""
    line = next(line for line in text.splitlines() if statement in line)
    return len(line) - len(line.lstrip())


@pytest.mark.parametrize("all_layers", [True, False])
def test_moe_edits_compose_in_any_order_and_compile(all_layers: bool) -> None:
    plan = plan_for("gpt_oss").model_copy(update={"all_layers_moe": all_layers})
    base = ("remove_qk_norm", "all_layers_moe") if all_layers else ("remove_qk_norm",)
    results = {_edited(plan, base + order) for order in itertools.permutations(MOE_EDITS)}
    assert len(results) == 1
    text = results.pop()
    compile(text, "model.py", "exec")
    assert "self.moe.experts = ClampedSwiGLUExperts(" in text and "alpha=model_args.swiglu_alpha" in text
    assert "self.moe.router.gate = BiasedRouterGate(" in text
    # Right after the MoE is built, in its block: with leading dense layers that is inside
    # ``if self.moe_enabled:``, below the ``self.moe = None`` placeholder (fuzzer seed 152).
    block = text.split("class TransformerBlock", 1)[1]
    assert _indent_of(block, "self.moe.router.gate = BiasedRouterGate(") == _indent_of(block, "self.moe = MoE(")
    assert block.index("self.moe = MoE(") < block.index("self.moe.router.gate = BiasedRouterGate(")
    assert text.count("class BiasedGroupedExperts(") == 1
    zero = "nn.init.zeros_(self.moe.router.gate.bias)"
    assert (f"if self.moe is not None:\n            {zero}" in text) is not all_layers and zero in text
    # Applying the edits again changes nothing.
    again = apply_model_edits(
        text, EditContext(camel="Qwen3", model_class="Qwen3Model", profile=plan), list(base + MOE_EDITS)
    )
    assert again == text


def test_expert_bias_alone_keeps_swiglu_and_router_bias_composes_with_the_sparse_mixer() -> None:
    plan = plan_for("gpt_oss").model_copy(
        update={
            "activation": "silu",
            "expert_activation_fields": {},
            "router_scoring": "sparsemixer",
            "router_jitter_field": "jitter",
        }
    )
    text = _edited(plan, ("remove_qk_norm", "all_layers_moe", "router_bias", "expert_bias", "sparse_mixer_router"))
    compile(text, "model.py", "exec")
    assert "self.moe.experts = BiasedGroupedExperts(" in text and "ClampedSwiGLUExperts" not in text
    # The biased gate goes on the router the block ends up with (the sparse mixer), not the one it replaced.
    block = text.split("class TransformerBlock", 1)[1]
    assert block.index("self.moe.router = SparseMixerRouter(") < block.index("self.moe.router.gate = BiasedRouterGate(")


# ------------------------------------------------------------- YaRN's truncate flag


def test_yarn_truncate_flag_reaches_the_rope_cache() -> None:
    """The generated gpt_oss RoPE, fed what the generated args read from the config."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    }
    config = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=dict(rope))
    scaling = _rope_freq_scaling(config)
    assert scaling is not None and scaling["truncate"] == 0.0
    assert _rope_scaling_of(config) == scaling  # the args stage expects what the generated helper reads
    seq = 64
    cache = precompute_rope_cache(16, seq, rope["rope_theta"], scaling)
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), torch.arange(seq)[None])
    # The cache holds cos and sin over the whole head (halves repeated); gpt-oss's over one half.
    torch.testing.assert_close(cache[:, :8], cos[0])
    torch.testing.assert_close(cache[:, 16:24], sin[0])
    truncated = precompute_rope_cache(16, seq, rope["rope_theta"], {**scaling, "truncate": 1.0})
    assert not torch.allclose(truncated, cache)
