"""Post-LN blocks and the config switches that change the forward.

Post-LN (the original Transformer's block, TrOCR's and OPT's with
``do_layer_norm_before=False``): ``x = norm(x + attention(x))``, then
``norm(x + mlp(x))``, with no final norm after the stack. The analysis names it by probing
layer 0 (which norm reads which sum); the ``post_ln`` and ``no_final_norm`` edits write it on
the block contract of either reference, composing with the other block, embedding and head
edits in any order.

A boolean config field whose other value changes the logits (XGLM's ``scale_embedding``,
OPT's ``do_layer_norm_before``) is a forward switch: the analysis finds each by flipping it
on the tiny model and the generated ``_check_supported`` refuses the other value by name.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import AutoConfig

from archon_models.model_spec import get_model_spec
from skill.codemod.contract import residual_branch_code
from skill.codemod.cst import Document
from skill.features import SUPPORTED_EDITS, Feature, NormPlacement, feature_values
from skill.porting.edit_args import check_supported_source
from skill.porting.model_edits import NORM_LINE, EditContext, apply_model_edits
from skill.porting.plan import plan_for
from tests.skill.test_analyze_families import report_for

REPO = Path(__file__).resolve().parents[2]
REFERENCES = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}
MODEL_CLASSES = {"qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}

# ------------------------------------------------------------------ the post-LN edits


def _post_ln_plan():
    return plan_for("llama").model_copy(
        update={
            "block": "post_ln",
            "final_norm": False,
            "residual_multiplier_field": "residual_multiplier",
            "norm": "layernorm",
            "positions": "learned",
            "embedding_norm_module": "model.embed_norm",
            "final_softcap": True,
        }
    )


EDITS = ["post_ln", "residual_multiplier", "layer_norm", "no_final_norm", "embedding_norm", "final_softcap"]


@pytest.mark.parametrize("reference", sorted(REFERENCES))
def test_post_ln_composes_with_block_embedding_and_head_edits_in_any_order(reference):
    plan = _post_ln_plan()
    ctx = EditContext(camel="Toy", model_class=MODEL_CLASSES[reference], profile=plan)
    orders = [tuple(EDITS), tuple(reversed(EDITS)), *itertools.islice(itertools.permutations(EDITS), 1, 40, 9)]
    results = {order: apply_model_edits(REFERENCES[reference], ctx, list(order)) for order in orders}
    canonical = results[tuple(EDITS)]
    for order, text in results.items():
        assert text == canonical, order
    # Each sub-layer reads the residual stream itself; the multiplier scales the branch
    # inside the normalised sum (a branch edit sees through the norm).
    assert "self.attention_norm(x)" not in canonical and "self.ffn_norm(x)" not in canonical
    assert "x = self.attention_norm(x + self.attention(x" in canonical
    assert "return self.ffn_norm(x + " in canonical
    (attention,) = residual_branch_code(Document(canonical), "attention")
    assert attention.startswith("self.attention(x") and attention.endswith("* self.residual_multiplier")
    (ffn,) = residual_branch_code(Document(canonical), "ffn")
    assert ffn.endswith("(x) * self.residual_multiplier")
    # No final norm: None (as a pipeline stage without it), never applied or reset.
    assert "self.norm: nn.Module | None = None" in canonical
    assert NORM_LINE not in canonical and "self.norm.reset_parameters()" not in canonical
    assert "Post-LN" in canonical
    # Idempotent: the edits once more change nothing.
    assert apply_model_edits(canonical, ctx, EDITS) == canonical


def test_no_final_norm_keeps_the_embedding_projection_out_on_the_head_stage():
    plan = plan_for("opt").model_copy(update={"block": "post_ln", "final_norm": False})
    ctx = EditContext(camel="Toy", model_class="Qwen2Model", profile=plan)
    text = apply_model_edits(REFERENCES["qwen2"], ctx, ["post_ln", "embedding_projection", "no_final_norm"])
    assert "self.project_out is not None and (self.output is not None or self.score is not None)" in text
    assert "self.norm is not None" not in text


def test_post_ln_and_no_final_norm_are_supported_values():
    assert NormPlacement.POST_LN in SUPPORTED_EDITS[Feature.NORM_PLACEMENT]
    assert "false" in SUPPORTED_EDITS[Feature.FINAL_NORM]


# ------------------------------------------------------------------ the probes


def test_trocr_block_is_post_ln_without_a_final_norm():
    # TrOCRDecoderLayer: hidden = self_attn_layer_norm(residual + self_attn(hidden)), then
    # final_layer_norm(residual + fc2(act(fc1(hidden)))); TrOCRDecoder has no norm after the
    # layers (layernorm_embedding runs on the embeddings, before layer 0).
    report = report_for("trocr")
    norm = report.checklist.norm
    assert norm.placement is NormPlacement.POST_LN
    assert norm.block_norms == {"self_attn_layer_norm": "attention_residual", "final_layer_norm": "ffn_residual"}
    assert norm.final_norm is False
    assert feature_values(report.checklist)[Feature.FINAL_NORM] == "false"
    assert "model.decoder.layernorm_embedding" not in report.checkpoint.top_modules
    # The decoder keeps cross-attention for an encoder a causal LM never has: refused by name.
    assert any("never runs" in line and "encoder_attn" in line for line in report.unsupported)
    assert not any("norm placement" in line for line in report.unsupported)


def test_gpt1_blocks_that_return_lists_are_read_as_post_ln():
    # OpenAI GPT's Block: n = ln_1(x + attn(x)[0]); h = ln_2(n + mlp(n)); its attention and
    # its block return lists, not tuples (a hook reads the first item of either), and the
    # model has no norm after the stack.
    report = report_for("openai-gpt")
    norm = report.checklist.norm
    assert norm.placement is NormPlacement.POST_LN
    assert norm.block_norms == {"ln_1": "attention_residual", "ln_2": "ffn_residual"}
    assert norm.final_norm is False
    assert report.unsupported == []


def test_an_identity_first_norm_is_not_post_ln():
    # ModernBertDecoderLayer: attn_norm is nn.Identity on layer 0, then
    # residual + attn(attn_norm(x)); residual + mlp(mlp_norm(x)): pre-norm, the layer ends on
    # a residual sum, not on a norm.
    # The identity is read in the norm's place: a pre-norm block.
    report = report_for("modernbert-decoder")
    assert report.checklist.norm.placement is NormPlacement.PRE
    assert report.checklist.norm.block_norms == {"mlp_norm": "pre_ffn", "attn_norm": "pre_attention"}
    # Still refused, by name: its first layer has no attention norm, its head is not plain.
    assert not any("norm probe could not read" in line for line in report.unsupported)
    assert any(
        "per-layer difference: attn_norm" in line and "(layer 0: Identity[])" in line for line in report.unsupported
    )
    assert any("between the final norm and the LM head" in line for line in report.unsupported)


def test_pre_norm_families_keep_their_final_norm():
    for family in ("opt", "xglm", "gpt2"):
        assert report_for(family).checklist.norm.final_norm is True, family


# ------------------------------------------------------------------ forward switches


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        # XGLMScaledWordEmbedding: embed_scale = sqrt(d_model) if config.scale_embedding else 1.0.
        ("xglm", {"scale_embedding": True}),
        ("biogpt", {"scale_embedding": True}),
        # OPTDecoderLayer: do_layer_norm_before picks pre- or post-LN; enable_bias the linear
        # biases; layer_norm_elementwise_affine the norms' weights; OPTDecoder keeps a final
        # norm only if do_layer_norm_before and not _remove_final_layer_norm.
        (
            "opt",
            {
                "_remove_final_layer_norm": False,
                "do_layer_norm_before": True,
                "enable_bias": True,
                "layer_norm_elementwise_affine": True,
            },
        ),
        # GPT2Attention: scale_attn_weights divides by sqrt(head_dim); the other by layer_idx + 1.
        ("gpt2", {"scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True}),
        # Qwen2: use_sliding_window does nothing with a window beyond the probe's tokens.
        ("qwen2", {}),
    ],
)
def test_forward_switches_of_real_families(family, expected):
    switches = report_for(family).checklist.forward_switches
    assert switches == expected
    # Never bookkeeping or fields the args map: use_cache, add_cross_attention (its extra
    # modules never run), tie_word_embeddings (enable_weight_tying).
    assert not {"use_cache", "add_cross_attention", "tie_word_embeddings", "return_dict"} & set(switches)


def test_check_supported_pins_switches_the_port_does_not_read():
    plan = plan_for("llama").model_copy(
        update={"pinned_switches": {"scale_embedding": True, "attention_bias": False, "read_flag": True}}
    )
    config = AutoConfig.for_model("llama")
    source = check_supported_source(plan, config, "Toy", read="bool(hf_config.read_flag)")
    assert 'if bool(getattr(hf_config, "scale_embedding", True)) is not True:' in source
    assert "scale_embedding=False is not supported" in source
    assert "read_flag" not in source  # from_hf_config maps it
    # attention_bias has its own check (the bias flags): not a second one.
    assert source.count('"attention_bias"') == 1


@pytest.mark.parametrize(
    ("family", "field"),
    [
        ("opt", "do_layer_norm_before"),
        ("opt", "enable_bias"),
        ("xglm", "scale_embedding"),
        ("biogpt", "scale_embedding"),
        ("gpt2", "scale_attn_weights"),
        ("cohere", "use_qk_norm"),
    ],
)
def test_committed_packages_refuse_a_flipped_switch_by_name(family, field):
    args_class = get_model_spec(family).model_args_class
    config = AutoConfig.for_model(family)
    args_class.from_hf_config(config)  # the ported value loads
    setattr(config, field, not getattr(config, field))
    with pytest.raises(ValueError, match=rf"^{field}=(True|False) is not supported"):
        args_class.from_hf_config(config)
