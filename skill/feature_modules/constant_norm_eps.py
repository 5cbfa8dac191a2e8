"""Block norms whose epsilon is a constant of the modeling code, not the config's field.

CTRL builds each layer's two ``LayerNorm(d_model, eps=1e-6)`` with a literal while its final
norm reads ``layer_norm_epsilon``: the two agree only while nobody sets the field. The analysis
measures it by moving the field in a tiny model (``skill.analysis.detect.constant_eps_norms``)
and keys what stayed (``constant_norm_eps``: the field, and each constant norm by the role the
block-norm probe found for it). The port writes the constant once, as a module-level name the
block norms read, and keeps ``norm_eps`` (from the field) for every other norm. The stage
tests set the field far from the constant, so a norm reading the wrong one fails parity.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from skill.codemod.cst import class_code, insert_before_class, set_call_kwarg
from skill.feature_modules.base import FeatureModule
from skill.features import BLOCK_NORM_NAMES

if TYPE_CHECKING:
    from skill.codemod.document import Document
    from skill.features import NamedFact
    from skill.porting.model_edits import EditContext

CONSTANT = "BLOCK_NORM_EPS"
# The stage tests' value of the field: far from any constant a modeling file writes.
TEST_FIELD_VALUE = 0.01


class ConstantNormEps(FeatureModule):
    name = "constant_norm_eps"
    title = "block norms with a constant epsilon"
    description = "the block norms built with the modeling code's constant epsilon, not norm_eps"
    claims = "constant_norm_eps"

    def read(self, fact: NamedFact) -> dict[str, Any] | None:
        """Ported: block norms of a probed role only (a final norm's constant would need the field
        dropped, which the analysis does when every norm ignores it), all of one constant."""
        constants: dict[str, float] = fact.data["constants"]
        roles: dict[str, str] = fact.data["roles"]
        values = set(constants.values())
        if set(roles) != set(constants) or len(values) != 1 or not set(roles.values()) <= set(BLOCK_NORM_NAMES):
            return None
        norms = sorted({BLOCK_NORM_NAMES[role] for role in roles.values()})
        return {"eps": values.pop(), "field": fact.data["field"], "norms": norms}

    def edit_model(self, text: Document, value: dict[str, Any], ctx: EditContext) -> Document:
        block = class_code(text, "TransformerBlock")
        if f"eps={CONSTANT}" in block:
            return text
        for norm in value["norms"]:
            built = re.search(rf"self\.{norm}(?:: [^=]+)? = (?P<cls>[\w.]+)\(", block)
            if built is None:
                raise ValueError(f"{self.name}: TransformerBlock.__init__ builds no self.{norm}")
            text = set_call_kwarg(text, built["cls"], "eps", CONSTANT, target=f"self.{norm}")
        return insert_before_class(
            text,
            "TransformerBlock",
            f"{CONSTANT} = {value['eps']!r}  # a constant of the modeling code, not {value['field']} (norm_eps)\n",
        )

    def describe(self, value: dict[str, Any]) -> str:
        return f"block norms with a constant epsilon of {value['eps']:g}"

    def test_overrides(self, value: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        moved = TEST_FIELD_VALUE if not math.isclose(value["eps"], TEST_FIELD_VALUE) else 10 * TEST_FIELD_VALUE
        return (
            {value["field"]: moved},
            f"# {value['field']} far from the block norms' constant epsilon, so a norm reading the wrong one shows.",
        )
