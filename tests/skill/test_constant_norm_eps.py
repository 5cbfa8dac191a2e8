"""The constant_norm_eps feature module (skill/feature_modules/constant_norm_eps.py).

End to end it is proven by ctrl's stage tests (LayerNorm blocks on the qwen2 reference, the
field moved to 0.01 in the test case) and by the composition family ``epsmoe`` (RMSNorm sandwich
blocks beside full-width QK norms and MoE on the qwen3 reference, constant 1e-5, field 1e-6:
tests/skill/test_composition_families.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from skill.analysis.reference import deltas_from, unsupported_names
from skill.codemod.document import Document
from skill.feature_modules.constant_norm_eps import ConstantNormEps
from skill.porting.model_edits import EditContext
from skill.porting.plan import plan_for
from tests.skill.test_analyze_families import report_for

REPO = Path(__file__).resolve().parents[2]
VALUE = {"eps": 1e-06, "field": "layer_norm_epsilon", "norms": ["attention_norm", "ffn_norm"]}


@pytest.mark.parametrize("reference", ["qwen2", "qwen3"])
def test_the_edit_writes_the_constant_into_the_block_norms_only_once(reference: str) -> None:
    text = Document((REPO / f"archon_models/{reference}/model/model.py").read_text())
    ctx = EditContext(camel="Toy", model_class=f"{reference.capitalize()}Model", profile=plan_for("ctrl"))
    module = ConstantNormEps()
    edited = module.edit_model(text, VALUE, ctx)
    code = edited.code
    assert "BLOCK_NORM_EPS = 1e-06  # a constant of the modeling code, not layer_norm_epsilon" in code
    assert "self.attention_norm = RMSNorm(model_args.dim, eps=BLOCK_NORM_EPS)" in code
    assert "self.ffn_norm = RMSNorm(model_args.dim, eps=BLOCK_NORM_EPS)" in code
    # The final norm keeps the field's value.
    assert "RMSNorm(model_args.dim, eps=model_args.norm_eps)" in code
    assert module.edit_model(edited, VALUE, ctx).code == code


def test_on_a_reference_the_edit_does_not_target_the_feature_is_refused_by_name() -> None:
    checklist = report_for("ctrl").checklist
    assert checklist.feature_modules["constant_norm_eps"] == VALUE
    delta = next(d for d in deltas_from("deepseek_v3", checklist) if d.feature == "constant_norm_eps")
    assert not delta.supported
    names = unsupported_names(checklist, [delta], "ctrl")
    assert names == ["unsupported: block norms with a constant epsilon = block norms with a constant epsilon of 1e-06"]


def test_the_stage_tests_move_the_field_away_from_the_constant() -> None:
    overrides, why = ConstantNormEps().test_overrides(VALUE)
    assert overrides == {"layer_norm_epsilon": 0.01} and why is not None
    assert ConstantNormEps().test_overrides({**VALUE, "eps": 0.01})[0] == {"layer_norm_epsilon": 0.1}
