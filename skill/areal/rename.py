"""Rewrite a package's prefix (``archon_models`` -> ``areal.experimental.models.archon``).

``from <module> import ...`` statements import from the new prefix, and every string
(docstrings and messages included, f-string text too) and comment that names the old one
names the new one: ``archon_models/qwen3`` as a path becomes
``areal/experimental/models/archon/qwen3``, any other mention the dotted module name. A
longer name that merely starts with it (``archon_models_extra``) is another name and stays.
Code and formatting stay as written (libcst re-emits the file unchanged elsewhere). A plain
``import archon_models...`` binds the name ``archon_models`` that the code then uses, so
renaming it would need the whole body rewritten: such a file is refused, naming the line
(packages the engine writes use ``from`` imports only).

Most files name the prefix only in ``from`` imports, comments and plain strings: those are
rewritten token by token (:mod:`tokenize`), ~20 times faster than a libcst parse, visit and
print (the AReaL tier exports every committed package, ~700 files: 49 CPU-s through libcst).
A file that names it anywhere else (an f-string's text, a bare name, a plain import, a
``yield from``) goes through libcst, which this module's tests hold both paths to agree with.
"""

from __future__ import annotations

import io
import keyword
import re
import tokenize
from collections.abc import Iterator

import libcst as cst
import libcst.helpers
from libcst.metadata import MetadataWrapper, PositionProvider

ARCHON_PREFIX = "archon_models"
AREAL_PREFIX = "areal.experimental.models.archon"


def _dotted(name: str) -> cst.Attribute | cst.Name:
    parts = name.split(".")
    node: cst.Attribute | cst.Name = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def rename_in_text(text: str, old: str = ARCHON_PREFIX, new: str = AREAL_PREFIX) -> str:
    """``text`` with ``old`` as a whole name renamed: ``old/...`` as a path, else dotted."""
    pattern = re.compile(rf"(?<![\w.]){re.escape(old)}(?!\w)(?P<path>/)?")
    return pattern.sub(lambda m: new.replace(".", "/") + "/" if m["path"] else new, text)


def _renamed(module: str, old: str, new: str) -> str | None:
    if module == old:
        return new
    if module.startswith(old + "."):
        return new + module[len(old) :]
    return None


class _PlainImportError(Exception):
    """A plain ``import`` of the prefix; the caller locates it to name the line."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _PrefixRewriter(cst.CSTTransformer):
    """Renames the prefix in ``from`` imports, strings and comments; raises on a plain import of it.

    Runs without metadata: a ``MetadataWrapper`` copies the whole tree and computes every
    node's position, several times the cost of the rewrite itself (the AReaL tier exports
    every committed package, hundreds of files, per test worker). Positions are computed
    only to name the line of a plain import, which is an error anyway."""

    def __init__(self, old: str, new: str):
        super().__init__()
        self.old, self.new = old, new

    def _prose(self, text: str) -> str:
        return rename_in_text(text, self.old, self.new)

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString) -> cst.SimpleString:
        return updated.with_changes(value=self._prose(updated.value))

    def leave_FormattedStringText(
        self, original: cst.FormattedStringText, updated: cst.FormattedStringText
    ) -> cst.FormattedStringText:
        return updated.with_changes(value=self._prose(updated.value))

    def leave_Comment(self, original: cst.Comment, updated: cst.Comment) -> cst.Comment:
        return updated.with_changes(value=self._prose(updated.value))

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        if updated.relative or updated.module is None:
            return updated
        target = _renamed(libcst.helpers.get_full_name_for_node(updated.module) or "", self.old, self.new)
        return updated if target is None else updated.with_changes(module=_dotted(target))

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            name = libcst.helpers.get_full_name_for_node(alias.name) or ""
            if _renamed(name, self.old, self.new) is not None:
                raise _PlainImportError(name)


class _PlainImportLocator(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.line: int | None = None

    def visit_Import(self, node: cst.Import) -> None:
        names = {libcst.helpers.get_full_name_for_node(alias.name) for alias in node.names}
        if self.line is None and self.name in names:
            self.line = self.get_metadata(PositionProvider, node).start.line


# The tokens after which a ``from`` starts a statement (an import), not ``yield from`` or ``raise ... from``.
_STATEMENT_STARTS = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
_STATEMENT_SEPARATORS = {";", ":"}


def _string_prefix(literal: str) -> str:
    """A string literal's prefix letters (``rb``, ``f``...), before its opening quote."""
    return literal[: len(literal) - len(literal.lstrip("rRbBuUfFtT"))]


def _starts_statement(previous: tokenize.TokenInfo | None) -> bool:
    """Whether the token after ``previous`` (a significant token) begins a simple statement."""
    if previous is None or previous.type in _STATEMENT_STARTS:
        return True
    return previous.type == tokenize.OP and previous.string in _STATEMENT_SEPARATORS


class _NeedsSyntaxTree(Exception):
    """The prefix occurs where only the libcst rewrite knows what to do with it."""


def _significant(tokens: list[tokenize.TokenInfo]) -> Iterator[tuple[int, tokenize.TokenInfo]]:
    """Tokens that are code: not comments, line breaks inside a statement, or the end marker."""
    for index, token in enumerate(tokens):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER):
            yield index, token


def _from_import_module(tokens: list[tokenize.TokenInfo], start: int) -> tuple[int, str] | None:
    """For the name token at ``start`` right after a statement's ``from``: the index of the
    module name's last token and the dotted name (None for anything but ``NAME(.NAME)*``)."""
    parts = [tokens[start].string]
    index = start
    while tokens[index + 1].exact_type == tokenize.DOT and tokens[index + 2].type == tokenize.NAME:
        index += 2
        parts.append(tokens[index].string)
    if tokens[index + 1].string != "import":
        return None
    return index, ".".join(parts)


def _token_edits(source: str, old: str, new: str) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
    """The replacements (start, end, text) that rename ``old`` in ``source``, found token by
    token; raises :class:`_NeedsSyntaxTree` where the prefix occurs outside a statement's
    ``from`` import, a comment or a plain (not formatted) string."""
    mention = re.compile(rf"(?<![\w.]){re.escape(old)}(?!\w)")
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        raise _NeedsSyntaxTree from None
    edits = []
    previous: tokenize.TokenInfo | None = None
    renamed_until = -1
    for index, token in _significant(tokens):
        starts_statement = _starts_statement(previous)
        after, previous = previous, token
        if index <= renamed_until:
            continue
        if token.type == tokenize.NAME and token.string == "from" and starts_statement:
            module = _from_import_module(tokens, index + 1) if tokens[index + 1].type == tokenize.NAME else None
            target = module and _renamed(module[1], old, new)
            if module is not None and target is not None:
                end = tokens[module[0]]
                edits.append((tokens[index + 1].start, end.end, target))
                renamed_until = module[0]
            continue
        if token.type == tokenize.STRING and mention.search(token.string):
            if "f" in _string_prefix(token.string).lower():
                raise _NeedsSyntaxTree
            edits.append((token.start, token.end, rename_in_text(token.string, old, new)))
        elif token.type == tokenize.NAME and token.string == old:
            if after is None or after.exact_type != tokenize.DOT:  # an attribute ``x.archon_models`` stays
                raise _NeedsSyntaxTree
        elif token.type not in (tokenize.NAME, tokenize.STRING) and mention.search(token.string):
            raise _NeedsSyntaxTree
    edits += [
        (token.start, token.end, rename_in_text(token.string, old, new))
        for token in tokens
        if token.type == tokenize.COMMENT and mention.search(token.string)
    ]
    return edits


def _apply(source: str, edits: list[tuple[tuple[int, int], tuple[int, int], str]]) -> str:
    """``source`` with each (start, end) span, as tokenize counts rows and columns, replaced."""
    line_starts = [0]
    for line in io.StringIO(source).readlines():
        line_starts.append(line_starts[-1] + len(line))
    out, done = [], 0
    for (start_row, start_col), (end_row, end_col), text in sorted(edits):
        start, end = line_starts[start_row - 1] + start_col, line_starts[end_row - 1] + end_col
        out += [source[done:start], text]
        done = end
    return "".join([*out, source[done:]])


def _rewrite_tokens(source: str, old: str, new: str) -> str | None:
    """The rewrite done token by token, or None where it needs the syntax tree."""
    if not old.isidentifier() or keyword.iskeyword(old):
        return None
    try:
        return _apply(source, _token_edits(source, old, new))
    except _NeedsSyntaxTree:
        return None


def rewrite_prefix(source: str, old: str = ARCHON_PREFIX, new: str = AREAL_PREFIX, filename: str = "<source>") -> str:
    """``source`` with every absolute ``from`` import of ``old`` (or a submodule) importing
    ``new``, and every string and comment naming ``old`` naming ``new``."""
    rewritten = _rewrite_tokens(source, old, new)
    if rewritten is not None:
        return rewritten
    return _rewrite_syntax_tree(source, old, new, filename)


def _rewrite_syntax_tree(source: str, old: str, new: str, filename: str) -> str:
    """The rewrite through libcst: any file, and the refusal of a plain import, naming its line."""
    module = cst.parse_module(source)
    try:
        return module.visit(_PrefixRewriter(old, new)).code
    except _PlainImportError as exc:
        locator = _PlainImportLocator(exc.name)
        MetadataWrapper(module).visit(locator)
        raise ValueError(
            f"{filename}:{locator.line}: `import {exc.name}` binds the name {old!r}, which a prefix "
            f"rewrite cannot carry over; write it as `from {exc.name.rsplit('.', 1)[0]} import ...`"
        ) from None
