"""What the CLI prints of a step's result (skill/cli/render.py)."""

from __future__ import annotations

from pydantic import BaseModel

from skill.cli.render import MAX_CELL, render_result


class _Row(BaseModel):
    name: str
    detail: str


class _Result(BaseModel):
    edits: list[str]
    skipped_features: list[str]
    checks: list[_Row]


def test_a_list_item_is_printed_whole_and_a_table_cell_is_capped() -> None:
    """The ctrl agent read its skipped features cut off with '…' and needed --json for the hand
    edit's text: a list of texts prints one whole item per line; a table keeps its cells narrow."""
    feature = "sinusoidal positions of another formula ([sin | cos] rows, frequencies " + "x" * 120
    result = _Result(edits=["a", "b"], skipped_features=[feature, "norms"], checks=[_Row(name="n", detail="y" * 200)])
    lines = render_result(result).splitlines()
    assert lines[0] == "edits: a, b"
    assert lines[1] == "skipped_features:" and lines[2] == f"  - {feature}" and lines[3] == "  - norms"
    cell = lines[-1].split("  ")[-1].strip()
    assert len(cell) == MAX_CELL and cell.endswith("…")
