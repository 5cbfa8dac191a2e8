"""Sinusoidal positions of the Transformer paper's rates (CTRL), beside fairseq's.

The ``sinusoidal_positions`` edit writes the table tensor2tensor and fairseq build: row ``p``
is ``[sin(p f) | cos(p f)]`` with ``f_k = 10000 ** (-k / (d/2 - 1))``. CTRL's
``positional_encoding`` uses the paper's ``f_k = 10000 ** (-2k / d)``. The analysis tells the
two apart by which table layer 0's input reads (``skill.analysis.detect._sinusoidal_table``)
and keys the second ``sinusoidal_formula`` with the row offset it measured; this module
replaces the table function the edit inserted by :func:`sinusoidal_positions` below, which
computes in fp32 with HF's operations, so the rows are HF's to the bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from skill.codemod.cst import replace_function, top_level_names
from skill.feature_modules.base import FeatureModule
from skill.snippets import snippet_in

if TYPE_CHECKING:
    from skill.codemod.document import Document
    from skill.features import NamedFact
    from skill.porting.model_edits import EditContext

FORMULA = "vaswani"
TABLE_FUNCTION = "sinusoidal_positions"


def sinusoidal_positions(n_positions: int, dim: int, zero_row: int | None = None) -> torch.Tensor:
    """``[n_positions, dim]`` sinusoidal table of the Transformer paper, as CTRL builds it in
    fp32: feature ``i`` of row ``p`` has the angle ``p / 10000 ** (2 * (i // 2) / dim)``; the
    sines of the even features, then the cosines of the odd ones. Row ``zero_row``, when
    given, is all zeros."""
    rows = torch.arange(n_positions, dtype=torch.int64).float().unsqueeze(1)
    features = torch.arange(dim, dtype=torch.int64).float().unsqueeze(0)
    angles = rows * (1 / torch.pow(10000, (2 * (features // 2)) / dim))
    table = torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=-1)
    if zero_row is not None and 0 <= zero_row < n_positions:
        table[zero_row] = 0
    return table


class VaswaniPositions(FeatureModule):
    name = "vaswani_positions"
    title = "sinusoidal positions of the Transformer paper's rates"
    description = "the sinusoidal table with rates 10000^(-2k/d) (the Transformer paper's, CTRL's)"
    claims = "sinusoidal_formula"

    def read(self, fact: NamedFact) -> dict[str, Any] | None:
        if fact.data.get("formula") != FORMULA:
            return None
        return {"offset": int(fact.data["offset"])}

    def edit_model(self, text: Document, value: dict[str, Any], ctx: EditContext) -> Document:
        if TABLE_FUNCTION not in top_level_names(text):
            raise ValueError(f"{self.name}: model.py has no {TABLE_FUNCTION} (the sinusoidal_positions edit writes it)")
        return replace_function(text, None, TABLE_FUNCTION, snippet_in(Path(__file__), TABLE_FUNCTION))

    def describe(self, value: dict[str, Any]) -> str:
        return "the Transformer paper's position rates 10000^(-2k/d)"
