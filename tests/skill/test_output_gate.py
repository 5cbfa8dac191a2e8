"""Gated attention output: the detector's kind on the real families, and the output_gate
edit (a gate projection of the block input scaling the attention output before ``wo``)
composing with the other attention edits on both references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skill.features import SUPPORTED_EDITS, Feature, OutputGateKind, feature_values
from skill.porting.model_edits import apply_model_edits, select_edits
from skill.porting.plan import plan_for, report_for
from tests.skill.test_activations_norms import REFERENCES, _ctx, _load, _tiny_model

KINDS = [
    OutputGateKind.SIGMOID_PER_ELEMENT,
    OutputGateKind.SIGMOID_PER_HEAD,
    OutputGateKind.SOFTPLUS_PER_ELEMENT,
    OutputGateKind.SOFTPLUS_PER_HEAD,
]
QUERY_KINDS = [OutputGateKind.SIGMOID_IN_QUERY, OutputGateKind.SOFTPLUS_IN_QUERY]
GATE_FUNCTIONS = {"sigmoid": torch.sigmoid, "softplus": F.softplus}


def test_supported_kinds_are_the_read_gate_functions() -> None:
    supported = SUPPORTED_EDITS[Feature.ATTN_OUTPUT_GATE]
    assert set(KINDS) | set(QUERY_KINDS) | {"false"} == supported
    assert OutputGateKind.IN_QUERY not in supported and OutputGateKind.UNMATCHED not in supported


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "kind", "key", "bias"),
    [
        # sigmoid(gate_proj(x)) * out, elementwise (HRM-Text; AFMoE the same)
        ("hrm_text", OutputGateKind.SIGMOID_PER_ELEMENT, "self_attn.gate_proj", False),
        # softplus(g_proj(x)) per head (gating="per-head" is Laguna's default)
        ("laguna", OutputGateKind.SOFTPLUS_PER_HEAD, "self_attn.g_proj", False),
        # Doge's dt_proj reads the values into a dynamic mask: no gate function explains it
        ("doge", OutputGateKind.UNMATCHED, "self_attn.dt_proj", False),
    ],
)
def test_detector_names_the_gate_kind_on_real_families(model_type: str, kind: str, key: str, bias: bool) -> None:
    report = report_for(model_type)
    attention = report.checklist.attention
    assert attention.output_gate
    assert (attention.output_gate_kind, attention.output_gate_key, attention.output_gate_bias) == (kind, key, bias)
    assert feature_values(report.checklist)[Feature.ATTN_OUTPUT_GATE] == kind
    gate_line = f"unsupported: gated attention output = {kind}"
    assert (gate_line in report.unsupported) == (kind not in SUPPORTED_EDITS[Feature.ATTN_OUTPUT_GATE])


@pytest.mark.slow
def test_hrm_text_is_refused_for_its_recurrent_stacks_not_its_gate() -> None:
    unsupported = report_for("hrm_text").unsupported
    assert not any("gated attention output" in line for line in unsupported)
    assert any("more than one stack" in line for line in unsupported), unsupported
    assert any("a recurrent layer stack" in line for line in unsupported), unsupported


def _plan(kind: str, bias: bool = False, **extra):
    return plan_for("llama").model_copy(update={"output_gate": kind, "output_gate_bias": bias, **extra})


@pytest.mark.parametrize("reference", sorted(REFERENCES))
@pytest.mark.parametrize("kind", KINDS)
def test_output_gate_composes_in_any_order_with_the_other_attention_edits(reference: str, kind: str) -> None:
    # With sinks, clipped q/k/v, a custom scale and sandwich norms: all touch Attention.
    plan = _plan(kind, bias=True, attn_sinks=True, clip_qkv_field="clip_qkv", block="sandwich")
    names = select_edits(plan, REFERENCES[reference])
    assert "output_gate" in names and "attention_sinks" in names and "clip_qkv" in names
    text = apply_model_edits(REFERENCES[reference], _ctx(plan, reference), names)
    assert apply_model_edits(REFERENCES[reference], _ctx(plan, reference), list(reversed(names))) == text
    assert apply_model_edits(text, _ctx(plan, reference), names) == text
    assert text.count("self.wg = nn.Linear(") == 1 and text.count("self.wg(x)") == 1
    assert text.count("nn.init.zeros_(self.wg.bias)") == 1 and "nn.init.zeros_(self.sinks)" in text
    assert text.count("def gate_per_head(") == (1 if kind.endswith("_per_head") else 0)
    _load(text, f"_gate_{reference}_{kind}")  # it compiles


@pytest.mark.parametrize("reference", sorted(REFERENCES))
@pytest.mark.parametrize("kind", KINDS)
def test_output_gate_scales_what_wo_receives(reference: str, kind: str) -> None:
    """``wo``'s input is the ungated attention output times f(wg(x)), per element or with
    each head's value repeated over its channels."""
    plan = _plan(kind, bias=True)
    gated = _load(
        apply_model_edits(REFERENCES[reference], _ctx(plan, reference), select_edits(plan, REFERENCES[reference])), "_g"
    )
    plain_plan = plan.model_copy(update={"output_gate": None})
    plain = _load(
        apply_model_edits(
            REFERENCES[reference], _ctx(plain_plan, reference), select_edits(plain_plan, REFERENCES[reference])
        ),
        "_p",
    )
    torch.manual_seed(0)
    model = _tiny_model(gated, reference)
    model.init_weights()
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wg.bias.normal_()  # init_weights zeroes it
    base = _tiny_model(plain, reference)
    missing, unexpected = base.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".wg." in k for k in unexpected) and unexpected

    seen: dict[str, torch.Tensor] = {}

    def capture(name: str):
        def hook(module, args):
            seen[name] = args[0].detach()

        return hook

    attention = model.layers["0"].attention
    handles = [
        attention.wo.register_forward_pre_hook(capture("gated")),
        attention.wg.register_forward_pre_hook(capture("x")),
        base.layers["0"].attention.wo.register_forward_pre_hook(capture("plain")),
    ]
    tokens = torch.arange(10).unsqueeze(0)
    cu_seqlens, positions = torch.tensor([0, 4, 10]), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        model(tokens, positions, cu_seqlens, 6)
        base(tokens, positions, cu_seqlens, 6)
    for handle in handles:
        handle.remove()
    function, granularity = kind.split("_per_")
    gate = GATE_FUNCTIONS[function](attention.wg(seen["x"]).detach())
    if granularity == "head":
        assert gate.shape[-1] == attention.n_heads
        gate = gate.repeat_interleave(attention.head_dim, dim=-1)
    torch.testing.assert_close(seen["gated"], seen["plain"] * gate)


# ------------------------------------------------------ a gate inside the query projection


def test_query_gate_composes_in_any_order_with_the_other_attention_edits_on_both_references() -> None:
    for reference in sorted(REFERENCES):
        plan = _plan(OutputGateKind.SIGMOID_IN_QUERY, attn_sinks=True, block="sandwich")
        names = select_edits(plan, REFERENCES[reference])
        assert "query_gate" in names and "output_gate" not in names and "attention_sinks" in names
        text = apply_model_edits(REFERENCES[reference], _ctx(plan, reference), names)
        assert apply_model_edits(REFERENCES[reference], _ctx(plan, reference), list(reversed(names))) == text
        assert apply_model_edits(text, _ctx(plan, reference), names) == text
        assert "nn.Linear(model_args.dim, 2 * self.n_heads * self.head_dim" in text
        assert text.count("query, gate = split_query_gate(self.wq(x), self.head_dim)") == 1
        assert "self.wg" not in text and text.count("def split_query_gate(") == 1
        _load(text, f"_query_gate_{reference}")  # it compiles


@pytest.mark.parametrize("reference", sorted(REFERENCES))
@pytest.mark.parametrize("kind", QUERY_KINDS)
def test_query_gate_splits_each_heads_rows_into_query_then_gate(reference: str, kind: str) -> None:
    """With wq's rows head by head [query, gate], ``wo`` receives the attention output of the
    query rows alone times f(the gate rows of x)."""
    plan = _plan(kind)
    gated = _load(
        apply_model_edits(REFERENCES[reference], _ctx(plan, reference), select_edits(plan, REFERENCES[reference])), "_q"
    )
    plain_plan = plan.model_copy(update={"output_gate": None})
    plain = _load(
        apply_model_edits(
            REFERENCES[reference], _ctx(plain_plan, reference), select_edits(plain_plan, REFERENCES[reference])
        ),
        "_p",
    )
    torch.manual_seed(0)
    model = _tiny_model(gated, reference)
    model.init_weights()
    base = _tiny_model(plain, reference)
    attention = model.layers["0"].attention
    heads, head_dim = attention.n_heads, attention.head_dim
    rows = attention.wq.weight.unflatten(0, (heads, 2, head_dim))  # head, [query, gate], channel
    state = dict(model.state_dict())
    state["layers.0.attention.wq.weight"] = rows[:, 0].flatten(0, 1)
    base.load_state_dict(state)

    seen: dict[str, torch.Tensor] = {}

    def capture(name: str):
        def hook(module, args):
            seen[name] = args[0].detach()

        return hook

    handles = [
        attention.wo.register_forward_pre_hook(capture("gated")),
        attention.wq.register_forward_pre_hook(capture("x")),
        base.layers["0"].attention.wo.register_forward_pre_hook(capture("plain")),
    ]
    tokens = torch.arange(10).unsqueeze(0)
    cu_seqlens, positions = torch.tensor([0, 4, 10]), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        model(tokens, positions, cu_seqlens, 6)
        base(tokens, positions, cu_seqlens, 6)
    for handle in handles:
        handle.remove()
    gate = GATE_FUNCTIONS[kind.removesuffix("_in_query")](seen["x"] @ rows[:, 1].flatten(0, 1).detach().T)
    torch.testing.assert_close(seen["gated"], seen["plain"] * gate)
