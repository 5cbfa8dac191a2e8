"""The activation table and the norm kinds: what the analyser maps onto them, what the
edits write for them (on both references, composed with the block-norm edits), and the
snippets they insert, each checked against transformers' own computation."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from skill.activations import ACTIVATIONS, match_activation, probe_input
from skill.analysis import probes
from skill.codemod.cst import Document
from skill.features import EXPERT_ACTIVATIONS, SUPPORTED_EDITS, Feature, NormKind
from skill.porting.model_edits import EditContext, apply_model_edits, select_edits
from skill.porting.plan import plan_for
from skill.snippets import activations as activation_snippets
from skill.snippets import norms as norm_snippets

REPO = Path(__file__).resolve().parents[2]
REFERENCES = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}
MODEL_CLASSES = {"qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}


# ------------------------------------------------------------------ the activation table


def _call(entry_name: str, x: torch.Tensor) -> torch.Tensor:
    """Evaluate the table entry's generated call on ``x``, as the generated module would."""
    entry = ACTIVATIONS[entry_name]
    namespace = {"F": F, "torch": torch, "quick_gelu": activation_snippets.quick_gelu, "x": x}
    return eval(entry.call.replace("{}", "x"), namespace)


@pytest.mark.parametrize("name", [n for n, a in ACTIVATIONS.items() if not a.module])
def test_each_table_call_computes_what_transformers_computes_for_that_name(name: str) -> None:
    x = probe_input()
    torch.testing.assert_close(_call(name, x), ACT2FN[name](x), rtol=1e-6, atol=1e-6)
    assert match_activation(ACT2FN[name]) == name


@pytest.mark.parametrize(
    "key,expected",
    [
        ("gelu_new", "gelu_pytorch_tanh"),
        ("gelu_fast", "gelu_pytorch_tanh"),
        ("gelu_accurate", "gelu_pytorch_tanh"),
        ("gelu_python", "gelu"),
        ("swish", "silu"),
        ("mish", None),
        ("relu6", None),
        ("gelu_10", None),
    ],
)
def test_other_act2fn_keys_map_onto_the_table_by_their_numbers(key: str, expected: str | None) -> None:
    assert match_activation(ACT2FN[key]) == expected


def test_a_family_class_is_identified_by_its_numbers_not_its_name() -> None:
    from transformers.models.bloom.modeling_bloom import BloomGelu

    assert match_activation(BloomGelu()) == "gelu_pytorch_tanh"

    class Mystery(torch.nn.Module):  # a name that says nothing
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(x) ** 2

    assert match_activation(Mystery()) == "relu2"


def test_supported_activations_are_table_entries() -> None:
    # Expert-only activations (clamped SwiGLU) are written by the MoE edits, not the table.
    assert SUPPORTED_EDITS[Feature.ACTIVATION] - EXPERT_ACTIVATIONS <= set(ACTIVATIONS)
    assert not EXPERT_ACTIVATIONS & set(ACTIVATIONS)
    # xIELU: apertus proves it through the stages (its learned scalars under TP in stage 5).
    assert "xielu" in SUPPORTED_EDITS[Feature.ACTIVATION]


def test_gelu_new_family_reports_the_table_entry_and_its_config_field() -> None:
    # GPT-2: activation_function="gelu_new" (NewGELUActivation, the tanh approximation).
    ffn = plan_for("gpt2")
    assert (ffn.activation, ffn.activation_field) == ("gelu_pytorch_tanh", "activation_function")


def test_relu2_port_writes_squared_relu_and_checks_the_config_field() -> None:
    plan = plan_for("arcee")
    assert (plan.activation, plan.activation_field, plan.mlp) == ("relu2", "hidden_act", "plain")
    text = apply_model_edits(REFERENCES["qwen2"], _ctx(plan, "qwen2"), select_edits(plan, REFERENCES["qwen2"]))
    assert "return self.w2(torch.square(F.relu(self.w1(x))))" in text


def test_quick_gelu_helper_is_inserted_once_whatever_the_mlp_shape() -> None:
    for mlp in ("gated", "plain"):
        plan = plan_for("llama").model_copy(update={"activation": "quick_gelu", "mlp": mlp})
        names = select_edits(plan, REFERENCES["qwen2"])
        text = apply_model_edits(REFERENCES["qwen2"], _ctx(plan, "qwen2"), names)
        assert text.count("def quick_gelu(") == 1
        assert "quick_gelu(self.w1(x))" in text
        assert apply_model_edits(text, _ctx(plan, "qwen2"), names) == text


def test_quick_gelu_snippet_matches_transformers() -> None:
    x = probe_input()
    torch.testing.assert_close(activation_snippets.quick_gelu(x), ACT2FN["quick_gelu"](x))


# ------------------------------------------------------------------------ norm snippets


def test_offset_layer_norm_matches_nemotron_layer_norm_1p() -> None:
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    torch.manual_seed(0)
    hf = NemotronLayerNorm1P(16, eps=1e-5)
    ours = norm_snippets.OffsetLayerNorm(16, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
        hf.bias.normal_()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 16) * 4 + 1
    torch.testing.assert_close(ours(x), hf(x))


def test_weightless_rms_norm_has_no_parameters_and_normalises() -> None:
    norm = norm_snippets.WeightlessRMSNorm(16, eps=1e-6)
    assert not list(norm.parameters())
    x = torch.randn(3, 16) * 5
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


# ---------------------------------------------------------- norm edits on both references

VARIANTS = {
    # variant -> (parameters of every norm module, function of (x, weight, bias, eps))
    "rms": ({"weight"}, lambda x, w, b, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * w),
    "rms_offset": ({"weight"}, lambda x, w, b, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * (1 + w)),
    "rms_weightless": (set(), lambda x, w, b, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e)),
    "layernorm": ({"weight", "bias"}, lambda x, w, b, e: F.layer_norm(x, x.shape[-1:], w, b, e)),
    "layernorm_no_bias": ({"weight"}, lambda x, w, b, e: F.layer_norm(x, x.shape[-1:], w, None, e)),
    "layernorm_weightless": (set(), lambda x, w, b, e: F.layer_norm(x, x.shape[-1:], None, None, e)),
    "layernorm_offset": ({"weight", "bias"}, lambda x, w, b, e: F.layer_norm(x, x.shape[-1:], 1 + w, b, e)),
}


def _ctx(plan, reference: str) -> EditContext:
    return EditContext(camel="Toy", model_class=MODEL_CLASSES[reference], profile=plan)


def _load(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module


def _tiny_model(module: types.ModuleType, reference: str, **extra):
    if reference == "qwen2":
        from archon_models.qwen2.model.args import Qwen2ModelArgs as Args
    else:
        from archon_models.qwen3.model.args import Qwen3ModelArgs as Args
    args = Args(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, head_dim=8, hidden_dim=48, max_seq_len=32)
    args.norm_eps = 1e-5
    for name, value in extra.items():
        setattr(args, name, value)  # fields an edit reads that the reference's args lack
    return getattr(module, MODEL_CLASSES[reference])(args)


@pytest.mark.parametrize("reference", sorted(REFERENCES))
@pytest.mark.parametrize("block", ["pre_norm", "sandwich", "post_norm"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_norm_module_computes_the_variant_in_any_edit_order(reference: str, block: str, variant: str) -> None:
    """Block norms, the final norm and (qwen3) the per-head QK norms all become the
    variant, whatever the block wiring, named in any order; a second run changes nothing."""
    qk_norm = "per_head" if reference == "qwen3" else "none"  # qwen3's own per-head QK norm stays
    plan = plan_for("llama").model_copy(update={"norm": variant, "block": block, "qk_norm": qk_norm})
    names = select_edits(plan, REFERENCES[reference])
    text = apply_model_edits(REFERENCES[reference], _ctx(plan, reference), names)
    assert apply_model_edits(REFERENCES[reference], _ctx(plan, reference), list(reversed(names))) == text
    assert apply_model_edits(text, _ctx(plan, reference), names) == text
    model = _tiny_model(_load(text, f"_norm_edit_{reference}_{block}_{variant}"), reference)
    params, function = VARIANTS[variant]
    norms = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1].endswith("norm")}
    expected_names = {"norm", "layers.0.attention_norm", "layers.0.ffn_norm"}
    if block == "sandwich":
        expected_names |= {"layers.0.post_attention_norm", "layers.0.post_ffn_norm"}
    if block == "post_norm":
        expected_names = {"norm", "layers.0.post_attention_norm", "layers.0.post_ffn_norm"}
    if reference == "qwen3":
        expected_names |= {"layers.0.attention.q_norm", "layers.0.attention.k_norm"}
    assert set(norms) == expected_names
    torch.manual_seed(0)
    for name, norm in norms.items():
        assert {n for n, _ in norm.named_parameters()} == params, name
        with torch.no_grad():
            for p in norm.parameters():
                p.normal_()
        width = norm.weight.shape[0] if params else (8 if "attention." in name else 32)
        x = torch.randn(3, width) * 3 + 1
        w = norm.weight.detach() if "weight" in params else None
        b = norm.bias.detach() if "bias" in params else None
        torch.testing.assert_close(norm(x), function(x, w, b, 1e-5), msg=name)


def test_every_norm_kind_the_analyser_names_has_an_edit() -> None:
    from skill.porting.plan import NORM_VARIANTS

    assert set(NORM_VARIANTS) == set(SUPPORTED_EDITS[Feature.NORM_KIND])
    assert set(NORM_VARIANTS.values()) == set(VARIANTS)


# ------------------------------------------------------------------- a measured epsilon


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 3e-6])
@pytest.mark.parametrize(
    "kind,make",
    [
        (NormKind.LAYER_NORM_WEIGHTLESS, lambda e: torch.nn.LayerNorm(32, eps=e, elementwise_affine=False)),
        (NormKind.LAYER_NORM, lambda e: torch.nn.LayerNorm(32, eps=e)),
        (NormKind.RMS, lambda e: torch.nn.RMSNorm(32, eps=e)),
        (NormKind.RMS_WEIGHTLESS, lambda e: norm_snippets.WeightlessRMSNorm(32, eps=e)),
        (NormKind.LAYER_NORM_ONE_PLUS_W, lambda e: norm_snippets.OffsetLayerNorm(32, eps=e)),
    ],
)
def test_norm_epsilon_is_measured(kind: NormKind, make, eps: float) -> None:
    norm = make(eps)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()  # the probe sets a neutral weight itself, and restores this one
    before = [p.clone() for p in norm.parameters()]
    assert probes.probe_norm_eps(norm, 32, kind) == pytest.approx(eps, rel=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(before, norm.parameters(), strict=True))


def test_olmo_eps_has_no_config_field_and_is_written_as_a_constant() -> None:
    # OlmoLayerNorm: F.layer_norm(..., eps=1e-5), no config field.
    from skill.porting.edit_args import arg_fields
    from skill.porting.hf_source import load_config

    plan = plan_for("olmo")
    # No config field: the plan names the default field and carries the measured constant.
    assert (plan.norm, plan.norm_eps_fixed) == ("layernorm_weightless", 1e-5)
    assert not any("epsilon" in line for line in plan.unsupported)
    (eps,) = [f for f in arg_fields(plan, load_config("olmo")) if f.name == "norm_eps"]
    assert (eps.default, eps.expression) == (1e-5, "")


# ------------------------------------------------------------------------------ xIELU


def test_xielu_snippet_matches_transformers_and_holds_its_checkpoint_keys() -> None:
    from transformers.activations import XIELUActivation

    hf = XIELUActivation(dtype=torch.float32)
    with torch.no_grad():
        hf.alpha_p.fill_(0.3)
        hf.alpha_n.fill_(-0.2)
    ours = activation_snippets.XIELU()
    assert set(ours.state_dict()) == set(hf.state_dict()) == {"alpha_p", "alpha_n", "beta", "eps"}
    ours.load_state_dict(hf.state_dict())
    x = probe_input().requires_grad_()
    torch.testing.assert_close(ours(x), hf(x))
    # A fresh module starts where HF's does (the alphas as softplus inverses).
    torch.testing.assert_close(activation_snippets.XIELU()(x), XIELUActivation(dtype=torch.float32)(x))


def test_learned_activation_becomes_a_feed_forward_module_reset_with_it() -> None:
    plan = plan_for("llama").model_copy(update={"activation": "xielu", "mlp": "plain"})
    names = select_edits(plan, REFERENCES["qwen2"])
    text = apply_model_edits(REFERENCES["qwen2"], _ctx(plan, "qwen2"), names)
    assert apply_model_edits(text, _ctx(plan, "qwen2"), names) == text
    assert text.count("class XIELU(") == 1 and text.count("self.act_fn = XIELU()") == 1
    assert "return self.w2(self.act_fn(self.w1(x)))" in text
    assert "self.act_fn.reset_parameters()" in text


# --------------------------------------------------------------------------- clip_qkv


def test_clip_qkv_clamps_each_projection_once_in_any_order_and_only_when_set() -> None:
    plan = plan_for("llama").model_copy(update={"clip_qkv_field": "clip_qkv", "sliding_window": True})
    names = select_edits(plan, REFERENCES["qwen2"])
    assert "clip_qkv" in names
    text = apply_model_edits(REFERENCES["qwen2"], _ctx(plan, "qwen2"), names)
    assert apply_model_edits(REFERENCES["qwen2"], _ctx(plan, "qwen2"), list(reversed(names))) == text
    assert apply_model_edits(text, _ctx(plan, "qwen2"), names) == text
    for projection in ("wq", "wk", "wv"):
        assert text.count(f"clamp_projection(self.{projection}(x), self.clip_qkv)") == 1
    module = _load(text, "_clip_qkv_model")
    unclipped = plan.model_copy(update={"clip_qkv_field": None})
    base_text = apply_model_edits(
        REFERENCES["qwen2"], _ctx(unclipped, "qwen2"), select_edits(unclipped, REFERENCES["qwen2"])
    )
    base = _load(base_text, "_clip_qkv_base")

    def logits(mod, clip):
        torch.manual_seed(0)
        model = _tiny_model(mod, "qwen2", clip_qkv=clip, sliding_window=64)  # a window wider than the input
        model.init_weights()
        tokens = torch.arange(8).unsqueeze(0)
        return model(tokens, tokens, torch.tensor([0, 8]), 8)

    # No clip: the reference's numbers; a clip that binds: different ones.
    torch.testing.assert_close(logits(module, None), logits(base, None))
    assert not torch.allclose(logits(module, 1e-3), logits(base, None))


# ------------------------------------------------------------------------- QK norm kinds


def test_a_qk_norm_of_any_kind_beside_any_block_norm_is_supported() -> None:
    """The QK norm is built as what it computes (the qk_norm_kind edit), whatever the block
    norms compute; only a kind outside the norm vocabulary and a full-width norm after RoPE
    are refused, by name."""
    from skill.analysis.reference import engine_limits
    from skill.features import QKNormKind, QKNormPlacement
    from skill.porting.plan import report_for

    checklist = report_for("qwen3_moe").checklist
    assert checklist.attention.per_head_qk_norm and not engine_limits(checklist)
    for kind in NormKind:
        qk = checklist.attention.model_copy(update={"qk_norm": QKNormKind.LAYER_NORM, "qk_norm_computation": kind})
        for placement in (QKNormPlacement.BEFORE_ROPE, QKNormPlacement.AFTER_ROPE):
            limits = engine_limits(
                checklist.model_copy(update={"attention": qk.model_copy(update={"qk_norm_placement": placement})})
            )
            assert limits == (["QK norm computing no kind of the norm vocabulary"] if kind is NormKind.OTHER else [])
    full_after = checklist.attention.model_copy(
        update={"qk_norm_full_width": True, "qk_norm_placement": QKNormPlacement.AFTER_ROPE}
    )
    assert engine_limits(checklist.model_copy(update={"attention": full_after})) == [
        "full-width QK norm after RoPE (only a per-head one moves after it)"
    ]


# (reference, QK norm width, after RoPE, block norm kind, QK norm kind): per head after RoPE
# on qwen2 (which has no QK norm), full width on qwen3 (whose per-head RMSNorm the full-width
# edit replaces), every pair of kinds; a full-width LayerNorm kind gets its own class even
# beside block norms of its kind (torch's fused layer_norm would gather the sharded width).
QK_CASES = [
    *(("qwen2", "per_head", True, block, qk) for block in sorted(VARIANTS) for qk in sorted(VARIANTS) if block != qk),
    *(
        ("qwen3", "full", False, block, qk)
        for block in sorted(VARIANTS)
        for qk in sorted(VARIANTS)
        if block != qk or qk.startswith("layernorm")
    ),
]
# The default run's pairs (each costs about a second: three edit runs and a model): on each
# reference, each kind once as the block norm and once as the QK norm, beside another kind (the
# next in sorted order), and one full-width LayerNorm beside LayerNorm block norms. The other 73
# pairs carry the ``every_family`` marker, which .ci/run runs as its own step.
_KINDS = sorted(VARIANTS)
QK_CASES_BY_DEFAULT = {
    *(
        (reference, width, after_rope, block, _KINDS[(i + 1) % len(_KINDS)])
        for reference, width, after_rope in (("qwen2", "per_head", True), ("qwen3", "full", False))
        for i, block in enumerate(_KINDS)
    ),
    ("qwen3", "full", False, "layernorm", "layernorm"),
}


def _qk_param(case: tuple[str, str, bool, str, str]):  # type: ignore[no-untyped-def]
    return case if case in QK_CASES_BY_DEFAULT else pytest.param(*case, marks=pytest.mark.every_family)


def test_the_default_run_s_qk_norm_pairs_cover_every_kind_on_both_sides():
    assert set(QK_CASES) >= QK_CASES_BY_DEFAULT
    for reference in ("qwen2", "qwen3"):
        pairs = [(block, qk) for r, *_, block, qk in QK_CASES_BY_DEFAULT if r == reference]
        assert {block for block, qk in pairs if block != qk} == set(VARIANTS), reference
        assert {qk for block, qk in pairs if block != qk} == set(VARIANTS), reference


@pytest.mark.parametrize(("reference", "width", "after_rope", "block", "qk"), [_qk_param(c) for c in QK_CASES])
def test_qk_norms_compute_their_own_kind_beside_any_block_norm(reference, width, after_rope, block, qk) -> None:
    """q_norm/k_norm compute the QK norm's kind, the block norms theirs, in any edit order;
    a second run changes nothing."""
    plan = plan_for("llama").model_copy(
        update={"norm": block, "qk_norm": width, "qk_norm_variant": qk, "qk_norm_after_rope": after_rope}
    )
    names = select_edits(plan, REFERENCES[reference])
    assert "qk_norm_kind" in names
    text = apply_model_edits(REFERENCES[reference], _ctx(plan, reference), names)
    assert apply_model_edits(REFERENCES[reference], _ctx(plan, reference), list(reversed(names))) == text
    assert apply_model_edits(text, _ctx(plan, reference), names) == text
    assert ("The per-head QK norm comes after RoPE." in text) is after_rope
    model = _tiny_model(_load(text, f"_qk_kind_{reference}_{block}_{qk}"), reference)
    norms = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1].endswith("norm")}
    assert {"layers.0.attention.q_norm", "layers.0.attention.k_norm", "norm"} <= set(norms)
    torch.manual_seed(0)
    for name, norm in norms.items():
        variant = qk if "attention." in name else block
        params, function = VARIANTS[variant]
        assert {n for n, _ in norm.named_parameters()} == params, name
        with torch.no_grad():
            for p in norm.parameters():
                p.normal_()
        widths = {"layers.0.attention.q_norm": 4 * 8, "layers.0.attention.k_norm": 2 * 8}
        width_of = (widths.get(name, 8) if width == "full" else 8) if "attention." in name else 32
        x = torch.randn(3, width_of) * 3 + 1
        w = norm.weight.detach() if "weight" in params else None
        b = norm.bias.detach() if "bias" in params else None
        torch.testing.assert_close(norm(x), function(x, w, b, 1e-5), msg=name)


def test_a_qk_norm_computing_what_the_block_norms_do_shares_their_class() -> None:
    # Qwen3: per-head RMSNorm QK norms beside RMSNorm block norms: no class of their own
    # (the committed families with such QK norms keep their bytes).
    from skill.porting.plan import plan_from_report, report_for

    assert plan_for("qwen3").qk_norm_variant is None
    assert plan_for("gemma3_text").qk_norm_variant is None  # (1 + w) both
    assert plan_for("persimmon").qk_norm_variant is None  # per-head LayerNorm both
    olmo2 = report_for("olmo2")
    assert plan_for("olmo2").qk_norm == "full" and plan_for("olmo2").qk_norm_variant is None
    # Full width and LayerNorm on both sides: the QK norms get their own class.
    checklist = olmo2.checklist.model_copy(
        update={
            "norm": olmo2.checklist.norm.model_copy(update={"kind": NormKind.LAYER_NORM}),
            "attention": olmo2.checklist.attention.model_copy(update={"qk_norm_computation": NormKind.LAYER_NORM}),
        }
    )
    plan = plan_from_report(olmo2.model_copy(update={"checklist": checklist}), "olmo2")
    assert (plan.norm, plan.qk_norm, plan.qk_norm_variant) == ("layernorm", "full", "layernorm")


def test_a_dense_family_with_a_per_head_qk_norm_starts_from_qwen2() -> None:
    # Apertus: per-head QK RMSNorm, dense. It starts from qwen2 (the per_head_qk_norm edit;
    # copying qwen3 would keep MoE args no edit strips); its xIELU is the activation edit's.
    from skill.porting.plan import report_for

    report = report_for("apertus")
    assert report.reference == "qwen2"
    assert report.checklist.ffn.activation == "xielu"
    assert report.unsupported == []


def test_norms_inside_the_attention_or_feed_forward_are_measured_not_refused() -> None:
    # BitNet: attn_sub_norm before o_proj, ffn_sub_norm before down_proj, of the block norms'
    # kind: the sub-norm edits write them (tests/skill/test_sub_norms.py), nothing is refused.
    from skill.porting.plan import report_for

    report = report_for("bitnet")
    assert report.unsupported == []
    assert (report.checklist.attention.sub_norm, report.checklist.ffn.sub_norm) == (NormKind.RMS, NormKind.RMS)


def test_learned_activation_is_replicated_over_tp_with_summed_gradients() -> None:
    # Apertus (xIELU): w1's column shard reaches act_fn, so its scalars are replicated
    # DTensors whose gradients are summed over the TP ranks (SequenceParallel over the
    # feature dim); a plain parameter there gets a per-rank partial gradient (stage 5
    # fails on layers.*.feed_forward.act_fn.alpha_p without this entry).
    from skill.codemod.cst import read_dict_literal
    from skill.porting.write_parallelize import PLAN_TARGET

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "archon_models/apertus/infra/parallelize.py").read_text()
    plan = read_dict_literal(Document(text), PLAN_TARGET)  # keys (values that are calls read as None)
    assert "feed_forward.act_fn" in plan and "feed_forward.w1" in plan and "feed_forward.w3" not in plan
    assert '"feed_forward.act_fn": SequenceParallel(sequence_dim=-1, use_local_output=True),' in text
    assert '"feed_forward.w1": ColwiseParallel(),' in text


@pytest.mark.parametrize(("reference", "qk_norm"), [("qwen2", "full"), ("qwen3", "per_head"), ("qwen3", "full")])
@pytest.mark.parametrize("after_norm", [False, True])
def test_clip_qkv_clamps_q_and_k_on_the_measured_side_of_the_qk_norm(reference, qk_norm, after_norm) -> None:
    # OlmoeAttention: `q = self.q_norm(self.q_proj(x))`, then `q.clamp_(-clip, clip)`: the
    # clamp must see the norm's output; OLMo-style clipping (after_norm False) sees wq's.
    plan = plan_for("llama").model_copy(
        update={"clip_qkv_field": "clip_qkv", "qk_norm": qk_norm, "clip_after_qk_norm": after_norm}
    )
    names = select_edits(plan, REFERENCES[reference])
    text = apply_model_edits(REFERENCES[reference], _ctx(plan, reference), names)
    assert apply_model_edits(REFERENCES[reference], _ctx(plan, reference), list(reversed(names))) == text
    assert apply_model_edits(text, _ctx(plan, reference), names) == text
    assert text.count("clamp_projection(self.wv(x), self.clip_qkv)") == 1
    assert ("clamp_projection(self.q_norm(" in text) is after_norm
    assert ("clamp_projection(self.wq(x)" in text) is not after_norm
    module = _load(text, f"_clip_side_{reference}_{qk_norm}_{after_norm}")
    torch.manual_seed(0)
    model = _tiny_model(module, reference, clip_qkv=1e-3)
    model.init_weights()
    attention = model.layers["0"].attention
    seen: list[torch.Tensor] = []
    produced: dict[str, torch.Tensor] = {}
    clamp = module.clamp_projection

    def recording(x, limit):
        seen.append(x.detach().clone())
        return clamp(x, limit)

    hooks = [
        getattr(attention, name).register_forward_hook(
            lambda _m, _a, out, name=name: produced.__setitem__(name, out.detach().clone())
        )
        for name in ("q_norm", "wq")
    ]
    module.clamp_projection = recording
    try:
        tokens = torch.arange(8).unsqueeze(0)
        model(tokens, tokens, torch.tensor([0, 8]), 8)
    finally:
        module.clamp_projection = clamp
        for hook in hooks:
            hook.remove()
    clamped_q = produced["q_norm" if after_norm else "wq"]
    assert any(x.shape == clamped_q.shape and torch.equal(x, clamped_q) for x in seen)
    other_q = produced["wq" if after_norm else "q_norm"]
    assert not any(x.shape == other_q.shape and torch.equal(x, other_q) for x in seen)
