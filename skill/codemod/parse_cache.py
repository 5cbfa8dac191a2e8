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
first statement changed, the changed part brings its own indentation or trailing
comments, the file has no final newline) the text is parsed whole.

Why reusing statements is exact: at a top-level statement boundary the tokenizer is at
column 0, outside any bracket, so a statement's tokens do not depend on the text around
it. Three things do, and each is checked: the file's indentation unit (taken from the
first indented block, which must lie in the shared start), its newline (likewise), and
where the comment lines between two statements go (to the following statement, so the
re-parsed part may not end with any).

Nodes are immutable, so modules sharing statement nodes is safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import libcst as cst

# Recent parses kept (a port edits model.py, args.py and the adapter in turn; a few
# entries cover the text each edit starts from).
CACHE_SIZE = 8


@dataclass(frozen=True)
class _Parse:
    """One parse: the module and the code of its header and of each top-level statement."""

    text: str
    module: cst.Module
    header: str
    pieces: tuple[str, ...]
    indent_in_first: int  # top-level statements up to and including the first indented block (0: none)


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
    for base in _by_shared_length(bases, text):
        parsed = _reparse(base, text)
        if parsed is not None:
            break
    full = parsed is None
    if parsed is None:
        parsed = _describe(text, cst.parse_module(text))
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


def _describe(text: str, module: cst.Module) -> _Parse:
    pieces = tuple(module.code_for_node(stmt) for stmt in module.body)
    header = "".join(module.code_for_node(line) for line in module.header)
    return _Parse(text, module, header, pieces, _first_indented(module.body))


def _first_indented(body: tuple[cst.BaseStatement, ...] | list[cst.BaseStatement]) -> int:
    """How many statements up to and including the first holding an indented block (0: none does)."""
    for i, stmt in enumerate(body):
        if _has_indented_block(stmt):
            return i + 1
    return 0


def _has_indented_block(stmt: cst.CSTNode) -> bool:
    class _Find(cst.CSTVisitor):
        found = False

        def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
            self.found = True
            return False

    finder = _Find()
    stmt.visit(finder)
    return finder.found


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


def _keeps_layout(base: _Parse, k: int) -> bool:
    """Whether sharing ``base``'s first ``k`` statements fixes the file's newline and
    indentation unit: they hold the first line and the first indented block (or the base
    has no indented block, and the unit is the changed part's)."""
    return k >= max(1, base.indent_in_first)


def _by_shared_length(bases: list[_Parse], text: str) -> list[_Parse]:
    """The bases whose shared start fixes the layout of ``text``, most shared first."""
    scored = []
    for base in bases:
        k, start, _, end = _shared(base, text)
        if _keeps_layout(base, k):
            scored.append((end - start, base))
    scored.sort(key=lambda pair: pair[0])
    return [base for _, base in scored]


def _reparse(base: _Parse, text: str) -> _Parse | None:
    """The parse of ``text`` built from ``base``'s shared statements, or None when it cannot be shown exact."""
    k, start, j, end = _shared(base, text)
    if not _keeps_layout(base, k):
        return None
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
    if (
        part.header
        or part.code != lead + changed  # libcst 1.0 drops an indented comment that ends a file
        or part.default_newline != module.default_newline
        or (base.indent_in_first and part.default_indent != module.default_indent and _first_indented(part.body))
    ):
        return None
    middle = tuple(part.body[1:])
    n = len(base.pieces)
    if j:
        if part.footer or not part.has_trailing_newline or _ends_with_trivia(changed):
            return None  # blank and comment lines at the part's end belong to the next statement
        footer, trailing_newline = module.footer, module.has_trailing_newline
    else:
        footer, trailing_newline = part.footer, part.has_trailing_newline
    if base.indent_in_first:
        indent, indent_in_first = module.default_indent, base.indent_in_first
    else:  # no shared statement holds a block: the first one the part holds sets the unit
        first = _first_indented(part.body)
        indent, indent_in_first = part.default_indent, (k + first - 1 if first else 0)
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
