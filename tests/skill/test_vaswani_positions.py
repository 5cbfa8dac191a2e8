"""The vaswani_positions feature module (skill/feature_modules/vaswani_positions.py): the table it
writes is HF's CTRL table to the bit, and the analysis' float64 measuring stick agrees. End to end
it is proven by ctrl's stage tests (tests/archon/test_ctrl.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.ctrl.modeling_ctrl import positional_encoding

from skill.analysis.detect import _vaswani_positions
from skill.codemod.cst import CodemodError
from skill.codemod.document import Document
from skill.feature_modules.vaswani_positions import VaswaniPositions, sinusoidal_positions
from skill.features import NamedFact
from skill.porting.model_edits import EditContext
from skill.porting.plan import plan_for

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dim", [16, 17, 64])
def test_the_table_is_hf_ctrl_s_to_the_bit(dim: int) -> None:
    ours = sinusoidal_positions(40, dim)
    assert torch.equal(ours, positional_encoding(40, dim, torch.float))
    if dim % 2 == 0:
        assert torch.allclose(ours.double(), _vaswani_positions(40, dim).double(), atol=1e-5, rtol=0)


def test_a_zero_row_is_zero() -> None:
    table = sinusoidal_positions(8, 16, zero_row=1)
    assert not table[1].any() and table[2].any()


def test_it_ports_only_the_paper_s_formula() -> None:
    module = VaswaniPositions()
    assert module.read(NamedFact(key="sinusoidal_formula", data={"formula": "vaswani", "offset": 2})) == {"offset": 2}
    assert module.read(NamedFact(key="sinusoidal_formula", data={"formula": "other"})) is None


def test_without_the_table_the_edit_says_which_edit_writes_it() -> None:
    text = Document((REPO / "archon_models/qwen2/model/model.py").read_text())
    ctx = EditContext(camel="Toy", model_class="Qwen2Model", profile=plan_for("ctrl"))
    with pytest.raises((ValueError, CodemodError), match="sinusoidal_positions edit writes it"):
        VaswaniPositions().edit_model(text, {"offset": 0}, ctx)
