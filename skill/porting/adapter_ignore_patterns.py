"""Adapter edit: checkpoint keys transformers' load drops by the family's ignore patterns.

A family's ``_keys_to_ignore_on_load_unexpected`` (the analysis's
``checkpoint.load_ignore_patterns``) names keys that released checkpoints hold and today's
model has no parameter for: GPT-NeoX's and GPT-2's causal-mask buffers (``attention.bias``,
``attention.masked_bias``, ``attn.bias``), saved while those buffers were persistent, or
modules the model does not build (ERNIE-4.5's ``mtp`` blocks). ``from_pretrained`` drops them
without a word. A copied adapter raises ``KeyError`` on any key its maps lack, so a Pythia
checkpoint would not load through ``from_hf``; this edit teaches ``_archon_key`` to drop a key
that no map entry covers and one of the family's patterns finds, as transformers does. A key a
map covers is converted whatever the patterns say (GPT-2's pattern ``attn.bias`` also finds
``attn.c_attn.bias``, the fused projection's bias), and ``from_hf``'s completeness check still
names any parameter the checkpoint lacks.

Any reference's adapter takes it: each refuses a key its map lacks in ``_archon_key``, with the
same check.
"""

from __future__ import annotations

from skill.codemod.cst import (
    CodemodError,
    Document,
    ensure_import_line,
    insert_class_statement_after,
    replace_in_function,
)
from skill.porting.common import PackageLayout

PATTERNS = "ignored_hf_key_patterns"

# The references' check for a key no map entry covers, and the same check dropping a key one of
# the family's patterns finds before it raises.
_UNKNOWN_KEY = """
if template not in self.from_hf_map:
    raise KeyError(
        f"HF checkpoint key {hf_key!r} (pattern {template!r}) is not in "
        f"{type(self).__name__}.from_hf_map; map it to an Archon key, or to None to drop it."
    )
"""
_UNKNOWN_KEY_IGNORED = """
if template not in self.from_hf_map:
    if any(re.search(pattern, hf_key) for pattern in self.ignored_hf_key_patterns):
        return None  # transformers' load drops it too (the family's _keys_to_ignore_on_load_unexpected)
    raise KeyError(
        f"HF checkpoint key {hf_key!r} (pattern {template!r}) is not in "
        f"{type(self).__name__}.from_hf_map; map it to an Archon key, or to None to drop it."
    )
"""


def _literal(pattern: str) -> str:
    """``pattern`` as Python source; a raw string where it escapes anything, as regular expressions read best."""
    if '"' in pattern or not pattern.isprintable() or pattern.endswith("\\"):
        return repr(pattern)
    return ("r" if "\\" in pattern else "") + f'"{pattern}"'


def apply_ignore_patterns_adapter(text: Document, layout: PackageLayout, patterns: list[str]) -> Document:
    """``patterns`` (regular expressions, as transformers matches them with ``re.search``) become
    the adapter's ``ignored_hf_key_patterns``, and ``_archon_key`` returns ``None`` (drop) for a key
    outside ``from_hf_map`` that one of them finds. No patterns: the adapter is left as it is."""
    if not patterns:
        return text
    cls = layout.adapter_class
    literal = (
        "# transformers' load drops a checkpoint key that one of these finds and the model has no\n"
        "# parameter for (the family's _keys_to_ignore_on_load_unexpected): legacy buffers, unbuilt modules.\n"
        f"{PATTERNS}: ClassVar[tuple[str, ...]] = (\n" + "".join(f"    {_literal(p)},\n" for p in patterns) + ")\n"
    )
    text = insert_class_statement_after(text, cls, "from_hf_map", literal)
    try:
        text = replace_in_function(text, cls, "_archon_key", _UNKNOWN_KEY.strip(), _UNKNOWN_KEY_IGNORED.strip() + "\n")
    except CodemodError as e:
        raise CodemodError(f"the ignore patterns {patterns} need the reference adapter's _archon_key: {e}") from e
    return ensure_import_line(text, "import re")
