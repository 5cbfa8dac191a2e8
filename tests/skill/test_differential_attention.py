"""Differential attention (issue 22: diffllama): the analysis measures it on transformers' own
DiffLlama, refuses by name what it does not read or does not compose with, and the adapter's
head order keeps every head pair (and its two KV heads) side by side.

The port itself is proven by tests/archon/test_diffllama.py (stages 1-6, GQA with eight query
heads over four KV heads, TP and Ulysses over two ranks) and by the composition family
tests/composition/diffmoe (qwen3 reference: its own names, doubled values, per-head QK norm,
a sliding window on every other layer, MoE).
"""

from __future__ import annotations

import pytest
import torch

from skill.analysis.differential import LAMBDA_INIT, differential_parts, lambda_init, measure_differential
from skill.analysis.reference import engine_limits
from skill.porting.plan import report_for
from skill.snippets.adapter import _pair_halves, _unpair_halves
from skill.tiny_model import build_tiny_model, tiny_config

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 16


def _diffllama(layers: int = 3):  # type: ignore[no-untyped-def]
    config = tiny_config(
        "diffllama",
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=layers,
    )
    model = build_tiny_model(config)
    return model, [layer.self_attn for layer in model.model.layers]


def _measure(model, attentions, kv_heads: int = KV_HEADS):  # type: ignore[no-untyped-def]
    return measure_differential(model, attentions, "v_proj", "o_proj", kv_heads, HEAD_DIM)


def test_the_probe_reads_diffllama_on_every_layer():
    model, attentions = _diffllama()
    found, why_not = _measure(model, attentions)
    assert why_not is None
    assert found is not None
    assert found.lambda_vectors == ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]
    assert found.norm == "groupnorm"
    assert found.norm_eps == pytest.approx(model.config.rms_norm_eps, rel=1e-2)
    assert found.lambda_init == LAMBDA_INIT
    assert [lambda_init(i) for i in range(3)] == [a.lambda_init for a in attentions]


def test_the_probe_leaves_the_model_as_it_was():
    model, attentions = _diffllama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _measure(model, attentions)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_another_lambda_init_schedule_is_refused_by_name():
    model, attentions = _diffllama()
    attentions[2].lambda_init = 0.5  # not 0.8 - 0.6 * exp(-0.6)
    found, why_not = _measure(model, attentions)
    assert found is None
    assert why_not == f"differential attention whose lambda_init schedule is not {LAMBDA_INIT} (layer 2)"


def test_a_combination_that_is_not_the_closed_form_is_refused_by_name():
    """A lambda that does not move the output (the second pair's product ignored) matches no
    pairing of the four vectors."""
    model, attentions = _diffllama(layers=2)
    original = type(attentions[0]).forward

    def without_second(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        saved = self.lambda_k2.detach().clone()
        with torch.no_grad():
            self.lambda_k2.zero_()
        try:
            return original(self, *args, **kwargs)
        finally:
            with torch.no_grad():
                self.lambda_k2.copy_(saved)

    for attention in attentions:
        attention.forward = without_second.__get__(attention)
    found, why_not = _measure(model, attentions)
    assert found is None
    assert why_not == "differential attention that is not (softmax_1 - lambda softmax_2) V over head pairs"


def test_an_odd_kv_head_count_is_refused_by_name():
    model, attentions = _diffllama(layers=1)
    found, why_not = _measure(model, attentions, kv_heads=3)
    assert found is None and why_not == "differential attention over an odd number of KV heads (3)"


def test_a_family_without_it_measures_none():
    model = build_tiny_model(tiny_config("llama"))
    attention = model.model.layers[0].self_attn
    found, why_not = measure_differential(model, [attention], "v_proj", "o_proj", 4, 16)
    assert (found, why_not) == (None, None)


def test_diffllama_report_names_the_keys_and_no_limit():
    report = report_for("diffllama")
    differential = report.checklist.attention.differential
    assert differential is not None
    assert differential.lambda_keys == [f"self_attn.lambda_{p}" for p in ("q1", "k1", "q2", "k2")]
    assert report.unsupported == []
    assert engine_limits(report.checklist) == []


@pytest.mark.parametrize(
    ("update", "named"),
    [
        ({"sinks": True}, "differential attention with attention sinks"),
        ({"fused_qkv": True}, "differential attention with a fused q/k/v projection"),
        ({"output_gate": True}, "differential attention with a gated attention output"),
    ],
)
def test_what_it_does_not_compose_with_is_refused_by_name(update, named):
    checklist = report_for("diffllama").checklist
    attention = checklist.attention.model_copy(update=update)
    assert named in engine_limits(checklist.model_copy(update={"attention": attention}))


def test_a_pair_norm_epsilon_unlike_the_block_norms_is_refused_by_name():
    checklist = report_for("diffllama").checklist
    differential = checklist.attention.differential
    assert differential is not None
    attention = checklist.attention.model_copy(
        update={"differential": differential.model_copy(update={"norm_eps": 1e-3})}
    )
    limits = engine_limits(checklist.model_copy(update={"attention": attention}))
    assert any(limit.startswith("differential attention whose pair norm's epsilon (0.001)") for limit in limits)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 4), (8, 8), (4, 2)])
def test_the_adapter_puts_each_head_pair_and_its_kv_heads_side_by_side(heads: int, kv_heads: int):
    head_dim, n_rep = 3, heads // kv_heads
    q = torch.arange(heads).repeat_interleave(head_dim).float()[:, None].expand(-1, 5)  # rows labelled by head
    kv = torch.arange(kv_heads).repeat_interleave(head_dim).float()
    paired_q = _pair_halves(q, n_rep * head_dim)[::head_dim, 0].long().tolist()
    paired_kv = _pair_halves(kv, head_dim)[::head_dim].long().tolist()
    half, kv_half = heads // 2, kv_heads // 2
    # Pair group j: KV heads j and j + KV/2, then the query heads of each.
    assert paired_kv == [h for j in range(kv_half) for h in (j, j + kv_half)]
    assert paired_q == [s * half + j * n_rep + t for j in range(kv_half) for s in range(2) for t in range(n_rep)]
    assert torch.equal(_unpair_halves(_pair_halves(q, n_rep * head_dim), n_rep * head_dim), q)
    assert torch.equal(_unpair_halves(_pair_halves(kv, head_dim), head_dim), kv)


@pytest.mark.parametrize(("kv_heads", "ranks", "splits"), [(4, 2, True), (8, 4, True), (4, 4, False), (6, 2, False)])
def test_the_package_refuses_a_split_that_breaks_a_head_pair(kv_heads: int, ranks: int, splits: bool):
    """A TP (times Ulysses) degree that leaves a rank part of a pair is refused where the heads
    are split, in one sentence naming the fix, before any step runs."""
    from archon_models.diffllama.infra.parallelize import validate_differential_pairs
    from archon_models.diffllama.model.args import DiffllamaModelArgs

    args = DiffllamaModelArgs(n_heads=2 * kv_heads, n_kv_heads=kv_heads)
    if splits:
        validate_differential_pairs(args, ranks)
        return
    with pytest.raises(ValueError, match=r"cannot be split over \d ranks .* divides n_kv_heads / 2"):
        validate_differential_pairs(args, ranks)


def test_the_pair_norm_is_told_apart_from_weightless_qk_norms():
    """Fuzzer seed 16: a per-head QK norm without weights beside the weightless pair norm made
    three weightless norms, and the attention was refused as parameters outside the vocabulary."""
    from torch import nn

    class WeightlessRMSNorm(nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    attention = nn.Module()
    attention.q_proj, attention.v_proj = nn.Linear(8, 8), nn.Linear(8, 8)
    attention.q_norm, attention.k_norm = WeightlessRMSNorm(), WeightlessRMSNorm()
    attention.pair_norm = nn.RMSNorm(8, elementwise_affine=False)
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        attention.register_parameter(name, nn.Parameter(torch.zeros(4)))
    assert differential_parts(attention, 4) == (["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"], "pair_norm")
