"""What a caller may name in a test case: its model_type and the config overrides on its tiny config.

Both end up in a generated test file (as Python literals) and on the config both models are
built from, so both are checked before anything is written:

- a model_type is a name (letters, digits, ``_``, ``-``, ``.``; no path separator), never a
  path: the stage files are about registered families, not about folders on disk;
- an override key is a config attribute (a Python identifier), and not one that decides which
  code builds the model (``auto_map``, ``trust_remote_code``);
- an override value is plain data: ``None``, a boolean, a finite number (no NaN or
  infinity, which have no literal), a string of printable characters (no newline, no
  ``\\x1c``: a line break inside a literal would break the file's layout), and lists or
  dicts of those, at most :data:`MAX_DEPTH` deep;
- a size stays tiny: a number set on a field whose name says it is a vocabulary, a width,
  a count or a context length is at most :data:`MAX_VOCAB`, :data:`MAX_WIDTH`,
  :data:`MAX_COUNT` or :data:`MAX_CONTEXT`. The tiny configs use a 256-token vocabulary,
  widths of 16-128 and 2-8 layers, heads or experts; the bounds leave room to prove a
  feature (more heads, a wider expert) without the model outgrowing a test: a
  ``vocab_size=5000000`` reached 8.8 GB. A context length (positions, a window, a RoPE
  scaling's original length) allocates at most a position table or a RoPE cache, so its
  bound is the 1M tokens the largest published RoPE scalings name.

Every refusal is one :class:`ValueError` line naming the key and the rule.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, JsonValue

# The bounds on size fields (see the module docstring).
MAX_VOCAB = 65536
MAX_WIDTH = 1024
MAX_COUNT = 64
MAX_CONTEXT = 1 << 20
MAX_DEPTH = 4
MAX_ITEMS = 256
MAX_STRING = 256
MAX_MODEL_TYPE = 100

# Config attributes that choose the code that builds a model rather than its shape.
CODE_CHOOSING_KEYS = frozenset({"auto_map", "trust_remote_code"})

_MODEL_TYPE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# Checked first: vocab_size ends in _size, max_window_layers in _layers.
_VOCAB_RE = re.compile(r"vocab")
_CONTEXT_RE = re.compile(r"position|(^|_)n_ctx$|window|(^|_)(max_)?seq(uence)?_len(gth)?$|_length$")
# Widths: hidden and intermediate sizes, head widths, ranks (before counts: n_embd is a width).
_WIDTH_RE = re.compile(r"(_size|_dim|_rank|_width|_channels)$|^(n_embd|n_inner|d_model|d_ff|ffn_dim|hidden_dim)$")
# Counts: layers, heads, experts, groups.
_COUNT_RE = re.compile(r"^(num|n)_|_(layers|heads|experts|groups|blocks)$")


def validate_model_type(value: str) -> str:
    """``value`` if it can be a HF model_type name; a ``ValueError`` naming the rule otherwise."""
    if not isinstance(value, str) or not _MODEL_TYPE_RE.fullmatch(value) or len(value) > MAX_MODEL_TYPE:
        raise ValueError(
            f"model_type {value!r} is not a model_type name: letters, digits, '_', '-' or '.', starting with a "
            f"letter or digit, at most {MAX_MODEL_TYPE} characters (a path is not a model_type)"
        )
    return value


def size_bound(key: str) -> tuple[str, int] | None:
    """The kind of size ``key`` names (``"vocabulary"``, ``"context length"``, ``"width"``,
    ``"count"``) and its bound, or None."""
    name = key.lower()
    if _VOCAB_RE.search(name):
        return "vocabulary", MAX_VOCAB
    if _CONTEXT_RE.search(name):
        return "context length", MAX_CONTEXT
    if _WIDTH_RE.search(name):
        return "width", MAX_WIDTH
    if _COUNT_RE.search(name):
        return "count", MAX_COUNT
    return None


def _check_string(where: str, value: str) -> None:
    if len(value) > MAX_STRING:
        raise ValueError(f"config override {where}: a string of {len(value)} characters; at most {MAX_STRING}")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(
            f"config override {where}: the string holds the control character {bad!r}; "
            "only printable characters can be written into the test file"
        )


def _check_value(where: str, key: str, value: Any, depth: int) -> None:
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config override {where}={value!r}: not a finite number; NaN and infinity are refused")
        bound = size_bound(key)
        if bound is not None and value > bound[1]:
            kind, limit = bound
            raise ValueError(
                f"config override {where}={value!r}: above the bound of {limit} on a {kind} "
                "(a test model stays tiny; see skill/porting/overrides.py)"
            )
        return
    if isinstance(value, str):
        _check_string(where, value)
        return
    if depth >= MAX_DEPTH:
        raise ValueError(f"config override {where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        if len(value) > MAX_ITEMS:
            raise ValueError(f"config override {where}: a list of {len(value)} items; at most {MAX_ITEMS}")
        for index, item in enumerate(value):
            _check_value(f"{where}[{index}]", key, item, depth + 1)
        return
    if isinstance(value, Mapping):
        if len(value) > MAX_ITEMS:
            raise ValueError(f"config override {where}: a dict of {len(value)} entries; at most {MAX_ITEMS}")
        for inner_key, item in value.items():
            if not isinstance(inner_key, str):
                raise ValueError(f"config override {where}: key {inner_key!r} is not a string")
            _check_string(f"{where} key {inner_key!r}", inner_key)
            _check_value(f"{where}.{inner_key}", inner_key, item, depth + 1)
        return
    raise ValueError(f"config override {where}: {type(value).__name__} is not plain JSON data")


def check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` if every key and value may go into a test file (see the module docstring)."""
    if len(overrides) > MAX_ITEMS:
        raise ValueError(f"{len(overrides)} config overrides; at most {MAX_ITEMS}")
    for key, value in overrides.items():
        if not isinstance(key, str) or not key.isidentifier() or not key.isascii():
            raise ValueError(f"config override key {key!r} is not a config attribute name (a Python identifier)")
        if key in CODE_CHOOSING_KEYS:
            raise ValueError(
                f"config override {key}: chooses the code that builds the model, not its shape; refused "
                "(port a remote-code family with its source folder and trust_remote_code instead)"
            )
        _check_value(key, key, value, 0)
    return overrides


# The request field type: JSON data, then the checks above.
ConfigOverrides = Annotated[dict[str, JsonValue], AfterValidator(check_overrides)]
ModelTypeName = Annotated[str, AfterValidator(validate_model_type)]
