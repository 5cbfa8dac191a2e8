"""A step's pydantic result as text a person reads: one line per field, a table per list of records.

The generated commands print this by default (``--json`` prints the model itself). Field
names are the result model's own, so what a person reads is what ``--json`` and an MCP
client get: ``changed_files: archon_models/x/model/args.py``, a table for ``checks``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

MAX_CELL = 60
MAX_INLINE = 100


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def _cell(value: Any) -> str:
    text = " ".join(_text(value).split())
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def _table(rows: list[BaseModel], indent: str) -> list[str]:
    columns = list(type(rows[0]).model_fields)
    cells = [[_cell(getattr(row, column)) for column in columns] for row in rows]
    widths = [max(len(column), *(len(r[i]) for r in cells)) for i, column in enumerate(columns)]

    def line(values: list[str]) -> str:
        return indent + "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return [line(columns), indent + "  ".join("-" * w for w in widths), *(line(r) for r in cells)]


def _field(name: str, value: Any, indent: str) -> list[str]:
    inner = indent + "  "
    if isinstance(value, BaseModel):
        return [f"{indent}{name}:", *_model(value, inner)]
    if isinstance(value, str) and "\n" in value.strip():
        return [f"{indent}{name}:", *(inner + line for line in value.strip("\n").splitlines())]
    if _scalar(value):
        return [f"{indent}{name}: {_text(value)}"]
    if not value:
        return [f"{indent}{name}: (none)"]
    if isinstance(value, dict):
        width = max(len(str(key)) for key in value)
        return [f"{indent}{name}:", *(f"{inner}{str(key).ljust(width)}  {_cell(item)}" for key, item in value.items())]
    items = list(value)
    if all(isinstance(item, BaseModel) for item in items) and len({type(item) for item in items}) == 1:
        return [f"{indent}{name}:", *_table(items, inner)]
    # A list item is a line of its own when they do not fit on one: never cut (a skipped
    # feature's name is the hand edit to make).
    texts = [" ".join(_text(item).split()) for item in items]
    joined = ", ".join(texts)
    if len(joined) <= MAX_INLINE:
        return [f"{indent}{name}: {joined}"]
    return [f"{indent}{name}:", *(f"{inner}- {text}" for text in texts)]


def _model(model: BaseModel, indent: str) -> list[str]:
    lines: list[str] = []
    for name in type(model).model_fields:
        lines += _field(name, getattr(model, name), indent)
    return lines


def render_result(result: BaseModel) -> str:
    """Every field of ``result``, in the model's order."""
    return "\n".join(_model(result, ""))
