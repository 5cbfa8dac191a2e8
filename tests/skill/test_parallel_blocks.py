"""Parallel attention/MLP blocks and fused q/k/v row layouts: measured on the real
transformers families, written as contract edits that compose on both references, and
regrouped by the generated adapter exactly as the HF modeling code splits the rows."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
import torch

from skill.analysis.analyze import analyze_hf_model
from skill.analysis.report import AnalyzeInput
from skill.codemod.contract import parallel_branches, residual_branch_code
from skill.codemod.cst import Document
from skill.features import SUPPORTED_EDITS, Feature, FusedQKVLayout, NormPlacement
from skill.porting.edit_adapter_map import derive_from_hf_map, fused_from_report
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import plan_for, plan_from_report
from skill.snippets.adapter import _group_qkv, _ungroup_qkv
from tests.skill.test_analyze_families import report_for

REPO = Path(__file__).resolve().parents[2]
REFERENCES = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}
MODEL_CLASSES = {"qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}


def _falcon_report(**overrides):
    from transformers import FalconConfig

    with tempfile.TemporaryDirectory() as folder:
        FalconConfig(**overrides).save_pretrained(folder)
        return analyze_hf_model(AnalyzeInput(source=folder))


# ----------------------------------------------------------------- the analyser


def test_gpt_neox_has_two_input_norms_and_grouped_qkv() -> None:
    # GPTNeoXLayer (use_parallel_residual): attention(input_layernorm(x)) and
    # mlp(post_attention_layernorm(x)), both of the layer input; GPTNeoXAttention views
    # query_key_value's output as [..., n_heads, 3 * head_dim] (q, k, v per head).
    report = report_for("gpt_neox")
    norm, attention = report.checklist.norm, report.checklist.attention
    assert norm.placement == NormPlacement.PARALLEL
    # Both norms are LayerNorms initialised alike; the probe still tells them apart.
    assert norm.block_norms == {"input_layernorm": "pre_attention", "post_attention_layernorm": "pre_ffn"}
    assert attention.fused_qkv_layout == FusedQKVLayout.GROUPED
    assert not report.unsupported
    # GPTNeoXForCausalLM keeps lm_head in memory and saves it as embed_out.
    assert report.checkpoint.module_map["embed_out"] == "output"
    assert report.checkpoint.module_map["gpt_neox.layers.{}.attention.dense"] == "layers.{}.attention.wo"
    assert report.checkpoint.fused_modules == {
        "gpt_neox.layers.{}.attention.query_key_value": [
            "layers.{}.attention.wq",
            "layers.{}.attention.wk",
            "layers.{}.attention.wv",
        ]
    }
    plan = plan_from_report(report, "gpt_neox")
    assert plan.block == "parallel" and not plan.shared_block_norm
    # GPTNeoXConfig has no KV-head field: the port gives every query head its own K and V.
    assert plan.kv_heads_field is None


def test_falcon_variants_by_probe() -> None:
    # FalconDecoderLayer: parallel_attn with one input_layernorm (default); with
    # new_decoder_architecture, ln_attn and ln_mlp. FalconAttention._split_heads: multi_query
    # -> [n_heads + 2, head_dim] (q heads, then k, then v: stacked); new architecture ->
    # [n_kv, n_heads / n_kv + 2, head_dim] (grouped); otherwise [n_heads, 3, head_dim] (grouped).
    default = report_for("falcon").checklist
    assert default.norm.placement == NormPlacement.PARALLEL
    assert default.norm.block_norms == {"input_layernorm": "pre_attention"}
    assert default.attention.fused_qkv_layout == FusedQKVLayout.STACKED
    assert plan_for("falcon").shared_block_norm
    new = _falcon_report(new_decoder_architecture=True, num_kv_heads=8, num_attention_heads=32, hidden_size=2048)
    assert new.checklist.attention.fused_qkv_layout == FusedQKVLayout.GROUPED
    assert new.checklist.attention.n_kv_heads == 8
    assert new.checklist.norm.block_norms == {"ln_attn": "pre_attention", "ln_mlp": "pre_ffn"}
    mha = _falcon_report(multi_query=False)
    assert mha.checklist.attention.fused_qkv_layout == FusedQKVLayout.GROUPED


def test_grouped_qkv_with_one_kv_head_is_told_from_stacked() -> None:
    # Falcon's new architecture with one KV head: [n_kv=1, n_heads + 2, head_dim] rows read
    # exactly as the stacked ones, but any port's test case with two KV heads splits them per
    # group. Twice the heads (two KV heads) tells the layout (fuzzer seed 0: MQA, fused grouped).
    mqa = _falcon_report(new_decoder_architecture=True, num_kv_heads=1, num_attention_heads=8, hidden_size=512)
    assert mqa.checklist.attention.n_kv_heads == 1
    assert mqa.checklist.attention.fused_qkv_layout == FusedQKVLayout.GROUPED


@pytest.mark.parametrize(
    "model_type,layout",
    [("phi3", FusedQKVLayout.STACKED), ("persimmon", FusedQKVLayout.GROUPED), ("llama", FusedQKVLayout.NONE)],
)
def test_fused_qkv_layout_of_other_families(model_type: str, layout: FusedQKVLayout) -> None:
    # Phi3Attention: qkv_proj output split as [q heads | k heads | v heads];
    # PersimmonAttention: view(..., n_heads, 3, head_dim); Llama: separate projections.
    assert report_for(model_type).checklist.attention.fused_qkv_layout == layout


def test_pre_norm_families_keep_their_roles() -> None:
    # Distinct norm weights in the probe change nothing for a pre-norm block.
    assert report_for("llama").checklist.norm.block_norms == {
        "input_layernorm": "pre_attention",
        "post_attention_layernorm": "pre_ffn",
    }


def test_parallel_and_layouts_are_supported_values() -> None:
    assert NormPlacement.PARALLEL in SUPPORTED_EDITS[Feature.NORM_PLACEMENT]
    assert FusedQKVLayout.GROUPED in SUPPORTED_EDITS[Feature.FUSED_QKV_LAYOUT]
    assert FusedQKVLayout.OTHER not in SUPPORTED_EDITS[Feature.FUSED_QKV_LAYOUT]


# ----------------------------------------------------------------- the edits


@pytest.mark.parametrize("reference", sorted(REFERENCES))
def test_parallel_branches_read_the_block_input(reference: str) -> None:
    text = Document(REFERENCES[reference])
    (attention,) = residual_branch_code(text, "attention")
    (ffn,) = residual_branch_code(text, "ffn")
    parallel = parallel_branches(text)
    assert parallel_branches(parallel) is parallel  # idempotent
    # One sum; both branches still found by the contract (so later edits can wrap them).
    assert residual_branch_code(parallel, "attention") == [attention]
    assert residual_branch_code(parallel, "ffn") == [ffn]
    forward = parallel.code.split("class TransformerBlock", 1)[1].split("def init_weights", 1)[0]
    assert "x = x + self.attention" not in forward
    assert f"return x + {attention} + {ffn}" in forward


@pytest.mark.parametrize("reference", sorted(REFERENCES))
@pytest.mark.parametrize("shared", [False, True])
def test_parallel_block_composes_with_other_block_edits_in_any_order(reference: str, shared: bool) -> None:
    """parallel_block, residual_multiplier, layer_norm and (on qwen3) all_layers_moe touch
    the same forward; named in any order they give one module."""
    update = {
        "block": "parallel",
        "shared_block_norm": shared,
        "residual_multiplier_field": "residual_multiplier",
        "norm": "layernorm",
    }
    names = ["parallel_block", "residual_multiplier", "layer_norm"]
    if reference == "qwen3":
        update["all_layers_moe"] = True
        names.append("all_layers_moe")
    plan = plan_for("llama").model_copy(update=update)
    ctx = EditContext(camel="Toy", model_class=MODEL_CLASSES[reference], profile=plan)
    results = {
        order: apply_model_edits(REFERENCES[reference], ctx, list(order)) for order in itertools.permutations(names)
    }
    canonical = results[tuple(names)]
    assert all(text == canonical for text in results.values())
    (attention,) = residual_branch_code(Document(canonical), "attention")
    (ffn,) = residual_branch_code(Document(canonical), "ffn")
    assert attention.endswith("* self.residual_multiplier") and ffn.endswith("* self.residual_multiplier")
    forward = canonical.split("class TransformerBlock", 1)[1].split("def init_weights", 1)[0]
    if shared:
        assert "h = self.attention_norm(x)" in forward and "self.ffn_norm" not in canonical
        assert "self.attention(h," in attention and ffn.startswith(("self.feed_forward(h)", "self.moe(h)"))
    else:
        assert "self.attention_norm(x)" in attention and "self.ffn_norm(x)" in ffn
        assert "self.ffn_norm = nn.LayerNorm(" in canonical
    compile(canonical, "model.py", "exec")


# ----------------------------------------------------------------- the adapter


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("trailing", [(), (5,)])
def test_grouped_qkv_regroups_as_hf_splits_it(heads: int, kv: int, trailing: tuple[int, ...]) -> None:
    # FalconAttention._split_heads (new architecture) and GPT-NeoX (kv == heads): the fused
    # rows viewed as [n_kv, heads / kv + 2, head_dim]: q heads of the group, then k, then v.
    head_dim = 3
    per_kv = heads // kv
    fused = torch.randn((heads + 2 * kv) * head_dim, *trailing)
    grouped = fused.reshape(kv, per_kv + 2, head_dim, *trailing)
    want_q = grouped[:, :per_kv].reshape(heads * head_dim, *trailing)
    want_k = grouped[:, per_kv].reshape(kv * head_dim, *trailing)
    want_v = grouped[:, per_kv + 1].reshape(kv * head_dim, *trailing)
    stacked = _ungroup_qkv(fused, heads, kv, head_dim)
    q, k, v = torch.split(stacked, [heads * head_dim, kv * head_dim, kv * head_dim])
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(_group_qkv(stacked, heads, kv, head_dim), fused)


def test_adapter_map_from_structure_for_renamed_checkpoints() -> None:
    report = report_for("gpt_neox")
    keys = [k.key for k in report.checkpoint.top_level + report.checkpoint.layer0]
    prefix = "gpt_neox.layers.{}."
    shapes = {k.key: tuple(k.shape) for k in report.checkpoint.top_level + report.checkpoint.layer0}
    fused = fused_from_report(report.checkpoint.fused_modules, shapes, prefix)
    assert set(fused) == {f"{prefix}attention.query_key_value.weight", f"{prefix}attention.query_key_value.bias"}
    mapping = derive_from_hf_map(
        keys,
        fused=fused,
        norm_roles=report.checklist.norm.block_norms,
        module_map=report.checkpoint.module_map,
        layer_prefix=prefix,
    )
    assert mapping["embed_out.weight"] == "output.weight"
    assert "lm_head.weight" not in mapping  # the head is named once, as the checkpoint names it
    assert mapping["gpt_neox.embed_in.weight"] == "tok_embeddings.weight"
    assert mapping["gpt_neox.final_layer_norm.bias"] == "norm.bias"
    assert mapping[f"{prefix}post_attention_layernorm.weight"] == "layers.{}.ffn_norm.weight"
    assert mapping[f"{prefix}mlp.dense_h_to_4h.bias"] == "layers.{}.feed_forward.w1.bias"
    assert not set(fused) & set(mapping)


# ----------------------------------------------------------------- logit multiplier


def test_cohere_logit_scale_is_a_multiplier_the_engine_writes() -> None:
    # CohereForCausalLM: `logits = self.lm_head(hidden_states) * self.logit_scale` (0.0625).
    report = report_for("cohere")
    source = report.checklist.scalars.logit_multiplier_source
    assert (source.field, source.relation) == ("logit_scale", "x")
    assert not any("logit" in line for line in report.unsupported)
    plan = plan_from_report(report, "cohere")
    assert plan.logit_multiplier_field == "logit_scale" and plan.logit_divisor_field is None
    assert plan.block == "parallel" and plan.shared_block_norm


@pytest.mark.parametrize("reference", sorted(REFERENCES))
def test_logit_multiplier_composes_with_the_soft_cap(reference: str) -> None:
    plan = plan_for("llama").model_copy(update={"logit_multiplier_field": "logit_scale", "final_softcap": True})
    ctx = EditContext(camel="Toy", model_class=MODEL_CLASSES[reference], profile=plan)
    names = ["logits_multiplier", "final_softcap"]
    one = apply_model_edits(REFERENCES[reference], ctx, names)
    assert apply_model_edits(REFERENCES[reference], ctx, list(reversed(names))) == one
    assert apply_model_edits(one, ctx, names) == one
    # The scale applies to the head's logits, before the cap.
    assert one.index("logits = logits * self.model_args.logit_scale") < one.index("logits = torch.tanh(")
