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
"""

from __future__ import annotations

import re

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


def rewrite_prefix(source: str, old: str = ARCHON_PREFIX, new: str = AREAL_PREFIX, filename: str = "<source>") -> str:
    """``source`` with every absolute ``from`` import of ``old`` (or a submodule) importing
    ``new``, and every string and comment naming ``old`` naming ``new``."""
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
