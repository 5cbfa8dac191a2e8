"""DeepSeek-V2's router on the deepseek_v3 (MLA) reference: what the analysis measures on HF's
MoE block, the args and router code the engine writes, and that code against HF's router.

Facts from transformers 5.23's ``modeling_deepseek_v2.py`` (``DeepseekV2TopkRouter``): softmax
over every expert's logit (fp32), then ``topk_method == "greedy"``: top-k of all experts, or
``"group_limited_greedy"``: groups scored by ``.max(dim=-1)`` (their best expert), the best
``topk_group`` kept, the others' scores set to 0 before the top-k; the chosen probabilities are
multiplied by ``routed_scaling_factor`` and never renormalised (``norm_topk_prob`` is not read).
No ``e_score_correction_bias``. DeepSeek-V3's router scores a group by the sum of its two best.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.utils import logging as hf_logging

from archon_models.moe.router import TokenChoiceTopKRouter
from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model, probes
from skill.analysis import modules as mt
from skill.codemod.cst import Document
from skill.features import Feature, feature_values
from skill.porting.mla_router import router_args
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import PortPlan, plan_from_report
from skill.snippets.router import MaxGroupTopKRouter
from skill.tiny_model import build_tiny_model, tiny_config

hf_logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK_V3 = REPO / "archon_models/deepseek_v3/model"


@functools.cache
def report_for(model_type: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=model_type))


@functools.cache
def plan_of(model_type: str) -> PortPlan:
    return plan_from_report(report_for(model_type), model_type)


# ------------------------------------------------------------------ the measurement


def test_deepseek_v2_router_is_measured_on_hf_module() -> None:
    moe = report_for("deepseek_v2").checklist.moe
    assert moe is not None
    assert moe.router_scoring.value == "softmax"
    assert moe.group_scoring == "max"
    assert (moe.group_switch_field, moe.group_switch_value) == ("topk_method", "group_limited_greedy")
    assert moe.group_switch_values == ["greedy", "group_limited_greedy"]
    assert moe.norm_topk_prob is False and moe.norm_topk_prob_ignored is True
    assert moe.score_correction_bias is False
    values = feature_values(report_for("deepseek_v2").checklist)
    assert values[Feature.GROUPED_TOPK] == "max_group_score"
    assert values[Feature.SCORE_CORRECTION_BIAS] == "false"
    assert report_for("deepseek_v2").unsupported == []


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_sum_of_top2_groups_and_a_read_norm_topk_prob(model_type: str) -> None:
    moe = report_for(model_type).checklist.moe
    assert moe is not None
    assert moe.group_scoring == "sum_top2"
    assert moe.group_switch_field is None
    # Both routers renormalise when norm_topk_prob is set: the field is read.
    assert moe.norm_topk_prob_ignored is False


def _variant(model_type: str, **fields: Any) -> mt.LayerAnatomy:
    config = tiny_config(model_type, **fields)
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0
    return mt.anatomy(build_tiny_model(config), config.num_hidden_layers)


GROUPS = {"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2}


@pytest.mark.parametrize(
    ("model_type", "fields", "rule"),
    [
        ("deepseek_v2", {"topk_method": "group_limited_greedy"}, "max"),
        ("deepseek_v2", {"topk_method": "greedy"}, None),  # no group limit at all
        ("deepseek_v3", {}, "sum_top2"),
        ("glm4_moe", {}, "sum_top2"),
    ],
)
def test_group_rule_probe_reads_hf_picks(model_type: str, fields: dict, rule: str | None) -> None:
    """The probe's designed logits separate the rules: a swapped max/sum answer fails here."""
    assert probes.probe_group_rule(_variant(model_type, **GROUPS, **fields)) == rule


# ------------------------------------------------------------------ the generated package


def _hf_router(**fields: Any) -> tuple[Any, torch.nn.Module]:
    config = tiny_config("deepseek_v2", num_hidden_layers=1, first_k_dense_replace=0, **fields)
    model = build_tiny_model(config)
    return config, model.model.layers[0].mlp.gate


def _package_router(config: Any) -> TokenChoiceTopKRouter:
    """The router the generated deepseek_v2 package builds for ``config`` (args and block)."""
    from archon_models.deepseek_v2.model.args import DeepseekV2ModelArgs
    from archon_models.deepseek_v2.model.model import TransformerBlock

    args = DeepseekV2ModelArgs.from_hf_config(config)
    block = TransformerBlock(0, args)
    assert block.moe is not None
    return block.moe.router


def _routes(router: torch.nn.Module, x: torch.Tensor, hf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if hf:
        _, weights, idx = router(x)
    else:
        weights, idx, _ = router(x)
    order = idx.argsort(dim=-1)
    return weights.gather(1, order), idx.gather(1, order)


ROUTING = {"n_routed_experts": 16, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2}


@pytest.mark.parametrize("method", ["group_limited_greedy", "greedy"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_package_router_is_hfs_router(method: str, norm_topk_prob: bool) -> None:
    """Softmax before the top-k, groups by their best expert, scaled, never renormalised,
    whatever norm_topk_prob says: the package's router picks HF's experts with HF's weights."""
    config, gate = _hf_router(**ROUTING, topk_method=method, routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_()
    router = _package_router(config)
    with torch.no_grad():
        router.gate.weight.copy_(gate.weight)
    x = torch.randn(64, config.hidden_size)
    want_w, want_i = _routes(gate, x, hf=True)
    got_w, got_i = _routes(router, x, hf=False)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w)
    # HF's weights are softmax probabilities of all experts, scaled: they do not sum to the
    # scale (a softmax after the top-k, or a renormalisation, would make them).
    assert not torch.allclose(want_w.sum(-1), torch.full((64,), 2.5))


def test_the_router_test_tells_the_rules_apart() -> None:
    """On the inputs of the test above, each wrong router differs from HF's: groups by the sum
    of their two best experts (AReaL's), renormalised weights (a softmax after the top-k)."""
    config, gate = _hf_router(**ROUTING, topk_method="group_limited_greedy", routed_scaling_factor=2.5)
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_()
    x = torch.randn(64, config.hidden_size)
    want_w, want_i = _routes(gate, x, hf=True)
    common = {"dim": config.hidden_size, "num_experts": 16, "top_k": 3, "score_func": "softmax", "route_scale": 2.5}
    sum_rule = TokenChoiceTopKRouter(**common, num_expert_groups=4, num_limited_groups=2)  # type: ignore[arg-type]
    renorm = MaxGroupTopKRouter(**common, route_norm=True, num_expert_groups=4, num_limited_groups=2)
    for wrong in (sum_rule, renorm):
        with torch.no_grad():
            wrong.gate.weight.copy_(gate.weight)
    _, sum_i = _routes(sum_rule, x, hf=False)
    assert not torch.equal(sum_i, want_i)
    renorm_w, renorm_i = _routes(renorm, x, hf=False)
    assert torch.equal(renorm_i, want_i) and not torch.allclose(renorm_w, want_w)


def test_package_refuses_a_topk_method_hf_does_not_implement() -> None:
    from archon_models.deepseek_v2.model.args import DeepseekV2ModelArgs

    config = tiny_config("deepseek_v2", topk_method="noaux_tc")
    with pytest.raises(ValueError, match="topk_method='noaux_tc' is not supported"):
        DeepseekV2ModelArgs.from_hf_config(config)


def test_max_group_router_refuses_more_picks_than_kept_experts() -> None:
    # HF would fill the top-k with masked experts at weight 0; -inf scores here would not.
    with pytest.raises(ValueError, match="top_k=5 exceeds"):
        MaxGroupTopKRouter(8, 8, 5, num_expert_groups=4, num_limited_groups=2)


# ------------------------------------------------------------------ the edits


def test_router_args_rewrite_only_what_differs() -> None:
    text = (DEEPSEEK_V3 / "args.py").read_text()
    # DeepSeek-V3 itself routes as the reference does: nothing to rewrite.
    assert router_args(Document(text), plan_of("deepseek_v3"), "DeepSeek-V3").code == text
    plan = plan_of("deepseek_v2")
    written = router_args(Document(text), plan, "DeepSeek-V3").code
    assert 'score_func="softmax"' in written and 'score_func="sigmoid"' not in written
    assert "route_norm=False," in written and 'norm_topk_prob", False)' not in written
    assert "_BIAS_UPDATE_SPEED" not in written and "load_balance_coeff" not in written
    assert 'grouped = hf_config.topk_method == "group_limited_greedy"' in written
    assert '_UNREAD_HF_FIELDS = ("norm_topk_prob",)' in written
    assert router_args(Document(written), plan, "DeepSeek-V3").code == written  # applied twice, nothing changes
    compile(written, "<args>", "exec")


def _ctx(plan: PortPlan, model_class: str) -> EditContext:
    return EditContext(camel=model_class.removesuffix("Model"), model_class=model_class, profile=plan)


@pytest.mark.parametrize(("reference", "model_class"), [("deepseek_v3", "DeepseekV3Model"), ("qwen3", "Qwen3Model")])
def test_max_group_router_composes_in_any_order(reference: str, model_class: str) -> None:
    """On either reference the router replaces the MoE's right where the block builds it,
    with the block and logit edits named in any order."""
    text = (REPO / f"archon_models/{reference}/model/model.py").read_text()
    plan = plan_of("deepseek_v2").model_copy(
        update={
            "reference": reference,
            "residual_multiplier_field": "residual_multiplier",
            "logit_multiplier_field": "logit_multiplier",
        }
    )
    names = ["residual_multiplier", "max_group_router", "logits_multiplier"]
    if reference == "deepseek_v3":
        # Only the MLA reference builds its MoE's buffers (for its bias) with the block.
        names.insert(1, "no_correction_bias")
    results = {
        order: apply_model_edits(text, _ctx(plan, model_class), list(order))
        for order in (tuple(names), tuple(reversed(names)), tuple(names[1:] + names[:1]))
    }
    canonical = results[tuple(names)]
    assert all(result == canonical for result in results.values())
    block = canonical.split("class TransformerBlock", 1)[1].split("\nclass ", 1)[0]
    build = block.index("self.moe = MoE(")
    assert block.index("self.moe.router = MaxGroupTopKRouter(") > build
    assert "self.moe.router" not in block[:build]
    assert canonical.count("class MaxGroupTopKRouter(TokenChoiceTopKRouter)") == 1
    assert "init_buffers(self.moe.router" not in block and "score-correction" not in block
    assert apply_model_edits(canonical, _ctx(plan, model_class), names) == canonical
    compile(canonical, "<edited>", "exec")


def test_max_group_router_keeps_the_shared_routers_contract() -> None:
    """Same outputs as AReaL's router without groups (the subclass only changes the group
    score), so expert parallelism and the MoE block read it unchanged."""
    torch.manual_seed(0)
    plain = TokenChoiceTopKRouter(32, 8, 2, score_func="softmax", route_scale=1.5)
    ours = MaxGroupTopKRouter(32, 8, 2, score_func="softmax", route_scale=1.5)
    ours.load_state_dict(copy.deepcopy(plain.state_dict()))
    x = torch.randn(10, 32)
    for a, b in zip(plain(x), ours(x), strict=True):
        torch.testing.assert_close(a, b)
