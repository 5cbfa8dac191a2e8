"""Where a router's selection bias enters, whether a renormalisation field is honoured, per-layer
MoE fields, and the modules no edit places: measured on the real transformers families.

Facts from the HF sources of transformers 5.23:

- ``Kolibri1TopKRouter.forward``: ``topk(router_logits + e_score_correction_bias)``, then
  ``router_logits.gather(...).sigmoid()``: the bias joins the logits before the sigmoid and
  only picks experts. ``Glm4MoeTopkRouter`` (DeepSeek-V3's rule) adds it to the sigmoid
  scores, as AReaL's ``expert_bias`` does.
- ``Cohere2MoeTopKRouter.forward``: top-k of the logits, then a softmax over those k (always
  sums to one); ``norm_topk_prob`` is read only on the sigmoid path.
- ``HunYuanMoEV1Config.moe_topk: int | list[int]``; ``HunYuanMoEV1Gate`` indexes a list by layer.
- ``AXK1MoE.post_mlp_layernorm`` normalises the MoE block's output inside the block;
  ``DeepseekV32Attention.indexer`` / ``GlmMoeDsaAttention.indexer`` pick the keys to attend (DSA).
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import HunYuanMoEV1Config, Kolibri1Config
from transformers.models.kolibri1.modeling_kolibri1 import Kolibri1TopKRouter
from transformers.utils import logging as hf_logging

from archon_models.moe.router import TokenChoiceTopKRouter
from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model
from skill.analysis.detect import _per_layer_list_fields
from skill.analysis.source_scan import scan_file
from skill.features import SUPPORTED_EDITS, Feature, feature_values
from skill.harness import ModelCase, run_parity_stage
from skill.harness.args import hf_renormalises_regardless
from skill.harness.models import build_hf_config
from skill.porting.edit_args import check_supported_source
from skill.porting.hf_source import load_config
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import plan_from_report
from skill.snippets.router import LogitBiasRouter
from skill.tiny_model import tiny_config

hf_logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
E, DIM, TOP_K = 8, 16, 2


@functools.cache
def report_for(model_type: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=model_type))


# ------------------------------------------------------------- selection-bias placement


@pytest.mark.parametrize(("model_type", "placement"), [("kolibri1", "logits"), ("glm4_moe", "scores")])
def test_selection_bias_placement_is_probed(model_type: str, placement: str) -> None:
    moe = report_for(model_type).checklist.moe
    assert moe is not None and moe.score_correction_bias
    assert moe.selection_bias_placement == placement


def test_kolibri1_is_portable_with_the_logit_bias_router() -> None:
    report = report_for("kolibri1")
    assert report.unsupported == []
    values = feature_values(report.checklist)
    assert values[Feature.SELECTION_BIAS_PLACEMENT] == "logits"
    assert values[Feature.SELECTION_BIAS_PLACEMENT] in SUPPORTED_EDITS[Feature.SELECTION_BIAS_PLACEMENT]
    plan = plan_from_report(report, "kolibri1")
    assert plan.logit_selection_bias and plan.score_correction_key  # the bias is loaded as expert_bias
    # A bias on the scores is AReaL's expert_bias: no feature value, no router edit.
    glm = report_for("glm4_moe")
    assert Feature.SELECTION_BIAS_PLACEMENT not in feature_values(glm.checklist)
    assert not plan_from_report(glm, "glm4_moe").logit_selection_bias


def _kolibri_router(norm: bool) -> Kolibri1TopKRouter:
    config = Kolibri1Config(hidden_size=DIM, num_experts=E, num_experts_per_tok=TOP_K, norm_topk_prob=norm)
    hf = Kolibri1TopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=generator))
        hf.e_score_correction_bias.copy_(torch.randn(E, generator=generator) * 2)
    return hf


@pytest.mark.parametrize("norm", [True, False])
def test_logit_bias_router_routes_as_kolibri1(norm: bool) -> None:
    hf = _kolibri_router(norm)
    ours = LogitBiasRouter(DIM, E, TOP_K, score_func="sigmoid", route_norm=norm)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.weight)
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(1))
    bias = hf.e_score_correction_bias.clone()
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    _, hf_scores, hf_indices = hf(x_hf)
    scores, indices, counts = ours(x_ours, bias)
    order, hf_order = indices.argsort(dim=-1), hf_indices.argsort(dim=-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    torch.testing.assert_close(scores.gather(1, order), hf_scores.gather(1, hf_order))
    assert counts.sum() == 64 * TOP_K
    # Same gradient into the input and the gate weight.
    probe = torch.randn(64, TOP_K, generator=torch.Generator().manual_seed(2))
    (hf_scores.gather(1, hf_order) * probe).sum().backward()
    (scores.gather(1, order) * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad)
    torch.testing.assert_close(ours.gate.weight.grad, hf.weight.grad)
    # AReaL's router with the same bias as expert_bias (added to the sigmoid scores) picks
    # other experts: the placement matters.
    areal = TokenChoiceTopKRouter(DIM, E, TOP_K, score_func="sigmoid", route_norm=norm)
    with torch.no_grad():
        areal.gate.weight.copy_(hf.weight)
    assert not torch.equal(areal(x, bias)[1].sort(dim=-1).values, hf_indices.sort(dim=-1).values)


def test_logit_bias_router_refuses_expert_groups() -> None:
    router = LogitBiasRouter(DIM, E, TOP_K, score_func="sigmoid", num_expert_groups=2, num_limited_groups=1)
    with pytest.raises(ValueError, match="plain top-k only"):
        router(torch.randn(3, DIM), torch.zeros(E))


def _edited(plan: Any, order: tuple[str, ...]) -> str:
    text = (REPO / "archon_models/qwen3/model/model.py").read_text()
    return apply_model_edits(text, EditContext(camel="Qwen3", model_class="Qwen3Model", profile=plan), list(order))


@pytest.mark.parametrize("all_layers", [True, False])
def test_logit_selection_bias_composes_with_the_other_router_edits(all_layers: bool) -> None:
    plan = plan_from_report(report_for("kolibri1"), "kolibri1").model_copy(
        update={"all_layers_moe": all_layers, "router_bias": True, "expert_bias": True}
    )
    base = ("remove_qk_norm", "all_layers_moe") if all_layers else ("remove_qk_norm",)
    edits = ("logit_selection_bias", "router_bias", "expert_bias")
    results = {_edited(plan, base + order) for order in itertools.permutations(edits)}
    assert len(results) == 1
    text = results.pop()
    compile(text, "model.py", "exec")
    block = text.split("class TransformerBlock", 1)[1]
    # The biased gate goes on the router the block ends up with.
    assert block.index("self.moe.router = LogitBiasRouter(") < block.index("self.moe.router.gate = BiasedRouterGate(")
    # In the router's own block (inside ``if self.moe_enabled:`` with leading dense layers).
    indents = {
        len(line) - len(line.lstrip())
        for line in block.splitlines()
        if "self.moe.router = LogitBiasRouter(" in line or "self.moe.router.gate = BiasedRouterGate(" in line
    }
    assert len(indents) == 1
    assert text.count("class LogitBiasRouter(") == 1
    assert _edited(plan, base + edits + edits) == text
    # Two routers do not compose: the sparse mixer and the logit-bias router refuse each other.
    mixer = plan.model_copy(update={"router_scoring": "sparsemixer", "router_jitter_field": "jitter"})
    with pytest.raises(ValueError, match="two routers"):
        _edited(mixer, (*base, "sparse_mixer_router", "logit_selection_bias"))


def test_stage4_fails_when_the_bias_is_added_after_the_sigmoid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed kolibri1 package, its router swapped for AReaL's (the bias on the scores):
    stage 4 must fail on the tiny model (the case's bias noise moves the top-k)."""
    from archon_models.kolibri1.model import model as kolibri1_model

    case = ModelCase(model_type="kolibri1")
    assert run_parity_stage(case, raise_on_failure=False).passed
    monkeypatch.setattr(kolibri1_model.LogitBiasRouter, "forward", TokenChoiceTopKRouter.forward)
    assert not run_parity_stage(case, raise_on_failure=False).passed


# ------------------------------------------------------------- renormalisation field


def test_cohere2_moe_softmax_renormalises_whatever_norm_topk_prob_says() -> None:
    moe = report_for("cohere2_moe").checklist.moe
    assert moe is not None and moe.norm_topk_prob and moe.norm_topk_prob_ignored
    plan = plan_from_report(report_for("cohere2_moe"), "cohere2_moe")
    assert plan.route_norm and plan.route_norm_field_ignored == "norm_topk_prob"
    # A router that honours the field (GLM-4-MoE) keeps reading it.
    glm = report_for("glm4_moe").checklist.moe
    assert glm is not None and glm.norm_topk_prob and not glm.norm_topk_prob_ignored
    assert plan_from_report(report_for("glm4_moe"), "glm4_moe").route_norm_field_ignored is None
    # Stage 1's own measurement on HF agrees.
    for model_type, regardless in (("cohere2_moe", True), ("glm4_moe", False)):
        case = ModelCase(model_type=model_type)
        assert hf_renormalises_regardless(case, build_hf_config(case)) is regardless


def test_cohere2_moe_check_refuses_an_unrenormalised_sigmoid() -> None:
    plan = plan_from_report(report_for("cohere2_moe"), "cohere2_moe")
    source = check_supported_source(plan, load_config("cohere2_moe"), "Cohere2Moe")
    namespace: dict[str, Any] = {"Any": Any, "logger": __import__("logging").getLogger("t")}
    exec(compile(source, "<check>", "exec"), namespace)
    check = namespace["_check_supported"]
    check(tiny_config("cohere2_moe", norm_topk_prob=False))
    check(tiny_config("cohere2_moe", expert_selection_fn="sigmoid"))
    with pytest.raises(ValueError, match="norm_topk_prob=False with expert_selection_fn='sigmoid'"):
        check(tiny_config("cohere2_moe", expert_selection_fn="sigmoid", norm_topk_prob=False))


def test_committed_cohere2_moe_sets_route_norm_for_softmax() -> None:
    from archon_models.cohere2_moe.model.args import Cohere2MoeModelArgs

    args = Cohere2MoeModelArgs.from_hf_config(tiny_config("cohere2_moe", norm_topk_prob=False))
    assert args.moe_args.route_norm and args.moe_args.score_func == "softmax"
    with pytest.raises(ValueError, match="not supported"):
        Cohere2MoeModelArgs.from_hf_config(
            tiny_config("cohere2_moe", norm_topk_prob=False, expert_selection_fn="sigmoid")
        )


# ------------------------------------------------------------- per-layer MoE fields


def test_per_layer_moe_fields_are_measured_from_the_config_class_and_the_code() -> None:
    import transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe as hunyuan
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3_moe

    # The annotation says moe_topk may be a list; HunYuanMoEV1Gate indexes num_experts by layer too.
    assert _per_layer_list_fields(HunYuanMoEV1Config()) == ["moe_topk"]
    assert _per_layer_list_fields(HunYuanMoEV1Config(), scan_file(hunyuan.__file__)) == ["num_experts", "moe_topk"]
    assert _per_layer_list_fields(load_config("qwen3_moe"), scan_file(qwen3_moe.__file__)) == []
    moe = report_for("hunyuan_v1_moe").checklist.moe
    assert moe is not None and moe.per_layer_list_fields == ["num_experts", "moe_topk"]


def test_committed_hunyuan_v1_moe_refuses_a_per_layer_top_k() -> None:
    from archon_models.hunyuan_v1_moe.model.args import HunyuanV1MoeModelArgs

    HunyuanV1MoeModelArgs.from_hf_config(tiny_config("hunyuan_v1_moe"))
    with pytest.raises(ValueError, match=r"moe_topk=\[2, 1\] \(one value per layer\) is not supported"):
        HunyuanV1MoeModelArgs.from_hf_config(tiny_config("hunyuan_v1_moe", moe_topk=[2, 1]))
    # transformers 5.23's config refuses a list num_experts itself; 5.3's accepts it.
    config = tiny_config("hunyuan_v1_moe")
    object.__setattr__(config, "num_experts", [4, 4])
    with pytest.raises(ValueError, match=r"num_experts=\[4, 4\] \(one value per layer\) is not supported"):
        HunyuanV1MoeModelArgs.from_hf_config(config)


# ------------------------------------------------------------- what no edit places


@pytest.fixture
def unrecognised_indexer(monkeypatch: pytest.MonkeyPatch):
    """The analysis with its sparse-attention indexer probe finding nothing: the indexer is then a
    nested attention module no edit writes (as it was before the sparse_indexer edit)."""
    from skill.analysis import detect
    from skill.porting import plan

    monkeypatch.setattr(detect, "sparse_indexer", lambda *args, **kwargs: None)
    # Both caches of a report: a report made here must not serve a later test in this worker
    # (test_supported_families_have_no_such_module[deepseek_v32] read the refusal from it).
    plan._report.cache_clear()
    report_for.cache_clear()
    yield
    plan._report.cache_clear()
    report_for.cache_clear()


@pytest.mark.parametrize(
    ("model_type", "line"),
    [
        ("deepseek_v32", "unsupported: attention submodule outside the vocabulary: indexer (DeepseekV32Indexer)"),
        ("glm_moe_dsa", "unsupported: attention submodule outside the vocabulary: indexer (GlmMoeDsaIndexer)"),
    ],
)
def test_modules_no_edit_places_are_named(model_type: str, line: str, unrecognised_indexer: None) -> None:
    assert line in report_for(model_type).unsupported


@pytest.mark.parametrize(
    "model_type", ["deepseek_v3", "glm4_moe", "qwen3_moe", "gpt_oss", "flint", "axk1", "deepseek_v32"]
)
def test_supported_families_have_no_such_module(model_type: str) -> None:
    unsupported = report_for(model_type).unsupported
    assert not [u for u in unsupported if "submodule" in u or "MoE block's output" in u]
