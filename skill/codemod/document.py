"""A Python file under edit: one libcst tree, printed only when its text is read.

A step that edits a file (``edit_model``, ``edit_args``, ...) makes many small changes to
it: a class replaced, a statement inserted, a keyword set. Each change is a function from a
:class:`Document` to a Document (``skill.codemod.cst``, ``skill.codemod.contract``): it finds
nodes in the tree and rebuilds the ones it changes, and neither parses nor prints the file.
A step parses the file once when it reads it and prints it once when it writes it.

The text stays cheap to read in between (the edits' guards ask whether it holds a line):

- Nodes are immutable, and an edit rebuilds only the nodes on the path from the module to
  what it changes (:func:`replace_node`), so an edited module shares most of its top-level
  statements, as objects, with the module before. The documents edited from one parse share
  a memo of each top-level statement's code by identity: printing an edited module prints
  the statements that changed and joins the rest.
- Matching a statement compares its code without layout (:meth:`Document.key`); the same
  memo keeps that key for every statement matched once.

``Document(text).code == text``: libcst prints a parsed module back byte for byte, and a
document that no edit changed keeps the text it was read from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import libcst as cst


class CodemodError(ValueError):
    """The source does not have the shape an edit expects."""


# Statement keys are printed with libcst's default layout (4-space indent, "\n"), whatever
# the file's own, so that a statement parsed from an edit's source matches one of the file.
_KEY_CONTEXT = cst.Module(body=[])


class _Memo:
    """The printed code of nodes, by identity, for the documents edited from one parse."""

    def __init__(self, context: cst.Module):
        # Top-level statements print alike in every module of this indent and newline.
        self.layout = (context.default_indent, context.default_newline)
        self.context = context.with_changes(header=(), body=(), footer=())
        self.statements: dict[cst.CSTNode, str] = {}
        self.keys: dict[cst.CSTNode, str] = {}

    def statement_code(self, stmt: cst.CSTNode) -> str:
        code = self.statements.get(stmt)
        if code is None:
            code = self.statements[stmt] = self.context.code_for_node(stmt)
        return code

    def module_code(self, module: cst.Module) -> str:
        """``module.code``, printing only the top-level statements not printed before."""
        if (
            (module.default_indent, module.default_newline) != self.layout
            or not module.has_trailing_newline  # libcst then drops the last newline token
            or not module.body  # an empty module prints a newline
        ):
            return module.code
        return "".join(
            [
                *(self.statement_code(line) for line in module.header),
                *(self.statement_code(stmt) for stmt in module.body),
                *(self.statement_code(line) for line in module.footer),
            ]
        )

    def key(self, stmt: cst.CSTNode) -> str:
        key = self.keys.get(stmt)
        if key is None:
            if isinstance(stmt, cst.SimpleStatementLine):
                key = " ; ".join(_KEY_CONTEXT.code_for_node(small) for small in stmt.body)
            else:
                key = _KEY_CONTEXT.code_for_node(stmt)
            self.keys[stmt] = key
        return key


class Document:
    """One Python module's tree, and its text printed when first read.

    An edit returns a new document (sharing the memo of printed code) or, when it changes
    nothing, the very document it was given: ``edited is doc`` tells whether it did.
    """

    __slots__ = ("_code", "_memo", "_module")

    def __init__(self, source: str):
        try:
            module = cst.parse_module(source)
        except cst.ParserSyntaxError as e:
            raise CodemodError(f"cannot parse source: {e}") from e
        self._module = module
        self._memo = _Memo(module)
        self._code: str | None = source

    @property
    def module(self) -> cst.Module:
        return self._module

    @property
    def code(self) -> str:
        """The module's source (printed once, then kept)."""
        if self._code is None:
            self._code = self._memo.module_code(self._module)
        return self._code

    def __contains__(self, text: object) -> bool:
        """Whether the module's source holds ``text`` (a substring test on :attr:`code`)."""
        return isinstance(text, str) and text in self.code

    def with_module(self, module: cst.Module) -> Document:
        """This document holding ``module`` (an edit of its tree); itself when unchanged."""
        if module is self._module:
            return self
        edited = Document.__new__(Document)
        edited._module, edited._memo, edited._code = module, self._memo, None
        return edited

    def with_body(self, body: Sequence[cst.BaseStatement]) -> Document:
        """This document with its top-level statements replaced."""
        return self.with_module(self._module.with_changes(body=body))

    def replaced(
        self, old: cst.CSTNode, new: cst.CSTNode | cst.RemovalSentinel | cst.FlattenSentinel[cst.CSTNode]
    ) -> Document:
        """This document with the node ``old`` (a node of its tree, found by identity)
        replaced by ``new``. ``new`` may come from ``node.visit(transformer)``, typed as
        possibly removing the node; the transformers here never do."""
        if not isinstance(new, cst.CSTNode):
            raise CodemodError(f"internal error: a transform removed {node_code(old).strip()[:60]!r}")
        if new is old:
            return self
        module = replace_node(self._module, old, new)
        if not isinstance(module, cst.Module):  # only when old is the module itself
            raise CodemodError("internal error: a replacement inside a module did not return a module")
        return self.with_module(module)

    def key(self, stmt: cst.CSTNode) -> str:
        """A statement's code without comments or layout, for equality checks (kept per node)."""
        return self._memo.key(stmt)

    def statement_code(self, stmt: cst.CSTNode) -> str:
        """The code of a top-level statement as this module prints it (kept per node)."""
        return self._memo.statement_code(stmt)


def node_code(node: cst.CSTNode) -> str:
    """The code of a node with libcst's default layout (a name, an expression, a statement)."""
    return _KEY_CONTEXT.code_for_node(node)


# --- rebuilding only what changed ------------------------------------------------------


def replace_node(root: cst.CSTNode, old: cst.CSTNode, new: cst.CSTNode) -> cst.CSTNode:
    """``root`` with the node ``old`` (found by identity) replaced by ``new``.

    What libcst's ``deep_replace`` returns, built by rebuilding only ``old``'s ancestors:
    ``deep_replace`` rebuilds every node of the tree (and so every node's identity, which
    the memo of printed code goes by).
    """
    if root is old:
        return new
    path = _path_to(root, old)
    if path is None:
        raise CodemodError(f"internal error: {node_code(old).strip()[:60]!r} is not inside the module edited")
    node = new
    for parent, name, index in reversed(path):
        if index is None:
            value: cst.CSTNode | tuple[cst.CSTNode, ...] = node
        else:
            items = getattr(parent, name)
            value = (*items[:index], node, *items[index + 1 :])
        node = parent.with_changes(**{name: value})
    return node


def replace_nodes(root: cst.CSTNode, replacements: Mapping[cst.CSTNode, cst.CSTNode]) -> cst.CSTNode:
    """``root`` with every key of ``replacements`` (by identity) replaced by its value,
    rebuilding only their ancestors (a replacement's own subtree is not searched)."""
    if not replacements:
        return root

    def rebuild(node: cst.CSTNode) -> cst.CSTNode:
        found = replacements.get(node)
        if found is not None:
            return found
        changes: dict[str, cst.CSTNode | tuple[cst.CSTNode, ...]] = {}
        for name in _child_fields(type(node)):
            value = getattr(node, name)
            kind = type(value)
            if kind is tuple or kind is list:
                items = [rebuild(item) if _is_node_type(type(item)) else item for item in value]
                if any(a is not b for a, b in zip(items, value, strict=True)):
                    changes[name] = tuple(items)
            elif _is_node_type(kind):
                new = rebuild(value)
                if new is not value:
                    changes[name] = new
        return node.with_changes(**changes) if changes else node

    return rebuild(root)


def walk(root: cst.CSTNode, *, skip: tuple[type[cst.CSTNode], ...] = ()) -> Iterator[cst.CSTNode]:
    """``root`` and every node under it, parents before their children (but not the
    children of a node of a type in ``skip``).

    A plain walk of the node fields, in their declaration order (not always the order of
    the source: a function's decorators come after its body): libcst's ``visit`` rebuilds
    every node it passes, even for a visitor that changes nothing."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if skip and isinstance(node, skip):
            continue
        stack.extend(reversed(_children(node)))


def _children(node: cst.CSTNode) -> list[cst.CSTNode]:
    children: list[cst.CSTNode] = []
    for name in _child_fields(type(node)):
        value = getattr(node, name)
        kind = type(value)
        if kind is tuple or kind is list:
            children.extend(item for item in value if _is_node_type(type(item)))
        elif _is_node_type(kind):
            children.append(value)
    return children


def _path_to(root: cst.CSTNode, target: cst.CSTNode) -> list[tuple[cst.CSTNode, str, int | None]] | None:
    """The (parent, field, index in a sequence field or None) steps from ``root`` to ``target``.

    Breadth first: the nodes edits replace most (a class, a method) lie near the root."""
    steps: dict[cst.CSTNode, tuple[cst.CSTNode, str, int | None]] = {}
    level = [root]
    found = False
    while level and not found:
        below: list[cst.CSTNode] = []
        for node in level:
            for name in _child_fields(type(node)):
                value = getattr(node, name)
                kind = type(value)
                if kind is tuple or kind is list:
                    for index, item in enumerate(value):
                        if _is_node_type(type(item)):
                            steps[item] = (node, name, index)
                            below.append(item)
                            found = found or item is target
                elif _is_node_type(kind):
                    steps[value] = (node, name, None)
                    below.append(value)
                    found = found or value is target
        level = below
    if not found:
        return None
    path = []
    node = target
    while node is not root:
        step = steps[node]
        path.append(step)
        node = step[0]
    return path[::-1]


_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}
_NODE_TYPES: dict[type, bool] = {}


def _is_node_type(kind: type) -> bool:
    """``issubclass(kind, cst.CSTNode)``, kept per type (an ABC's checks are slow, and a
    walk makes one per field)."""
    known = _NODE_TYPES.get(kind)
    if known is None:
        known = _NODE_TYPES[kind] = issubclass(kind, cst.CSTNode)
    return known


def _child_fields(cls: type) -> tuple[str, ...]:
    fields = _CHILD_FIELDS.get(cls)
    if fields is None:
        fields = _CHILD_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))
    return fields
