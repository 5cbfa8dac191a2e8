"""Parse a module whose text differs from a recent parse by re-parsing only what changed.

A port applies hundreds of edits to a few files, each a function from source text to
source text that parses its input (libcst's parser is about 80 ms for a 550-line
``model.py``) and prints its output. The next edit then parses that output again, though
it differs from the text parsed just before in one class or one import line. Parsing was
half of an edit's time.

:func:`parse_module` keeps the last few parses. For a new text it finds the recent parse
sharing the longest run of whole top-level statements at the start and at the end, parses
only the statements in between, and builds the module from the three parts. The result
is the tree ``libcst.parse_module`` returns for the text, node for node (``deep_equals``),
not merely one that prints the same: an edit that matches nodes sees what it would see
after a full parse. Wherever that cannot be shown from the two texts (the header or the
first statement changed, the changed part brings its own indentation unit, a comment line
could change owner) the text is parsed whole.

Why reusing statements is exact: at a top-level statement boundary the tokenizer is at
column 0, outside any bracket, so a statement's tokens do not depend on the text around
it. Three things do, and each is checked: the file's indentation unit (taken from the
first indented block, which must be a shared statement, or the part's own first block
when the base has none), its newline (from the first line, which must be shared), and
where the blank and comment lines between two statements go (to the following
statement, or to the indented block above when indented: the part may neither start with
an indented one nor end with any).

Nodes are immutable, so modules sharing statement nodes is safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import libcst as cst

# Recent parses kept (a port edits model.py, args.py and the adapter in turn; a few
# entries cover the text each edit starts from).
CACHE_SIZE = 8


class _Parse:
    """One parse: its text and module and, computed when first needed (a parse of an
    unrelated file never needs them), the code of its header and statements."""

    def __init__(
        self,
        text: str,
        module: cst.Module,
        header: str | None = None,
        pieces: tuple[str, ...] | None = None,
        indent_in_first: int | None = None,
    ):
        self.text, self.module = text, module
        self._header, self._pieces, self._indent_in_first = header, pieces, indent_in_first

    @property
    def header(self) -> str:
        if self._header is None:
            self._header = "".join(self.module.code_for_node(line) for line in self.module.header)
        return self._header

    @property
    def pieces(self) -> tuple[str, ...]:
        if self._pieces is None:
            self._pieces = tuple(self.module.code_for_node(stmt) for stmt in self.module.body)
        return self._pieces

    @property
    def indent_in_first(self) -> int:
        """Top-level statements up to and including the first holding an indented block (0: none)."""
        if self._indent_in_first is None:
            self._indent_in_first = _first_indented(self.module.body)
        return self._indent_in_first


class ParseStats(NamedTuple):
    """How the parses since the last :func:`clear` were made."""

    hits: int = 0  # the same text as a kept parse
    partial: int = 0  # only the changed statements parsed
    full: int = 0


_cache: OrderedDict[str, _Parse] = OrderedDict()
_lock = threading.Lock()
_stats = ParseStats()


def parse_module(text: str) -> cst.Module:
    """``libcst.parse_module(text)``, re-parsing only the statements that differ from a recent parse."""
    global _stats
    with _lock:
        hit = _cache.get(text)
        if hit is not None:
            _cache.move_to_end(text)
            _stats = _stats._replace(hits=_stats.hits + 1)
            return hit.module
        bases = list(reversed(_cache.values()))
    parsed = None
    for base, shared in _by_shared_length(bases, text):
        parsed = _reparse(base, text, shared)
        if parsed is not None:
            break
    full = parsed is None
    if parsed is None:
        parsed = _Parse(text, cst.parse_module(text))
    with _lock:
        _stats = _stats._replace(full=_stats.full + 1) if full else _stats._replace(partial=_stats.partial + 1)
        _cache[text] = parsed
        _cache.move_to_end(text)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return parsed.module


def clear() -> None:
    """Forget every kept parse and reset the counts."""
    global _stats
    with _lock:
        _cache.clear()
        _stats = ParseStats()


def stats() -> ParseStats:
    """How the parses since the last :func:`clear` were made."""
    return _stats


def _first_indented(body: Sequence[cst.CSTNode]) -> int:
    """How many statements up to and including the first holding an indented block (0: none does)."""
    for i, stmt in enumerate(body):
        if _has_indented_block(stmt):
            return i + 1
    return 0


def _has_indented_block(stmt: cst.CSTNode) -> bool:
    if isinstance(stmt, cst.SimpleStatementLine):
        return False  # no block can be written inside one line of simple statements
    if isinstance(getattr(stmt, "body", None), cst.IndentedBlock):
        return True  # a class, def, if, for, ... written the usual way

    class _Find(cst.CSTVisitor):  # one written ``if x: y`` may hold a block in its else
        found = False

        def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
            self.found = True
            return False

    finder = _Find()
    stmt.visit(finder)
    return finder.found


def _mostly_shared(base: str, text: str) -> bool:
    """Whether ``text`` shares at least half its length with ``base`` at its two ends (a
    cheap test that keeps the statement pieces of an unrelated file from being computed)."""
    limit = min(len(base), len(text))
    lo, hi = 0, limit  # the longest common prefix, by halving
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if base[:mid] == text[:mid]:
            lo = mid
        else:
            hi = mid - 1
    prefix = lo
    lo, hi = 0, limit - prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if base[len(base) - mid :] == text[len(text) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return 2 * (prefix + lo) >= len(text)


def _shared(base: _Parse, text: str) -> tuple[int, int, int, int]:
    """(k, start, j, end): ``text`` starts with the header and base's first ``k`` statements
    (ending at ``start``) and ends with its last ``j`` statements and footer (from ``end``)."""
    if not text.startswith(base.header):
        return 0, 0, 0, len(text)
    start, k = len(base.header), 0
    for piece in base.pieces:
        if not text.startswith(piece, start):
            break
        start += len(piece)
        k += 1
    end, j = len(text), 0
    if base.module.has_trailing_newline and not base.module.footer:
        for piece in reversed(base.pieces[k:]):
            if end - len(piece) < start or not text.endswith(piece, 0, end):
                break
            end -= len(piece)
            j += 1
    return k, start, j, end


def _may_keep_layout(base: _Parse, k: int, j: int) -> bool:
    """Whether the shared statements can fix the file's newline and indentation unit: the
    first ``k`` hold the first line, and the first indented block (which sets the unit) is
    among the shared ones at either end, or the base has none."""
    first = base.indent_in_first
    return k >= 1 and (not first or first <= k or first > len(base.pieces) - j)


def _layout(base: _Parse, k: int, j: int, part: cst.Module) -> tuple[str, int] | None:
    """The rebuilt module's indentation unit and ``indent_in_first``, or None when the
    re-parsed part could change the unit (it holds a block, in another unit, or the first)."""
    first, n = base.indent_in_first, len(base.pieces)
    part_first = _first_indented(part.body)  # counts the leading ``pass``
    middle = len(part.body) - 1
    if first and first <= k:  # the unit comes from the shared start
        if part_first and part.default_indent != base.module.default_indent:
            return None
        return base.module.default_indent, first
    if first:  # from the shared end, unless the part now holds an earlier block
        return None if part_first else (base.module.default_indent, k + middle + first - (n - j))
    # the base holds no block: the part's first block, if any, sets the unit
    return part.default_indent, (k + part_first - 1 if part_first else 0)


def _by_shared_length(bases: list[_Parse], text: str) -> list[tuple[_Parse, tuple[int, int, int, int]]]:
    """The bases whose shared statements fix the layout of ``text``, each with what
    :func:`_shared` found, most shared first."""
    scored = []
    for base in bases:
        if not _mostly_shared(base.text, text):
            continue
        shared = _shared(base, text)
        k, start, j, end = shared
        if _may_keep_layout(base, k, j):
            scored.append((end - start, base, shared))
    scored.sort(key=lambda entry: entry[0])
    return [(base, shared) for _, base, shared in scored]


def _reparse(base: _Parse, text: str, shared: tuple[int, int, int, int]) -> _Parse | None:
    """The parse of ``text`` built from ``base``'s shared statements (``shared``, from
    :func:`_shared`, with a layout :func:`_may_keep_layout` accepts), or None when it
    cannot be shown exact."""
    k, start, j, end = shared
    module = base.module
    changed = text[start:end]
    if not changed.strip() and not j:
        return None  # the shared start now ends the file: its trailing lines may change owner
    if _leads_with_indented_line(changed):
        return None  # an indented comment after the shared start belongs to its last block
    lead = "pass" + module.default_newline  # keeps the part's leading comments on its first statement
    try:
        part = cst.parse_module(lead + changed)
    except cst.ParserSyntaxError:
        return None  # the full parse reports the error with the whole file's line numbers
    layout = _layout(base, k, j, part)
    if (
        layout is None
        or part.header
        or part.code != lead + changed  # libcst 1.0 drops an indented comment that ends a file
        or part.default_newline != module.default_newline
    ):
        return None
    middle = tuple(part.body[1:])
    n = len(base.pieces)
    if j:
        if part.footer or not part.has_trailing_newline or _ends_with_trivia(changed):
            return None  # blank and comment lines at the part's end belong to the next statement
        if _leads_with_indented_line(base.pieces[n - j]):
            return None  # its indented comment lines go to a block above, if one now ends there
        footer, trailing_newline = module.footer, module.has_trailing_newline
    else:
        footer, trailing_newline = part.footer, part.has_trailing_newline
    indent, indent_in_first = layout
    body = (*module.body[:k], *middle, *module.body[n - j :])
    rebuilt = module.with_changes(
        body=body, footer=footer, has_trailing_newline=trailing_newline, default_indent=indent
    )
    pieces = (*base.pieces[:k], *(rebuilt.code_for_node(stmt) for stmt in middle), *base.pieces[n - j :])
    return _Parse(text, rebuilt, base.header, pieces, indent_in_first)


def _leads_with_indented_line(changed: str) -> bool:
    """Whether a blank or comment line before the part's first statement starts with
    whitespace: libcst gives such lines to the indented block they follow."""
    for line in changed.splitlines(keepends=True):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return False  # the first statement: the lines above it were all at column 0
        if line[:1] in (" ", "\t", "\f"):
            return True
    return False


def _ends_with_trivia(changed: str) -> bool:
    """Whether the part's last line is blank or a comment (the statement after it, or the
    block before it, would own that line in a parse of the whole file)."""
    lines = changed.splitlines()
    if not lines:
        return False
    last = lines[-1].strip()
    return not last or last.startswith("#")
