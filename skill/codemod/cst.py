"""libcst helpers: each takes a :class:`Document` and returns it edited.

Every helper edits only the nodes it names and returns the document it was given (the
same object) when the edit is already in place, so a step run twice changes nothing and
comments and hand edits elsewhere in the file survive. No helper parses or prints the
document: a step parses a file once (``Document(text)``), applies its edits, and reads
``.code`` once (see ``skill.codemod.document``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeGuard, TypeVar, cast

import libcst as cst
import libcst.matchers as m

from skill.codemod.document import CodemodError, Document, node_code, replace_node, replace_nodes, walk
from skill.codemod.literals import python_string

_N = TypeVar("_N", bound=cst.CSTNode)

__all__ = [
    "CodemodError",
    "Document",
    "add_parameter",
    "append_statements",
    "class_code",
    "class_field_names",
    "edit_dict_literal",
    "ensure_import_line",
    "has_class",
    "has_method",
    "has_statement",
    "insert_after_construction",
    "insert_after_statement_assigning",
    "insert_at_loop_head",
    "insert_before_class",
    "insert_class_statement_after",
    "keep_else_branch",
    "leading_lines",
    "loop_body_code",
    "prune_unused_imports",
    "read_all",
    "read_dict_literal",
    "remove_call_kwarg",
    "remove_class",
    "remove_from_all",
    "remove_function",
    "remove_method",
    "remove_statements",
    "rename_identifiers",
    "replace_class",
    "replace_function",
    "replace_in_function",
    "replace_name",
    "replace_node",
    "replace_return",
    "replace_statement_assigning",
    "replace_text",
    "set_call_kwarg",
    "set_class_fields",
    "set_docstring",
    "set_module_assign",
    "statements",
    "top_level_names",
    "upsert_function",
    "upsert_method",
]


def _replace_all(text: str, pairs: Sequence[tuple[str, str]]) -> str:
    for old, new in pairs:
        if old and old != new:
            text = text.replace(old, new)
    return text


def rename_identifiers(doc: Document, pairs: Sequence[tuple[str, str]]) -> Document:
    """Rename every identifier, dotted module path, string and comment by substring pairs.

    ``[("Qwen2", "Mistral"), ("QWEN2", "MISTRAL"), ("qwen2", "mistral")]`` turns
    ``Qwen2Model`` into ``MistralModel``, ``archon_models.qwen2.model`` into
    ``archon_models.mistral.model`` and ``QWEN2_SPEC`` into ``MISTRAL_SPEC``.
    """

    def renamed(stmt: cst.CSTNode) -> dict[cst.CSTNode, cst.CSTNode]:
        found: dict[cst.CSTNode, cst.CSTNode] = {}
        for node in walk(stmt):
            if isinstance(node, (cst.Name, cst.SimpleString, cst.Comment)):
                value = _replace_all(node.value, pairs)
                if value != node.value:
                    found[node] = node.with_changes(value=value)
        return found

    module = doc.module
    edited = _edit_statements(doc, renamed)
    header, footer = (tuple(_replaced_in(line, renamed) for line in lines) for lines in (module.header, module.footer))
    if all(a is b for a, b in zip((*header, *footer), (*module.header, *module.footer), strict=True)):
        return edited
    return edited.with_module(edited.module.with_changes(header=header, footer=footer))


def replace_text(doc: Document, old: str, new: str, count: int = -1) -> Document:
    """``doc`` with ``old`` replaced by ``new`` in its source as ``str.replace(old, new, count)``
    replaces it, re-parsing only the top-level statements that hold it.

    For an edit that names text rather than nodes (a comment line, a line of a docstring).
    Where ``old`` straddles two statements, or a statement re-parsed alone would not print
    back as the text it was made from, the whole source is parsed again.
    """
    if old not in doc:
        return doc
    expected = doc.code.replace(old, new, count)
    body: list[cst.BaseStatement] = []
    left = count
    for stmt in doc.module.body:
        code = doc.statement_code(stmt)
        found = code.count(old) if left != 0 else 0
        if not found:
            body.append(stmt)
            continue
        taken = found if left < 0 else min(found, left)
        left = left if left < 0 else left - taken
        parsed = _statements_printing_as(doc, code.replace(old, new, taken))
        if parsed is None:
            return Document(expected)
        body.extend(parsed)
    edited = doc.with_body(body)
    return edited if edited.code == expected else Document(expected)


def _statements_printing_as(doc: Document, code: str) -> list[cst.BaseStatement] | None:
    """The top-level statements ``code`` parses to, if they print as ``code`` in ``doc``."""
    lead = "pass" + doc.module.default_newline  # keeps leading comment lines on the first statement
    try:
        part = cst.parse_module(lead + code)
    except cst.ParserSyntaxError:
        return None
    parsed: list[cst.BaseStatement] = list(part.body[1:])
    if part.header or part.footer or "".join(doc.statement_code(stmt) for stmt in parsed) != code:
        return None
    return parsed


def _edit_statements(doc: Document, edit: Callable[[cst.BaseStatement], Mapping[cst.CSTNode, cst.CSTNode]]) -> Document:
    """``doc`` with the replacements ``edit`` finds in each top-level statement made there
    (only the statements holding one are rebuilt)."""
    body = list(doc.module.body)
    changed = False
    for i, stmt in enumerate(body):
        new = _replaced_in(stmt, edit)
        if new is not stmt:
            body[i] = new
            changed = True
    return doc.with_body(body) if changed else doc


def _replaced_in(node: _N, edit: Callable[[_N], Mapping[cst.CSTNode, cst.CSTNode]]) -> _N:
    replacements = edit(node)
    if not replacements:
        return node
    new = replace_nodes(node, replacements)
    assert isinstance(new, type(node))
    return new


# --- imports -------------------------------------------------------------------------


def _is_import_line(stmt: cst.CSTNode) -> TypeGuard[cst.SimpleStatementLine]:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def has_statement(doc: Document, statement: str) -> bool:
    """Whether a module-level statement equal to ``statement`` (ignoring comments) exists."""
    wanted = doc.key(cst.parse_statement(statement))
    return any(doc.key(s) == wanted for s in doc.module.body)


def _same_import_group(stmt: cst.SimpleStatementLine, new: cst.BaseStatement) -> bool:
    """``from archon_models.X import spec as X_spec`` lines form one group."""

    def shape(node: cst.BaseStatement) -> tuple[str, str] | None:
        if not (isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1):
            return None
        imp = node.body[0]
        if not isinstance(imp, cst.ImportFrom) or imp.module is None or isinstance(imp.names, cst.ImportStar):
            return None
        root = node_code(imp.module).split(".")[0]
        names = ",".join(node_code(a.name) for a in imp.names)
        return root, names

    return shape(stmt) is not None and shape(stmt) == shape(new)


def ensure_import_line(doc: Document, statement: str) -> Document:
    """Add ``statement`` after the last module-level import unless it is already there."""
    module = doc.module
    new_stmt = cst.parse_statement(statement)
    wanted = doc.key(new_stmt)
    body = list(module.body)
    if any(doc.key(s) == wanted for s in body):
        return doc
    siblings = [i for i, s in enumerate(body) if _is_import_line(s) and _same_import_group(s, new_stmt)]
    if siblings:
        # Keep a group of like lines (one per registered package) sorted, so the file does
        # not depend on the order in which packages were added.
        later = [i for i in siblings if doc.key(body[i]) > wanted]
        index = later[0] if later else siblings[-1] + 1
        if isinstance(new_stmt, cst.SimpleStatementLine):
            new_stmt = new_stmt.with_changes(leading_lines=[])
        if later and index == siblings[0]:
            # Take over the blank lines above the group's first line.
            new_stmt = new_stmt.with_changes(leading_lines=body[index].leading_lines)
            body[index] = body[index].with_changes(leading_lines=[])
        body.insert(index, new_stmt)
        return doc.with_body(body)
    last_import = max((i for i, s in enumerate(body) if _is_import_line(s)), default=-1)
    if last_import < 0:
        # after a module docstring, if any
        last_import = 0 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else -1
    if isinstance(new_stmt, cst.SimpleStatementLine):
        new_stmt = new_stmt.with_changes(leading_lines=[])
    body.insert(last_import + 1, new_stmt)
    return doc.with_body(body)


def remove_statements(doc: Document, predicate: Callable[[str], bool]) -> Document:
    """Drop the module-level statements for which ``predicate(code)`` is true."""
    module = doc.module
    body = [s for s in module.body if not predicate(doc.key(s) if _is_import_line(s) else node_code(s))]
    if len(body) == len(module.body):
        return doc
    return doc.with_body(body)


# --- dict literals ---------------------------------------------------------------------


def leading_lines(stmt: cst.CSTNode) -> Sequence[cst.EmptyLine]:
    """The blank and comment lines above a statement (none for a node that has no such lines)."""
    if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        return stmt.leading_lines
    return ()


def _docstring_code(stmt: cst.CSTNode) -> str | None:
    """The code of the string literal when ``stmt`` is a docstring statement."""
    if (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    ):
        return node_code(stmt.body[0].value)
    return None


def statements(suite: cst.BaseSuite) -> list[cst.BaseStatement]:
    """The statements of an indented block (a class or function body written on one line,
    ``class A: pass``, has none the edits could match)."""
    if not isinstance(suite, cst.IndentedBlock):
        raise CodemodError(f"expected an indented block, found {node_code(suite).strip()!r}")
    return list(suite.body)


def _string_value(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value if isinstance(node.evaluated_value, str) else None
    if isinstance(node, cst.ConcatenatedString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _literal(value: str | None) -> cst.BaseExpression:
    return cst.Name("None") if value is None else cst.SimpleString(python_string(value))


def _find_dict_literal(module: cst.Module, target: str) -> cst.Dict:
    found: list[cst.Dict] = []
    for node in (small for stmt in module.body for small in _small_statements(stmt)):
        if isinstance(node, cst.Assign):
            if isinstance(node.value, cst.Dict) and any(node_code(t.target) == target for t in node.targets):
                found.append(node.value)
        elif isinstance(node, cst.AnnAssign) and isinstance(node.value, cst.Dict) and node_code(node.target) == target:
            found.append(node.value)
    if not found:
        raise CodemodError(f"no dict literal assigned to {target!r}")
    if len(found) > 1:
        raise CodemodError(f"{len(found)} dict literals are assigned to {target!r}; expected one")
    return found[0]


def read_dict_literal(doc: Document, target: str) -> dict[str, str | None]:
    """The string-keyed entries of the dict literal assigned to ``target``."""
    result: dict[str, str | None] = {}
    for element in _find_dict_literal(doc.module, target).elements:
        if not isinstance(element, cst.DictElement):
            continue
        key = _string_value(element.key)
        if key is None:
            continue
        if m.matches(element.value, m.Name("None")):
            result[key] = None
        else:
            result[key] = _string_value(element.value)
    return result


def edit_dict_literal(
    doc: Document,
    target: str,
    set_entries: Mapping[str, str | None] | None = None,
    remove: Iterable[str] = (),
    *,
    raw_values: bool = False,
) -> Document:
    """Set, add or remove string entries of the dict literal assigned to ``target``.

    Existing entries keep their place, comments and layout; new entries are appended
    with the layout of the last one. Returns ``doc`` unchanged when nothing differs.
    With ``raw_values`` the values are expression sources (``"SequenceParallel()"``).
    """
    set_entries = dict(set_entries or {})
    remove = set(remove)
    if raw_values:

        def make_value(value: str | None) -> cst.BaseExpression:
            return cst.parse_expression(value or "None")

        def holds(node: cst.BaseExpression, value: str | None) -> bool:
            return node_code(node) == node_code(make_value(value))

    else:
        make_value = _literal

        def holds(node: cst.BaseExpression, value: str | None) -> bool:
            if m.matches(node, m.Name("None")):
                return value is None
            return _string_value(node) == value

    original = _find_dict_literal(doc.module, target)
    lbrace = original.lbrace
    elements: list[cst.BaseDictElement] = []
    origins: list[int | None] = []
    seen: set[str] = set()
    changed = False
    for position, element in enumerate(original.elements):
        key = _string_value(element.key) if isinstance(element, cst.DictElement) else None
        if key is not None and key in remove:
            changed = True
            if position < len(original.elements) - 1:
                # The comment lines above the next entry hang on the removed entry's comma:
                # they move to the comma (or opening brace) before it, replacing the removed
                # entry's own.
                below = _lines_below(element.comma)
                if elements:
                    elements[-1] = elements[-1].with_changes(comma=_with_lines_below(elements[-1].comma, below))
                else:
                    lbrace = _with_lines_below(lbrace, below)
            continue
        if key is not None and key in set_entries:
            seen.add(key)
            if not holds(element.value, set_entries[key]):
                element = element.with_changes(value=make_value(set_entries[key]))
                changed = True
        elements.append(element)
        origins.append(position)
    template = next((e for e in reversed(elements) if isinstance(e, cst.DictElement)), None)
    for key, value in set_entries.items():
        if key in seen:
            continue
        changed = True
        new = cst.DictElement(key=_literal(key), value=make_value(value))
        if template is not None:
            new = new.with_changes(
                whitespace_before_colon=template.whitespace_before_colon,
                whitespace_after_colon=template.whitespace_after_colon,
            )
        elements.append(new)
        origins.append(None)
    if not changed:
        return doc
    elements = _relayout_commas(original, elements, origins)
    return doc.replaced(original, original.with_changes(lbrace=lbrace, elements=elements))


_Punctuation = TypeVar("_Punctuation", bound=cst.Comma | cst.LeftCurlyBrace | cst.MaybeSentinel)


def _lines_below(token: cst.Comma | cst.MaybeSentinel) -> Sequence[cst.EmptyLine]:
    """The blank and comment lines between a comma's line and the next entry."""
    if isinstance(token, cst.Comma) and isinstance(token.whitespace_after, cst.ParenthesizedWhitespace):
        return token.whitespace_after.empty_lines
    return ()


def _with_lines_below(token: _Punctuation, lines: Sequence[cst.EmptyLine]) -> _Punctuation:
    """``token`` (a comma or an opening brace) with ``lines`` between it and the next entry."""
    if isinstance(token, (cst.Comma, cst.LeftCurlyBrace)) and isinstance(
        token.whitespace_after, cst.ParenthesizedWhitespace
    ):
        moved = token.with_changes(whitespace_after=token.whitespace_after.with_changes(empty_lines=lines))
        return cast(_Punctuation, moved)
    return token


def _clean_comma(comma: cst.Comma | cst.MaybeSentinel) -> cst.Comma | cst.MaybeSentinel:
    """A comma with the same line break and indent but no trailing comment."""
    if isinstance(comma, cst.Comma) and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace):
        return comma.with_changes(
            whitespace_after=comma.whitespace_after.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
        )
    return comma


def _relayout_commas(
    original: cst.Dict, elements: list[cst.BaseDictElement], origins: list[int | None]
) -> list[cst.BaseDictElement]:
    """Keep each original element's comma where it still fits; new ones copy the layout."""
    old = list(original.elements)
    last_index = len(old) - 1
    if old and isinstance(old[0].comma, cst.Comma):
        inner: cst.Comma | cst.MaybeSentinel = _clean_comma(old[0].comma)
    else:
        inner = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    last = _clean_comma(old[-1].comma) if old else cst.MaybeSentinel.DEFAULT
    out = []
    for i, (element, origin) in enumerate(zip(elements, origins, strict=True)):
        is_last = i == len(elements) - 1
        if is_last:
            comma = element.comma if origin == last_index else last
        elif origin is not None and origin != last_index and isinstance(element.comma, cst.Comma):
            comma = element.comma
        else:
            comma = inner
        out.append(element.with_changes(comma=comma))
    return out


# --- classes and functions -------------------------------------------------------------


def find_class(module: cst.Module, class_name: str) -> cst.ClassDef:
    """The top-level class ``class_name``; ``CodemodError`` when there is none."""
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == class_name:
            return stmt
    raise CodemodError(f"no top-level class {class_name!r}")


def has_class(doc: Document, class_name: str) -> bool:
    return any(isinstance(s, cst.ClassDef) and s.name.value == class_name for s in doc.module.body)


def class_code(doc: Document, class_name: str) -> str:
    """The code of top-level class ``class_name`` (printed once per version of the class)."""
    return doc.statement_code(find_class(doc.module, class_name))


def has_method(doc: Document, class_name: str, func_name: str) -> bool:
    """Whether top-level class ``class_name`` defines method ``func_name``."""
    return any(
        isinstance(s, cst.FunctionDef) and s.name.value == func_name
        for s in statements(find_class(doc.module, class_name).body)
    )


def find_function(module: cst.Module, class_name: str | None, func_name: str) -> cst.FunctionDef:
    """Module-level function ``func_name`` (``class_name=None``) or a method of a top-level
    class; ``CodemodError`` when there is none."""
    scope: Sequence[cst.CSTNode] = (
        module.body if class_name is None else statements(find_class(module, class_name).body)
    )
    for stmt in scope:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == func_name:
            return stmt
    where = "module" if class_name is None else f"class {class_name}"
    raise CodemodError(f"no function {func_name!r} in {where}")


def _with_block(node: cst.ClassDef | cst.FunctionDef, body: Sequence[cst.BaseStatement]) -> cst.CSTNode:
    """A class or function with the statements of its indented body replaced."""
    return node.with_changes(body=node.body.with_changes(body=body))


def replace_function(doc: Document, class_name: str | None, func_name: str, new_source: str) -> Document:
    """Replace one function or method (decorators included) by ``new_source``.

    ``new_source`` is written at column 0; a method is re-indented by libcst.
    """
    old = find_function(doc.module, class_name, func_name)
    new = _parse_def(new_source, in_class=class_name is not None)
    if not isinstance(new, cst.FunctionDef):
        raise CodemodError(f"replacement for {func_name!r} is not a function definition")
    new = new.with_changes(leading_lines=old.leading_lines)
    if node_code(new.with_changes(leading_lines=[])) == node_code(old.with_changes(leading_lines=[])):
        return doc
    return doc.replaced(old, new)


def _parse_def(new_source: str, *, in_class: bool) -> cst.BaseStatement:
    """Parse a definition written at column 0; a method is parsed inside a class body so
    that multi-line strings (docstrings) keep the indentation they are written with."""
    if not in_class:
        return cst.parse_statement(new_source)
    indented = "".join(("    " + line) if line.strip() else line for line in new_source.splitlines(keepends=True))
    wrapper = cst.parse_statement("class _Wrapper:\n" + indented)
    assert isinstance(wrapper, cst.ClassDef)
    return statements(wrapper.body)[0]


def replace_class(doc: Document, class_name: str, new_source: str) -> Document:
    """Replace a top-level class by ``new_source`` (which may define another name)."""
    old = find_class(doc.module, class_name)
    new = cst.parse_statement(new_source)
    if not isinstance(new, cst.ClassDef):
        raise CodemodError(f"replacement for class {class_name!r} is not a class definition")
    new = new.with_changes(leading_lines=old.leading_lines)
    if node_code(new) == node_code(old):
        return doc
    return doc.replaced(old, new)


def insert_before_class(doc: Document, anchor: str, new_source: str) -> Document:
    """Insert top-level statements before class ``anchor`` unless a class they define exists."""
    find_class(doc.module, anchor)
    return insert_before_definition(doc, anchor, new_source)


def insert_before_definition(doc: Document, anchor: str, new_source: str) -> Document:
    """Insert top-level statements before the module-level class or function ``anchor``,
    leaving out each class or function the module already defines."""
    module = doc.module
    new_module = _parse_module(new_source)
    existing = {s.name.value for s in module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))}
    new_stmts = [
        s for s in new_module.body if not (isinstance(s, (cst.ClassDef, cst.FunctionDef)) and s.name.value in existing)
    ]
    if not new_stmts:
        return doc
    body = list(module.body)
    found = [s for s in body if isinstance(s, (cst.ClassDef, cst.FunctionDef)) and s.name.value == anchor]
    if not found:
        raise CodemodError(f"no top-level class or function {anchor!r}")
    index = body.index(found[0])
    spaced = [
        s.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        if isinstance(s, (cst.ClassDef, cst.FunctionDef))
        else s
        for s in new_stmts
    ]
    body[index:index] = spaced
    return doc.with_body(body)


def _parse_module(source: str) -> cst.Module:
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as e:
        raise CodemodError(f"cannot parse source: {e}") from e


def remove_class(doc: Document, class_name: str) -> Document:
    try:
        old = find_class(doc.module, class_name)
    except CodemodError:
        return doc
    return doc.with_body([s for s in doc.module.body if s is not old])


def _blocks_rebuilt(node: cst.CSTNode, edit: Callable[[cst.IndentedBlock], cst.IndentedBlock]) -> cst.CSTNode:
    """``node`` with ``edit`` applied to each indented block inside it, innermost first
    (a block's statements are edited before the block holding them, as a libcst
    transformer's ``leave_IndentedBlock`` sees them); a node nothing changed in is returned
    as it is, so unchanged statements keep their identity."""
    changes: dict[str, cst.CSTNode | tuple[cst.CSTNode, ...]] = {}
    for name, value in _statement_fields(node):
        if isinstance(value, cst.CSTNode):
            new = _blocks_rebuilt(value, edit)
            if new is not value:
                changes[name] = new
        else:
            items = [_blocks_rebuilt(item, edit) for item in value]
            if any(a is not b for a, b in zip(items, value, strict=True)):
                changes[name] = tuple(items)
    rebuilt = node.with_changes(**changes) if changes else node
    return edit(rebuilt) if isinstance(rebuilt, cst.IndentedBlock) else rebuilt


# The fields that hold statements, blocks or the clauses of a compound statement (an
# expression holds no indented block).
_BLOCK_HOLDERS = (
    cst.BaseSuite,
    cst.BaseCompoundStatement,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)


def _statement_fields(node: cst.CSTNode) -> Iterator[tuple[str, cst.CSTNode | tuple[cst.CSTNode, ...]]]:
    if isinstance(node, cst.IndentedBlock):
        yield "body", tuple(node.body)
        return
    if not isinstance(node, _BLOCK_HOLDERS):
        return
    for name in ("body", "orelse", "handlers", "finalbody", "cases"):
        value = getattr(node, name, None)
        if isinstance(value, _BLOCK_HOLDERS):
            yield name, value
        elif isinstance(value, (tuple, list)):
            yield name, tuple(item for item in value if isinstance(item, _BLOCK_HOLDERS))


def _nested_statements(node: cst.CSTNode) -> Iterator[cst.BaseStatement]:
    """Every statement inside ``node``, at any depth (compound statements' bodies included)."""
    for _, value in _statement_fields(node):
        for child in (value,) if isinstance(value, cst.CSTNode) else value:
            if isinstance(child, cst.BaseStatement):
                yield child
            yield from _nested_statements(child)


def replace_in_function(doc: Document, class_name: str | None, func_name: str, old: str, new: str) -> Document:
    """Replace one statement (matched by its code, ignoring layout) inside a function body.

    ``old`` and ``new`` are single statements; ``new`` may be several lines or empty
    (the statement is removed). Already-applied edits are a no-op.
    """
    func = find_function(doc.module, class_name, func_name)
    wanted = doc.key(cst.parse_statement(old))
    replacement = _parse_statements(new) if new.strip() else []
    hits = 0

    def swap(block: cst.IndentedBlock) -> cst.IndentedBlock:
        nonlocal hits
        if not any(doc.key(stmt) == wanted for stmt in block.body):
            return block
        body: list[cst.BaseStatement] = []
        carried: Sequence[cst.EmptyLine] | None = None
        for stmt in block.body:
            if doc.key(stmt) == wanted:
                hits += 1
                if not replacement:
                    carried = leading_lines(stmt)  # a blank line before a removed statement stays
                    continue
                body.extend(
                    r.with_changes(leading_lines=[*leading_lines(stmt), *r.leading_lines])
                    if i == 0 and isinstance(r, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
                    else r
                    for i, r in enumerate(replacement)
                )
            else:
                if carried is not None and isinstance(stmt, _WITH_LEADING_LINES) and not stmt.leading_lines:
                    stmt = stmt.with_changes(leading_lines=carried)
                carried = None
                body.append(stmt)
        return block.with_changes(body=body)

    new_func = _blocks_rebuilt(func, swap)
    if hits == 0:
        keys = [doc.key(s) for s in statements(func.body)]
        if not replacement or all(doc.key(s) in _all_stmt_keys(doc, func) for s in replacement):
            return doc  # already applied
        raise CodemodError(f"statement {old.strip()!r} not found in {func_name!r}; found: {keys}")
    return doc.replaced(func, new_func)


_WITH_LEADING_LINES = (cst.SimpleStatementLine, cst.BaseCompoundStatement)


def keep_else_branch(doc: Document, class_name: str | None, func_name: str, test: str) -> Document:
    """The top-level ``if <test>: ... else: ...`` of a function becomes the statements of its
    ``else`` branch (the blank and comment lines above the ``if`` stay); a no-op when the
    function has no such ``if``."""
    func = find_function(doc.module, class_name, func_name)
    body = statements(func.body)
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.If) and node_code(stmt.test) == test:
            if not isinstance(stmt.orelse, cst.Else):
                raise CodemodError(f"'if {test}:' in {func_name!r} has no else branch to keep")
            kept = statements(stmt.orelse.body)
            kept[0] = kept[0].with_changes(leading_lines=[*stmt.leading_lines, *leading_lines(kept[0])])
            body[i : i + 1] = kept
            return doc.replaced(func, _with_block(func, body))
    return doc


def _parse_statements(source: str) -> list[cst.BaseStatement]:
    """Statements of ``source`` with a leading comment kept on the first one (a bare parse
    would move it into the module header and lose it)."""
    body: list[cst.BaseStatement] = list(cst.parse_module("pass\n" + source).body)
    return body[1:]


def _all_stmt_keys(doc: Document, node: cst.CSTNode) -> set[str]:
    """The keys of every simple statement line, ``if`` and ``for`` inside ``node``."""
    return {
        doc.key(stmt)
        for stmt in _nested_statements(node)
        if isinstance(stmt, (cst.SimpleStatementLine, cst.If, cst.For))
    }


def class_field_names(doc: Document, class_name: str) -> list[str]:
    """Annotated field names of a (dataclass) class, in order."""
    cls = find_class(doc.module, class_name)
    names = []
    for stmt in statements(cls.body):
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                    names.append(small.target.value)
    return names


def set_class_fields(
    doc: Document,
    class_name: str,
    fields: Mapping[str, str],
    remove: Iterable[str] = (),
) -> Document:
    """Set annotated class fields: ``{"name": "int = 4"}``; add missing ones after the last field.

    Fields named in ``remove`` are dropped. Existing fields keep their comments.
    """
    remove = set(remove)
    cls = find_class(doc.module, class_name)
    body = statements(cls.body)
    seen: set[str] = set()
    last_field = -1
    changed = False
    new_body: list[cst.BaseStatement] = []
    for stmt in body:
        name = _field_name(stmt)
        if name is not None and name in remove:
            changed = True
            continue
        if name is not None and name in fields and isinstance(stmt, cst.SimpleStatementLine):
            seen.add(name)
            new_stmt = cst.parse_statement(f"{name}: {fields[name]}\n")
            new_stmt = new_stmt.with_changes(
                leading_lines=stmt.leading_lines, trailing_whitespace=stmt.trailing_whitespace
            )
            if doc.key(new_stmt) != doc.key(stmt):
                stmt = new_stmt
                changed = True
        new_body.append(stmt)
        if name is not None:
            last_field = len(new_body) - 1
    additions = [cst.parse_statement(f"{n}: {spec}\n") for n, spec in fields.items() if n not in seen]
    if additions:
        changed = True
        insert_at = last_field + 1 if last_field >= 0 else _after_docstring(new_body)
        new_body[insert_at:insert_at] = additions
    if not changed:
        return doc
    return doc.replaced(cls, _with_block(cls, new_body))


def _field_name(stmt: cst.CSTNode) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
            return small.target.value
    return None


def _after_docstring(body: list[cst.BaseStatement]) -> int:
    if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])):
        return 1
    return 0


def top_level_names(doc: Document) -> list[str]:
    """Names of top-level classes and functions."""
    return [s.name.value for s in doc.module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))]


def _call_name(call: cst.Call) -> str:
    return node_code(call.func)


def remove_call_kwarg(doc: Document, func_name: str, kwarg: str, *, target: str | None = None) -> Document:
    """Drop keyword ``kwarg`` from calls to ``func_name`` (only those assigned to ``target``
    when given); the document unchanged when no such call has it."""

    def edit(stmt: cst.BaseStatement) -> dict[cst.CSTNode, cst.CSTNode]:
        scopes: Iterable[cst.CSTNode] = (
            [stmt]
            if target is None
            else [
                small
                for small in _small_statements(stmt)
                if (isinstance(small, cst.Assign) and any(node_code(t.target) == target for t in small.targets))
                or (isinstance(small, cst.AnnAssign) and node_code(small.target) == target)
            ]
        )
        edits: dict[cst.CSTNode, cst.CSTNode] = {}
        for scope in scopes:
            for node in walk(scope):
                if not isinstance(node, cst.Call) or _call_name(node) != func_name:
                    continue
                kept = [a for a in node.args if a.keyword is None or a.keyword.value != kwarg]
                if len(kept) == len(node.args):
                    continue
                if kept:
                    kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                edits[node] = node.with_changes(args=kept)
        return edits

    return _edit_statements(doc, edit)


def set_call_kwarg(
    doc: Document, func_name: str, kwarg: str, value_source: str, *, target: str | None = None
) -> Document:
    """Set keyword ``kwarg`` to the expression ``value_source`` in calls to ``func_name``.

    With ``target`` only calls assigned to that target (``self.wo``) are edited. A
    missing keyword is appended. Raises ``CodemodError`` when no call matches.
    """
    value = cst.parse_expression(value_source)
    hits = 0

    def edit(stmt: cst.BaseStatement) -> dict[cst.CSTNode, cst.CSTNode]:
        nonlocal hits
        scopes: Iterable[cst.CSTNode] = (
            [stmt]
            if target is None
            else [
                small
                for small in _small_statements(stmt)
                if isinstance(small, cst.Assign) and any(node_code(t.target) == target for t in small.targets)
            ]
        )
        calls = [
            node
            for scope in scopes
            for node in walk(scope)
            if isinstance(node, cst.Call) and _call_name(node) == func_name
        ]
        hits += len(calls)
        return {call: new for call in calls if (new := _with_kwarg(call, kwarg, value, value_source)) is not call}

    edited = _edit_statements(doc, edit)
    if hits == 0:
        where = f" assigned to {target}" if target else ""
        raise CodemodError(f"no call to {func_name}{where}")
    return edited


def set_call_argument(doc: Document, func_name: str, position: int, value_source: str, *, target: str) -> Document:
    """Set positional argument ``position`` to the expression ``value_source`` in the calls
    to ``func_name`` assigned to ``target`` (``nn.Linear``'s width of ``self.wq``). Raises
    ``CodemodError`` when no such call has that argument."""
    value = cst.parse_expression(value_source)
    hits = 0

    def edit(stmt: cst.BaseStatement) -> dict[cst.CSTNode, cst.CSTNode]:
        nonlocal hits
        calls = [
            node
            for small in _small_statements(stmt)
            if isinstance(small, cst.Assign) and any(node_code(t.target) == target for t in small.targets)
            for node in walk(small)
            if isinstance(node, cst.Call)
            and _call_name(node) == func_name
            and len(node.args) > position
            and all(arg.keyword is None and not arg.star for arg in node.args[: position + 1])
        ]
        hits += len(calls)
        return {
            call: call.with_changes(
                args=[
                    arg.with_changes(value=value.deep_clone()) if i == position else arg
                    for i, arg in enumerate(call.args)
                ]
            )
            for call in calls
            if node_code(call.args[position].value) != value_source
        }

    edited = _edit_statements(doc, edit)
    if hits == 0:
        raise CodemodError(f"no call to {func_name} assigned to {target} with a positional argument {position}")
    return edited


def _small_statements(stmt: cst.CSTNode) -> Iterator[cst.BaseSmallStatement]:
    """Every small statement (an assignment, a return, an expression, ...) inside ``stmt``."""
    if isinstance(stmt, cst.SimpleStatementLine | cst.SimpleStatementSuite):
        yield from stmt.body
        return
    for _, value in _statement_fields(stmt):
        for child in (value,) if isinstance(value, cst.CSTNode) else value:
            yield from _small_statements(child)


def _with_kwarg(call: cst.Call, kwarg: str, value: cst.BaseExpression, value_source: str) -> cst.Call:
    """``call`` with keyword ``kwarg`` set to ``value`` (appended when missing)."""
    args = list(call.args)
    for i, arg in enumerate(args):
        if arg.keyword is not None and arg.keyword.value == kwarg:
            if node_code(arg.value) == value_source:
                return call
            args[i] = arg.with_changes(value=value.deep_clone())
            return call.with_changes(args=args)
    if args and isinstance(args[-1].comma, cst.MaybeSentinel):
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    args.append(
        cst.Arg(
            value=value.deep_clone(),
            keyword=cst.Name(kwarg),
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            ),
        )
    )
    return call.with_changes(args=args)


def set_module_assign(doc: Document, name: str, value_source: str) -> Document:
    """Set the value of a module-level ``name = ...`` (plain or annotated) assignment."""
    value = cst.parse_expression(value_source)
    body = list(doc.module.body)
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
            continue
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and any(node_code(t.target) == name for t in small.targets):
            if node_code(small.value) == node_code(value):
                return doc
            body[i] = stmt.with_changes(body=[small.with_changes(value=value)])
            return doc.with_body(body)
        if isinstance(small, cst.AnnAssign) and node_code(small.target) == name:
            if small.value is not None and node_code(small.value) == node_code(value):
                return doc
            body[i] = stmt.with_changes(body=[small.with_changes(value=value)])
            return doc.with_body(body)
    raise CodemodError(f"no module-level assignment to {name!r}")


def upsert_function(doc: Document, func_name: str, new_source: str, *, before_class: str | None = None) -> Document:
    """Replace module-level function ``func_name``, or insert it (before ``before_class``
    or at the end) when the module has none."""
    module = doc.module
    if any(isinstance(s, cst.FunctionDef) and s.name.value == func_name for s in module.body):
        return replace_function(doc, None, func_name, new_source)
    if before_class is not None:
        return insert_before_class(doc, before_class, new_source)
    new = cst.parse_statement(new_source).with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    return doc.with_body([*module.body, new])


def replace_return(doc: Document, class_name: str | None, func_name: str, target: str, new_source: str) -> Document:
    """In ``func_name``, turn the last top-level ``return <expr>`` into ``<target> = <expr>``
    followed by the statements of ``new_source`` (which return in its place)."""
    func = find_function(doc.module, class_name, func_name)
    body = statements(func.body)

    def returned_value(stmt: cst.BaseStatement) -> cst.BaseExpression | None:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Return):
            return stmt.body[0].value
        return None

    index = next((i for i in range(len(body) - 1, -1, -1) if returned_value(body[i]) is not None), None)
    if index is None:
        raise CodemodError(f"{func_name!r} has no top-level return of a value")
    line, value = body[index], returned_value(body[index])
    assert isinstance(line, cst.SimpleStatementLine) and value is not None
    assign = line.with_changes(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(target))], value=value)])
    body[index : index + 1] = [assign, *_parse_statements(new_source)]
    return doc.replaced(func, _with_block(func, body))


def append_statements(doc: Document, new_source: str) -> Document:
    """Append top-level statements at the end of the module, two blank lines before the
    first (a leading comment stays with it)."""
    new_stmts = _parse_statements(new_source)
    if not new_stmts:
        return doc
    first = new_stmts[0]
    new_stmts[0] = first.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *leading_lines(first)])
    return doc.with_body([*doc.module.body, *new_stmts])


def append_to_function(doc: Document, class_name: str | None, func_name: str, new_source: str) -> Document:
    """Append statements at the end of a function's body; a no-op when the first new
    statement is already there."""
    func = find_function(doc.module, class_name, func_name)
    body = statements(func.body)
    new_stmts = _parse_statements(new_source)
    if not new_stmts or any(doc.key(s) == doc.key(new_stmts[0]) for s in body):
        return doc
    return doc.replaced(func, _with_block(func, [*body, *new_stmts]))


def set_docstring(doc: Document, class_name: str | None, text: str) -> Document:
    """Set the docstring of the module (``class_name=None``) or of a top-level class."""
    module = doc.module
    literal = '"""' + text.replace('"""', '\\"\\"\\"') + '"""'
    doc_stmt = cst.SimpleStatementLine(body=[cst.Expr(cst.SimpleString(literal))])
    docstring_pattern = m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])
    body: list[cst.BaseStatement]
    if class_name is None:
        body = list(module.body)
        if body and isinstance(body[0], cst.SimpleStatementLine) and m.matches(body[0], docstring_pattern):
            if _docstring_code(body[0]) == literal:
                return doc
            body[0] = body[0].with_changes(body=doc_stmt.body)
        else:
            body.insert(0, doc_stmt)
        return doc.with_body(body)
    cls = find_class(module, class_name)
    body = statements(cls.body)
    if body and isinstance(body[0], cst.SimpleStatementLine) and m.matches(body[0], docstring_pattern):
        if _docstring_code(body[0]) == literal:
            return doc
        body[0] = body[0].with_changes(body=doc_stmt.body)
    else:
        body.insert(0, doc_stmt)
    return doc.replaced(cls, _with_block(cls, body))


def read_all(doc: Document) -> list[str]:
    """The names of the module's ``__all__`` list or tuple literal (``[]`` without one)."""
    for stmt in doc.module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            small = stmt.body[0]
            if (
                isinstance(small, cst.Assign)
                and any(node_code(t.target) == "__all__" for t in small.targets)
                and isinstance(small.value, (cst.List, cst.Tuple))
            ):
                return [v for e in small.value.elements if (v := _string_value(e.value)) is not None]
    return []


def remove_from_all(doc: Document, names: Iterable[str]) -> Document:
    """Drop ``names`` from the module's ``__all__`` list literal, if present."""
    names = set(names)
    for stmt in doc.module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            small = stmt.body[0]
            if isinstance(small, cst.Assign) and any(node_code(t.target) == "__all__" for t in small.targets):
                value = small.value
                if isinstance(value, (cst.List, cst.Tuple)):
                    kept = [e for e in value.elements if _string_value(e.value) not in names]
                    if len(kept) == len(value.elements):
                        return doc
                    if kept:
                        kept[-1] = kept[-1].with_changes(comma=value.elements[-1].comma)
                    return doc.replaced(value, value.with_changes(elements=kept))
    return doc


def replace_name(doc: Document, old: str, new_expression: str) -> Document:
    """Replace every use of the bare name ``old`` by ``new_expression`` (``RMSNorm`` -> ``nn.LayerNorm``).

    An attribute's member name is not a use: ``x.RMSNorm`` stays."""
    new = cst.parse_expression(new_expression)

    def uses(stmt: cst.CSTNode) -> dict[cst.CSTNode, cst.CSTNode]:
        nodes = list(walk(stmt))
        members = {node.attr for node in nodes if isinstance(node, cst.Attribute)}
        return {
            node: new.deep_clone()
            for node in nodes
            if isinstance(node, cst.Name) and node.value == old and node not in members
        }

    return _edit_statements(doc, uses)


def _assigns_target(node: cst.CSTNode, target: str) -> bool:
    return any(
        (isinstance(n, cst.Assign) and any(node_code(t.target) == target for t in n.targets))
        or (isinstance(n, cst.AnnAssign) and node_code(n.target) == target)
        for n in _small_statements(node)
    )


def replace_statement_assigning(
    doc: Document, class_name: str | None, func_name: str, target: str, new_source: str
) -> Document:
    """Replace the top-level statement of a function body that assigns ``target``
    (a plain assignment or an ``if`` choosing between assignments) by ``new_source``."""
    func = find_function(doc.module, class_name, func_name)
    body = statements(func.body)
    replacement = _parse_statements(new_source)
    for i, stmt in enumerate(body):
        if _assigns_target(stmt, target):
            if [doc.key(s) for s in replacement] == [doc.key(stmt)]:
                return doc
            replacement[0] = replacement[0].with_changes(
                leading_lines=[*leading_lines(stmt), *leading_lines(replacement[0])]
            )
            body[i : i + 1] = replacement
            return doc.replaced(func, _with_block(func, body))
    raise CodemodError(f"no statement assigning {target} in {func_name!r}")


def prune_unused_imports(doc: Document) -> Document:
    """Drop names imported with ``from x import a, b`` that the module never uses."""
    module = doc.module
    used: set[str] = set()
    for node in walk(module, skip=(cst.ImportFrom,)):  # an imported name is no use of it
        if isinstance(node, cst.Name):
            used.add(node.value)
        elif isinstance(node, cst.SimpleString):
            value = _string_value(node)
            if value and value.isidentifier():
                used.add(value)  # names listed in __all__
    body = []
    changed = False
    carried: Sequence[cst.EmptyLine] | None = None
    for stmt in module.body:
        if carried is not None and isinstance(stmt, _WITH_LEADING_LINES) and not stmt.leading_lines:
            stmt = stmt.with_changes(leading_lines=carried)
        carried = None
        imp = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
        if (
            isinstance(stmt, cst.SimpleStatementLine)
            and isinstance(imp, cst.ImportFrom)
            and not isinstance(imp.names, cst.ImportStar)
            and (imp.module is None or node_code(imp.module) != "__future__")
        ):
            kept = [a for a in imp.names if node_code(a.asname.name if a.asname else a.name) in used]
            if len(kept) != len(imp.names):
                changed = True
                if not kept:
                    carried = stmt.leading_lines  # the blank line before a removed import stays
                    continue
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                if len(kept) <= 3:
                    kept = [
                        a.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))) for a in kept[:-1]
                    ] + [kept[-1]]
                    imp = imp.with_changes(names=kept, lpar=None, rpar=None)
                else:
                    imp = imp.with_changes(names=kept)
                stmt = stmt.with_changes(body=[imp])
        body.append(stmt)
    return doc.with_body(body) if changed else doc


def add_parameter(doc: Document, class_name: str | None, func_name: str, param_source: str) -> Document:
    """Append a parameter (``"sliding_window: int | None = None"``) to a function's signature."""
    func = find_function(doc.module, class_name, func_name)
    probe = cst.parse_statement(f"def _probe({param_source}): pass")
    assert isinstance(probe, cst.FunctionDef)
    param = probe.params.params[0] if probe.params.params else probe.params.kwonly_params[0]
    if any(p.name.value == param.name.value for p in (*func.params.params, *func.params.kwonly_params)):
        return doc
    params = list(func.params.params)
    if params:
        params[-1] = params[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    params.append(param)
    return doc.replaced(func, func.with_changes(params=func.params.with_changes(params=params)))


def remove_function(doc: Document, func_name: str) -> Document:
    """Drop a module-level function, if present."""
    body = [s for s in doc.module.body if not (isinstance(s, cst.FunctionDef) and s.name.value == func_name)]
    return doc if len(body) == len(doc.module.body) else doc.with_body(body)


def remove_method(doc: Document, class_name: str, func_name: str) -> Document:
    """Drop a method of a top-level class, if present."""
    cls = find_class(doc.module, class_name)
    body = [s for s in statements(cls.body) if not (isinstance(s, cst.FunctionDef) and s.name.value == func_name)]
    if len(body) == len(statements(cls.body)):
        return doc
    return doc.replaced(cls, _with_block(cls, body))


def insert_after_statement_assigning(
    doc: Document, class_name: str | None, func_name: str, target: str, new_source: str
) -> Document:
    """Insert statements right after the top-level statement of a function that assigns
    ``target``; a no-op when the first new statement is already there."""
    func = find_function(doc.module, class_name, func_name)
    body = statements(func.body)
    new_stmts = _parse_statements(new_source)
    first = doc.key(new_stmts[0])
    if any(doc.key(s) == first for s in body):
        return doc
    for i, stmt in enumerate(body):
        if _assigns_target(stmt, target):
            body[i + 1 : i + 1] = new_stmts
            return doc.replaced(func, _with_block(func, body))
    raise CodemodError(f"no statement assigning {target} in {func_name!r}")


def _builds_target(stmt: cst.CSTNode, target: str) -> bool:
    """Whether ``stmt`` is a simple statement line assigning ``target`` a value other than ``None``."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for small in stmt.body:
        value = small.value if isinstance(small, cst.Assign | cst.AnnAssign) else None
        if value is None or (isinstance(value, cst.Name) and value.value == "None"):
            continue
        if _assigns_target(cst.SimpleStatementLine(body=[small]), target):
            return True
    return False


def insert_after_construction(
    doc: Document, class_name: str | None, func_name: str, target: str, new_source: str
) -> Document:
    """Insert statements right after the statement of a function that builds ``target`` (assigns
    it anything but ``None``), in that statement's own block at whatever depth: after
    ``self.moe = MoE(...)`` inside ``if self.moe_enabled:``, not after the ``self.moe = None``
    placeholder above it. A no-op when the first new statement is already in the function."""
    func = find_function(doc.module, class_name, func_name)
    new_stmts = _parse_statements(new_source)
    if doc.key(new_stmts[0]) in _all_stmt_keys(doc, func):
        return doc
    done = False

    def insert(block: cst.IndentedBlock) -> cst.IndentedBlock:
        nonlocal done
        if done:
            return block
        body = list(block.body)
        for i, stmt in enumerate(body):
            if _builds_target(stmt, target):
                body[i + 1 : i + 1] = new_stmts
                done = True
                return block.with_changes(body=body)
        return block

    new_func = _blocks_rebuilt(func, insert)
    if not done:
        raise CodemodError(f"no statement building {target} in {func_name!r}")
    return doc.replaced(func, new_func)


def _loop_over(func: cst.FunctionDef, iterable: str) -> cst.For:
    for stmt in statements(func.body):
        if isinstance(stmt, cst.For) and node_code(stmt.iter) == iterable:
            return stmt
    raise CodemodError(f"no top-level loop over {iterable} in {func.name.value!r}")


def loop_body_code(doc: Document, class_name: str | None, func_name: str, iterable: str) -> list[str]:
    """The code (layout-free keys) of the statements of a function's top-level ``for`` loop over ``iterable``."""
    loop = _loop_over(find_function(doc.module, class_name, func_name), iterable)
    return [doc.key(stmt) for stmt in statements(loop.body)]


def insert_at_loop_head(
    doc: Document, class_name: str | None, func_name: str, iterable: str, new_source: str, *, hoist: str = ""
) -> Document:
    """Put statements at the head of a function's top-level ``for`` loop over ``iterable``.

    ``hoist``: a statement of that loop's body (matched by its code) moved to the head
    first, before the new ones, so they can read what it assigns. A no-op when the first
    new statement is already in the body.
    """
    func = find_function(doc.module, class_name, func_name)
    loop = _loop_over(func, iterable)
    body = statements(loop.body)
    new_stmts = _parse_statements(new_source)
    if any(doc.key(s) == doc.key(new_stmts[0]) for s in body):
        return doc
    head: list[cst.BaseStatement] = []
    if hoist:
        wanted = doc.key(cst.parse_statement(hoist))
        found = [s for s in body if doc.key(s) == wanted]
        if not found:
            raise CodemodError(f"statement {hoist.strip()!r} not found in the loop over {iterable} of {func_name!r}")
        head = [found[0].with_changes(leading_lines=[])]
        body = [s for s in body if s is not found[0]]
    new_loop = loop.with_changes(body=loop.body.with_changes(body=[*head, *new_stmts, *body]))
    return doc.replaced(loop, new_loop)


def insert_class_statement_after(doc: Document, class_name: str, target: str, new_source: str) -> Document:
    """Put one class-body statement right after the one assigning ``target``; when a
    statement assigning the same name already exists it is replaced (a no-op if equal)."""
    cls = find_class(doc.module, class_name)
    new_stmts = _parse_statements(new_source)
    if len(new_stmts) != 1:
        raise CodemodError("insert_class_statement_after takes exactly one statement")
    new = new_stmts[0]
    new_target = _assigned_name(new)
    body = statements(cls.body)
    if new_target is not None:
        for i, stmt in enumerate(body):
            if isinstance(stmt, cst.SimpleStatementLine) and _assigns_target(stmt, new_target):
                if doc.key(stmt) == doc.key(new):
                    return doc
                body[i] = new.with_changes(leading_lines=stmt.leading_lines)
                return doc.replaced(cls, _with_block(cls, body))
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and _assigns_target(stmt, target):
            body[i + 1 : i + 1] = [new]
            return doc.replaced(cls, _with_block(cls, body))
    raise CodemodError(f"no class-level statement assigning {target} in class {class_name!r}")


def _assigned_name(stmt: cst.BaseStatement) -> str | None:
    """The target of the first annotated assignment of a line, else of its first plain one."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return None
    for small in stmt.body:
        if isinstance(small, cst.AnnAssign):
            return node_code(small.target)
    for small in stmt.body:
        if isinstance(small, cst.Assign):
            return node_code(small.targets[0].target)
    return None


def upsert_method(
    doc: Document, class_name: str, func_name: str, new_source: str, *, after: str | None = None
) -> Document:
    """Replace method ``func_name`` of ``class_name``, or insert it after method ``after``
    (at the end of the class when ``after`` is None or absent)."""
    cls = find_class(doc.module, class_name)
    if any(isinstance(s, cst.FunctionDef) and s.name.value == func_name for s in statements(cls.body)):
        return replace_function(doc, class_name, func_name, new_source)
    new = _parse_def(new_source, in_class=True).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    body = statements(cls.body)
    index = len(body)
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == after:
            index = i + 1
    body[index:index] = [new]
    return doc.replaced(cls, _with_block(cls, body))
