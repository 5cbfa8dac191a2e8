"""MoE routers and layer rules: the analyser's measurements, the router's semantics against
HF's own router modules, and the args code the engine writes for them.

The router facts come from the HF modeling sources (quoted per family); the semantics are
checked by running HF's router module and AReaL-compatible ``TokenChoiceTopKRouter`` on the
same weights, so a mapping that is only plausible (a bias added to the weights, groups
scored by their best expert, a scale applied before the renormalisation) fails here.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from transformers.utils import logging as hf_logging

from archon_models.moe import MoEArgs
from archon_models.moe.router import TokenChoiceTopKRouter
from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model
from skill.analysis.detect import moe_layer_rule
from skill.analysis.modules import layer_has_experts
from skill.codemod.cst import Document
from skill.features import Feature, MoEFeatures, feature_values, is_supported
from skill.porting.edit_args import BALANCING_KWARG, router_setup
from skill.porting.plan import plan_from_report
from skill.snippets.moe_layers import FirstKDenseRule, LayerTypesRule, SparseStepRule, StartEndIntervalRule
from skill.tiny_model import build_tiny_model, tiny_config

hf_logging.set_verbosity_error()


@functools.cache
def report_for(model_type: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=model_type))


# Facts from the HF sources of transformers 5.23.
MOE_FACTS: dict[str, dict[str, Any]] = {
    # Glm4MoeTopkRouter: sigmoid, e_score_correction_bias buffer on mlp.gate, n_group /
    # topk_group, routed_scaling_factor; Glm4MoeDecoderLayer: MoE iff layer_idx >=
    # first_k_dense_replace; shared_experts = MLP(moe_intermediate_size * n_shared_experts).
    "glm4_moe": {
        "router_scoring": "sigmoid",
        "score_correction_key": "mlp.gate.e_score_correction_bias",
        "score_correction_shape": [4],
        "n_group_field": "n_group",
        "topk_group_field": "topk_group",
        "routed_scaling_field": "routed_scaling_factor",
        "shared_experts_field": "n_shared_experts",
        "shared_expert_width": "experts_multiple",
        "moe_layer_rule": "first_k_dense",
        "moe_layer_fields": ["first_k_dense_replace"],
    },
    # MiniMaxM2SparseMoeBlock: e_score_correction_bias on the block, sigmoid router that
    # always renormalises; every layer sparse.
    "minimax_m2": {
        "router_scoring": "sigmoid",
        "norm_topk_prob": True,
        "score_correction_key": "block_sparse_moe.e_score_correction_bias",
        "moe_layer_rule": "all",
        "n_group_field": None,
        "routed_scaling_field": None,
    },
    # Ernie4_5_MoeStatics: e_score_correction_bias of shape (1, num_experts), saved as
    # mlp.moe_statics.*; layers by
    # moe_layer_start_index / moe_layer_end_index / moe_layer_interval.
    "ernie4_5_moe": {
        "router_scoring": "softmax",
        "score_correction_key": "mlp.moe_statics.e_score_correction_bias",
        "score_correction_shape": [1, 4],
        "moe_layer_rule": "start_end_interval",
        "moe_layer_fields": ["moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"],
        "shared_experts_field": "moe_num_shared_experts",
    },
    # HYV3TopKRouter: sigmoid + e_score_correction_bias (mlp.expert_bias on disk), always
    # renormalised, then router_scaling_factor; HYV3DecoderLayer: mlp_layer_types[i] == "sparse".
    "hy_v3": {
        "router_scoring": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_field": "router_scaling_factor",
        "moe_layer_rule": "layer_types",
        "moe_layer_fields": ["mlp_layer_types"],
    },
    # Qwen2MoeDecoderLayer: decoder_sparse_step and mlp_only_layers; a gated shared expert
    # of shared_expert_intermediate_size.
    "qwen2_moe": {
        "moe_layer_rule": "sparse_step",
        "moe_layer_fields": ["decoder_sparse_step", "mlp_only_layers"],
        "shared_expert_width": "own_field",
        "score_correction_key": "",
    },
    # MixtralSparseMoeBlock: every layer, no rule field.
    "mixtral": {"moe_layer_rule": "all", "moe_layer_fields": [], "score_correction_key": ""},
}


@pytest.mark.parametrize("model_type", sorted(MOE_FACTS))
def test_moe_facts_on_real_families(model_type: str) -> None:
    moe = report_for(model_type).checklist.moe
    assert moe is not None
    got = {name: getattr(moe, name) for name in MOE_FACTS[model_type]}
    assert got == MOE_FACTS[model_type]


def test_hunyuan_correction_key_is_measured_from_the_checkpoint() -> None:
    # HYV3MoE registers e_score_correction_bias, save_pretrained writes it as mlp.expert_bias:
    # the key is read off the saved checkpoint, whatever the module calls it.
    moe = report_for("hy_v3").checklist.moe
    assert moe is not None and moe.score_correction_key == "mlp.expert_bias"


def test_router_features_are_supported_or_named() -> None:
    values = feature_values(report_for("glm4_moe").checklist)
    for feature, value in [
        (Feature.SCORE_CORRECTION_BIAS, "true"),
        (Feature.ROUTED_SCALING, "constant"),
        (Feature.GROUPED_TOPK, "true"),
        (Feature.MOE_LAYER_PATTERN, "leading_dense"),
        (Feature.SHARED_EXPERTS, "true"),
    ]:
        assert values[feature] == value
        assert is_supported(feature, value)
    # A bias stored [1, E] (a leading unit axis) is reshaped by the adapter both ways.
    ernie = feature_values(report_for("ernie4_5_moe").checklist)
    assert ernie[Feature.SCORE_CORRECTION_BIAS] == "true, stored with unit axes"
    assert is_supported(Feature.SCORE_CORRECTION_BIAS, ernie[Feature.SCORE_CORRECTION_BIAS])


def _moe(**changes: Any) -> MoEFeatures:
    return MoEFeatures(num_experts=4, top_k=2, n_layers=4, moe_layers=[1, 2, 3], **changes)


def test_correction_bias_without_a_checkpoint_key_is_unsupported() -> None:
    # A selection bias seen only in the module tree has no key the adapter could map.
    checklist = report_for("glm4_moe").checklist
    unkeyed = checklist.model_copy(update={"moe": _moe(score_correction_bias=True)})
    value = feature_values(unkeyed)[Feature.SCORE_CORRECTION_BIAS]
    assert value == "true, no checkpoint key"
    assert not is_supported(Feature.SCORE_CORRECTION_BIAS, value)
    keyed = checklist.model_copy(
        update={"moe": _moe(score_correction_bias=True, score_correction_key="mlp.gate.b", score_correction_shape=[4])}
    )
    assert feature_values(keyed)[Feature.SCORE_CORRECTION_BIAS] == "true"


def test_layer_pattern_without_a_config_rule_is_unsupported() -> None:
    # The port writes the rule, never the list: a pattern no config field reproduces is named.
    values = feature_values(report_for("glm4_moe").checklist.model_copy(update={"moe": _moe()}))
    assert values[Feature.MOE_LAYER_PATTERN] == "leading_dense, no config rule"
    assert not is_supported(Feature.MOE_LAYER_PATTERN, values[Feature.MOE_LAYER_PATTERN])
    ruled = report_for("glm4_moe").checklist.model_copy(update={"moe": _moe(moe_layer_rule="first_k_dense")})
    assert feature_values(ruled)[Feature.MOE_LAYER_PATTERN] == "leading_dense"
    grouped = report_for("glm4_moe").checklist.model_copy(update={"moe": _moe(group_scoring="max", n_group=8)})
    assert feature_values(grouped)[Feature.GROUPED_TOPK] == "max_group_score"
    assert not is_supported(Feature.GROUPED_TOPK, "max_group_score")


# --- layer rules: the analysis' rule, the generated method and HF's layers agree ----------

RULE_CASES = [
    ("glm4_moe", {"num_hidden_layers": 4, "first_k_dense_replace": 2}, FirstKDenseRule, ["first_k_dense_replace"]),
    ("dots1", {"num_hidden_layers": 3, "first_k_dense_replace": 1}, FirstKDenseRule, ["first_k_dense_replace"]),
    (
        "hy_v3",
        {"num_hidden_layers": 4, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
        LayerTypesRule,
        ["mlp_layer_types"],
    ),
    (
        "ernie4_5_moe",
        {"num_hidden_layers": 6, "moe_layer_start_index": 1, "moe_layer_end_index": 4, "moe_layer_interval": 2},
        StartEndIntervalRule,
        ["moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"],
    ),
    (
        "qwen2_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
        SparseStepRule,
        ["decoder_sparse_step", "mlp_only_layers"],
    ),
]


@pytest.mark.parametrize(
    ("model_type", "overrides", "rule_class", "fields"), RULE_CASES, ids=[c[0] for c in RULE_CASES]
)
def test_layer_rule_reproduces_hf_layers(model_type: str, overrides: dict, rule_class: type, fields: list) -> None:
    config = tiny_config(model_type, **overrides)
    model = build_tiny_model(config)
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    hf_sparse = [i for i, layer in enumerate(layers) if layer_has_experts(layer)]
    n = config.num_hidden_layers
    assert 0 < len(hf_sparse) < n, "the case must mix dense and sparse layers"
    rule_name, rule_fields = moe_layer_rule(config, hf_sparse, n)
    assert rule_fields == fields
    values = {f: getattr(config, f) for f in fields}
    if "mlp_layer_types" in values:
        values["mlp_layer_types"] = tuple(values["mlp_layer_types"])
    generated = rule_class(moe_args=MoEArgs(num_experts=4, top_k=2), **values)
    assert [i for i in range(n) if generated.is_moe_layer(i)] == hf_sparse
    assert not rule_class(moe_args=None, **values).is_moe_layer(hf_sparse[0])
    # Another rule's fields do not explain the layers: the measurement picks the right one.
    assert (
        rule_name
        == {
            FirstKDenseRule: "first_k_dense",
            LayerTypesRule: "layer_types",
            StartEndIntervalRule: "start_end_interval",
            SparseStepRule: "sparse_step",
        }[rule_class]
    )


def test_no_rule_when_the_fields_do_not_predict_the_layers() -> None:
    config = tiny_config("glm4_moe", num_hidden_layers=4, first_k_dense_replace=1)
    assert moe_layer_rule(config, [1, 3], 4) == ("", [])
    assert moe_layer_rule(config, [1, 2, 3], 4) == ("first_k_dense", ["first_k_dense_replace"])


# --- router semantics: HF's router module vs AReaL's TokenChoiceTopKRouter ------------------


def _hf_router(model_type: str, **overrides: Any) -> tuple[Any, torch.nn.Module]:
    config = tiny_config(model_type, num_hidden_layers=1, **overrides)
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0
    model = build_tiny_model(config)
    block = next(m for m in model.modules() if type(m).__name__.endswith(("MoE", "SparseMoeBlock")))
    return config, block


def _route(router: TokenChoiceTopKRouter, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores, idx, _ = router(x, bias)
    order = idx.argsort(dim=-1)
    return scores.gather(1, order), idx.gather(1, order)


def _sorted(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = idx.argsort(dim=-1)
    return weights.gather(1, order), idx.gather(1, order)


def _areal_router(config: Any, weight: torch.Tensor, **moe: Any) -> TokenChoiceTopKRouter:
    router = TokenChoiceTopKRouter(
        dim=config.hidden_size, num_experts=weight.shape[0], top_k=config.num_experts_per_tok, **moe
    )
    with torch.no_grad():
        router.gate.weight.copy_(weight)
    return router


@pytest.mark.parametrize("groups", [1, 2])
def test_glm4_moe_router_is_areals_router(groups: int) -> None:
    # Sigmoid, bias for selection only, groups scored by their two best experts, renormalised,
    # then scaled: exactly MoEArgs(score_func="sigmoid", route_norm, route_scale, groups).
    config, block = _hf_router(
        "glm4_moe", n_routed_experts=8, num_experts_per_tok=2, n_group=groups, topk_group=1, routed_scaling_factor=2.5
    )
    gate = block.gate
    torch.manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_()
        gate.e_score_correction_bias.normal_(std=0.5)
    x = torch.randn(16, config.hidden_size)
    _, hf_weights, hf_idx = gate(x)
    router = _areal_router(
        config,
        gate.weight,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        num_expert_groups=groups if groups > 1 else None,
        num_limited_groups=1 if groups > 1 else None,
    )
    got_w, got_i = _route(router, x, gate.e_score_correction_bias)
    want_w, want_i = _sorted(hf_weights, hf_idx)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w)
    # The bias moves the choice: dropping it (or adding it to the weights) changes the routing.
    _, no_bias_i = _route(router, x, torch.zeros_like(gate.e_score_correction_bias))
    assert not torch.equal(no_bias_i, want_i)


def test_minimax_m2_router_is_areals_router() -> None:
    config, block = _hf_router("minimax_m2", num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(1)
    with torch.no_grad():
        block.gate.weight.normal_()
        block.e_score_correction_bias.normal_(std=0.5)
    x = torch.randn(16, config.hidden_size)
    _, hf_weights, hf_idx = block.gate(x, block.e_score_correction_bias)
    router = _areal_router(config, block.gate.weight, score_func="sigmoid", route_norm=True)
    got_w, got_i = _route(router, x, block.e_score_correction_bias)
    want_w, want_i = _sorted(hf_weights, hf_idx)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w)


def test_ernie_softmax_router_with_selection_bias_is_areals_router() -> None:
    # Softmax over all experts, bias added for the choice only, renormalised: the same
    # AReaL router with score_func="softmax" (the (1, E) stored bias is flattened).
    config, block = _hf_router("ernie4_5_moe", moe_num_experts=8, moe_k=2)
    gate = block.gate
    torch.manual_seed(2)
    with torch.no_grad():
        gate.weight.normal_()
        gate.moe_statics.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(16, config.hidden_size)
    _, hf_weights, hf_idx = gate(x)
    router = _areal_router(config, gate.weight, score_func="softmax", route_norm=True)
    got_w, got_i = _route(router, x, gate.moe_statics.e_score_correction_bias.view(-1))
    want_w, want_i = _sorted(hf_weights, hf_idx)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w)


# --- the args code: router_setup for every feature, on the plan of a real family ------------


def _run_setup(setup: str, config: Any, **kwargs: Any) -> MoEArgs:
    """The setup lines run as ``from_hf_config`` runs them (``kwargs``: its keyword arguments)."""
    namespace: dict[str, Any] = {"moe_args": MoEArgs.from_hf_config(config), "hf_config": config, "kwargs": kwargs}
    exec(compile(setup, "<router_setup>", "exec"), namespace)
    return namespace["moe_args"]


@pytest.mark.parametrize(("groups", "kept"), [(1, 1), (2, 1)])
def test_router_setup_maps_every_router_field(groups: int, kept: int) -> None:
    report = report_for("glm4_moe")
    plan = plan_from_report(report, "glm4_moe")
    config = tiny_config("glm4_moe", routed_scaling_factor=2.5, n_group=groups, topk_group=kept, n_shared_experts=2)
    moe_args = _run_setup(router_setup(plan), config)
    assert moe_args.score_func == "sigmoid"
    assert moe_args.route_scale == 2.5
    # The checkpoint's correction bias stays fixed unless the caller opts into balancing it.
    assert moe_args.load_balance_coeff is None
    assert _run_setup(router_setup(plan), config, **{BALANCING_KWARG: 1e-3}).load_balance_coeff == 1e-3
    assert moe_args.num_shared_experts == 2
    if groups > 1:
        assert (moe_args.num_expert_groups, moe_args.num_limited_groups) == (2, 1)
    else:
        assert moe_args.num_expert_groups is None and moe_args.num_limited_groups is None


def test_router_setup_is_empty_for_a_plain_softmax_router() -> None:
    plan = plan_from_report(report_for("mixtral"), "mixtral")
    assert router_setup(plan) == ""
    qwen2_moe = plan_from_report(report_for("qwen2_moe"), "qwen2_moe")
    assert "load_balance_coeff" not in router_setup(qwen2_moe)
    assert "num_shared_experts" not in router_setup(qwen2_moe)  # its shared expert has its own width


# --- shared experts: every width rule the analysis measures, built as AReaL's MoE builds it ---

# Facts from the HF sources (transformers 5.23): HunYuanMoEV1Moe.shared_mlp =
# HunYuanMoEV1MLP(config) (intermediate_size wide, as each expert; no field counts it);
# FlintSparseMoeBlock / Kolibri1 add an ungated shared MLP of shared_expert_intermediate_size;
# Cohere2MoeSparseMoeBlock builds shared_experts only when num_shared_experts > 0 (default 0).
SHARED_FACTS: dict[str, dict[str, Any]] = {
    "hunyuan_v1_moe": {
        "shared_experts": 1,
        "shared_experts_field": None,
        "shared_expert_width": "experts_multiple",
        "shared_expert_gate": False,
    },
    # FlintTopKRouter: "Sigmoid scores without expert bias". Its attention sinks, saved as
    # self_attn.softmax_offset, are one value per head: as many as the tiny model's experts,
    # and no selection bias.
    "flint": {
        "shared_expert_width": "own_field",
        "shared_expert_gate": False,
        "score_correction_bias": False,
        "score_correction_key": "",
    },
    "kolibri1": {"shared_expert_width": "own_field", "shared_expert_gate": False},
    "cohere2_moe": {"shared_experts": 0, "shared_experts_field": "num_shared_experts", "shared_expert_width": ""},
}


@pytest.mark.parametrize("model_type", sorted(SHARED_FACTS))
def test_shared_expert_width_is_measured_and_supported(model_type: str) -> None:
    report = report_for(model_type)
    moe = report.checklist.moe
    assert moe is not None
    assert {name: getattr(moe, name) for name in SHARED_FACTS[model_type]} == SHARED_FACTS[model_type]
    value = feature_values(report.checklist)[Feature.SHARED_EXPERTS]
    assert value == ("false" if model_type == "cohere2_moe" else "true")
    assert is_supported(Feature.SHARED_EXPERTS, value)
    assert not [line for line in report.unsupported if "shared" in line]


@pytest.mark.parametrize("model_type", ["hunyuan_v1_moe", "flint", "kolibri1", "qwen2_moe", "glm4_moe"])
def test_router_setup_builds_the_hf_shared_mlp(model_type: str) -> None:
    # The MoE AReaL builds from the generated MoEArgs holds a shared MLP exactly as wide as
    # HF's, gated only where HF gates it; a wrong width fails here, not only at stage 3.
    from archon_models.moe import MoE

    config = tiny_config(model_type)  # its leading dense layers (flint, glm4_moe) stay: any MoE layer will do
    block = next(
        m
        for m in build_tiny_model(config).modules()
        if any("shared" in n for n, _ in m.named_children()) and any("expert" in n for n, _ in m.named_children())
    )
    hf_shared = next(c for n, c in block.named_children() if "shared" in n and "gate" not in n)
    width = next(m.out_features for n, m in hf_shared.named_modules() if n.endswith(("gate_proj", "up_proj")))
    plan = plan_from_report(report_for(model_type), model_type)
    moe_args = _run_setup(router_setup(plan), config)
    if plan.shared_expert:  # a gated shared expert: the args' fixed lines (SHARED_EXPERT_SETUP)
        moe_args.shared_expert_intermediate_size = config.shared_expert_intermediate_size
        moe_args.use_shared_expert_gate = True
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    moe = MoE(moe_args, dim=config.hidden_size, hidden_dim=expert_width)
    assert moe.shared_experts is not None and moe.shared_experts.w1.out_features == width
    assert (moe.shared_expert_gate is not None) == any("gate" in n and "shared" in n for n, _ in block.named_children())


def test_a_zero_shared_expert_count_is_refused_when_a_config_sets_it() -> None:
    # Cohere2-MoE's default has no shared experts; its port has none and must refuse a config
    # that adds them (their "average" combination is no MoEArgs setting).
    from skill.porting.edit_args import check_supported_source
    from skill.porting.hf_source import load_config

    plan = plan_from_report(report_for("cohere2_moe"), "cohere2_moe")
    assert plan.absent_shared_experts_field == "num_shared_experts"
    assert plan.shared_experts_field is None and plan.shared_experts_fixed is None
    source = check_supported_source(plan, load_config("cohere2_moe"), "Cohere2Moe")
    namespace: dict[str, Any] = {"Any": Any, "logger": __import__("logging").getLogger("t")}
    exec(compile(source, "<check>", "exec"), namespace)
    namespace["_check_supported"](tiny_config("cohere2_moe"))
    with pytest.raises(ValueError, match="num_shared_experts=1 is not supported"):
        namespace["_check_supported"](tiny_config("cohere2_moe", num_shared_experts=1))
    # A family with shared experts has no such refusal.
    assert plan_from_report(report_for("glm4_moe"), "glm4_moe").absent_shared_experts_field is None


# --- a score-correction bias stored [1, E]: the adapter reshapes it both ways --------------


def _glm4_moe_adapter_with_unit_axes(transposed: list[str]) -> type:
    """The committed glm4_moe adapter taught that its correction bias is stored [1, E]
    (as ERNIE-4.5 stores it), after the Conv1D edit when ``transposed`` names keys."""
    import sys
    import types
    from pathlib import Path

    from skill.porting.common import PackageLayout
    from skill.porting.edit_adapter_map import apply_transposed_adapter, apply_unit_axes_adapter

    layout = PackageLayout.for_name("glm4_moe")
    text = (Path(__file__).parents[2] / "archon_models/glm4_moe/model/state_dict_adapter.py").read_text()
    transposed_adapter = apply_transposed_adapter(Document(text), layout, transposed)
    keys = {"model.layers.{}.mlp.gate.e_score_correction_bias": 1}
    edited = apply_unit_axes_adapter(transposed_adapter, layout, keys).code
    assert apply_unit_axes_adapter(Document(edited), layout, keys).code == edited  # idempotent
    name = "_unit_axes_adapter"
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(edited, "<adapter>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module.Glm4MoeStateDictAdapter


@pytest.mark.parametrize("transposed", [[], ["model.layers.{}.self_attn.o_proj.weight"]])
def test_unit_axes_adapter_roundtrips_a_bias_stored_with_a_leading_axis(transposed: list[str]) -> None:
    from archon_models.glm4_moe.model.args import Glm4MoeModelArgs
    from archon_models.glm4_moe.model.model import Glm4MoeModel

    args = Glm4MoeModelArgs.from_hf_config(tiny_config("glm4_moe", num_hidden_layers=2, first_k_dense_replace=1))
    torch.manual_seed(0)
    model = Glm4MoeModel(args)
    model.init_buffers(buffer_device="cpu")
    # Every tensor set: the experts are allocated with torch.empty, whose leftover memory may hold
    # NaN, which torch.equal never matches (the round trip failed at random on that alone).
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.normal_()
    archon = {k: v.detach().clone() for k, v in model.state_dict().items()}
    adapter = _glm4_moe_adapter_with_unit_axes(transposed)(args)
    hf = adapter.to_hf(archon)
    stored = hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert stored.shape == (1, args.moe_args.num_experts)
    assert torch.equal(stored[0], archon["layers.1.moe.expert_bias"])
    if transposed:
        o_proj = archon["layers.1.attention.wo.weight"]
        assert torch.equal(hf["model.layers.1.self_attn.o_proj.weight"], o_proj.t())
    back = adapter.from_hf(hf)
    assert set(back) == set(archon)
    for key, value in archon.items():
        assert back[key].shape == value.shape and torch.equal(back[key], value), key


def test_a_router_holding_its_own_weight_maps_to_the_gate() -> None:
    # GraniteMoeSWATopKRouter: self.weight = nn.Parameter(num_experts, hidden) on the router
    # itself (granitemoe's router holds a Linear, router.layer.weight). Its checkpoint key
    # block_sparse_moe.router.weight had no rule: edit_adapter_map failed with UnmappedKeyError.
    from skill.porting.edit_adapter_map import derive_from_hf_map

    keys = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.{}.block_sparse_moe.router.weight",
        "model.layers.{}.block_sparse_moe.router.layer.weight",
    ]
    mapping = derive_from_hf_map(keys, dense_layers=False)
    assert mapping["model.layers.{}.block_sparse_moe.router.weight"] == "layers.{}.moe.router.gate.weight"
    assert mapping["model.layers.{}.block_sparse_moe.router.layer.weight"] == "layers.{}.moe.router.gate.weight"
