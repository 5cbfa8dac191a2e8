"""Edits on the Archon module contract compose: on either reference, in any order."""

from __future__ import annotations

from pathlib import Path

import pytest

from skill.codemod.contract import residual_branch_code, wrap_residual_branch
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import plan_for

REPO = Path(__file__).resolve().parents[2]
REFERENCES = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}

WRAPS = {
    "post_norm": ("self.post_attention_norm({})", "post_attention_norm"),
    "multiplier": ("{} * self.residual_multiplier", "residual_multiplier"),
}


@pytest.mark.parametrize("reference", sorted(REFERENCES))
def test_residual_branch_wraps_compose_on_both_references(reference):
    text = REFERENCES[reference]
    (branch,) = residual_branch_code(text, "attention")
    wrapped = wrap_residual_branch(text, "attention", *WRAPS["post_norm"][:1], applied_if=WRAPS["post_norm"][1])
    wrapped = wrap_residual_branch(wrapped, "attention", WRAPS["multiplier"][0], applied_if=WRAPS["multiplier"][1])
    assert residual_branch_code(wrapped, "attention") == [
        f"self.post_attention_norm({branch}) * self.residual_multiplier"
    ]
    # Idempotent: applying both again changes nothing.
    again = wrap_residual_branch(wrapped, "attention", WRAPS["post_norm"][0], applied_if=WRAPS["post_norm"][1])
    again = wrap_residual_branch(again, "attention", WRAPS["multiplier"][0], applied_if=WRAPS["multiplier"][1])
    assert again == wrapped
    # The feed-forward branch is untouched by attention-branch edits.
    assert residual_branch_code(wrapped, "ffn") == residual_branch_code(text, "ffn")


def _ctx(plan, model_class: str) -> EditContext:
    return EditContext(camel="Toy", model_class=model_class, profile=plan)


@pytest.mark.parametrize("reference,model_class", [("qwen2", "Qwen2Model"), ("qwen3", "Qwen3Model")])
def test_sandwich_norms_residual_multiplier_and_logit_transforms_compose(reference, model_class):
    """Every order of the four edits that touch the same two places gives one result
    (an edit list applied as named once put the multiplier inside the post-norm)."""
    plan = plan_for("llama").model_copy(
        update={
            "block": "sandwich",
            "residual_multiplier_field": "residual_multiplier",
            "logit_divisor_field": "logits_scaling",
            "final_softcap": True,
        }
    )
    names = ["sandwich_norm", "residual_multiplier", "logits_scaling", "final_softcap"]
    # The canonical order, its reverse, and orders that put each outer edit first.
    orders = [
        tuple(names),
        tuple(reversed(names)),
        ("residual_multiplier", "sandwich_norm", "final_softcap", "logits_scaling"),
        ("final_softcap", "residual_multiplier", "logits_scaling", "sandwich_norm"),
    ]
    results = {
        order: apply_model_edits(REFERENCES[reference], _ctx(plan, model_class), list(order)) for order in orders
    }
    canonical = results[tuple(names)]
    (attention,) = residual_branch_code(canonical, "attention")
    assert attention.startswith("self.post_attention_norm(self.attention(") and attention.endswith(
        "* self.residual_multiplier"
    )
    (ffn,) = residual_branch_code(canonical, "ffn")
    assert ffn.startswith("self.post_ffn_norm(") and ffn.endswith("* self.residual_multiplier")
    assert "logits = logits / self.model_args.logits_scaling" in canonical
    assert "logits = torch.tanh(logits / cap) * cap" in canonical
    # Named in any order, the edits nest the same way (norm inside the multiplier,
    # divisor before the soft-cap): one module.
    for order, text in results.items():
        assert text == canonical, order
