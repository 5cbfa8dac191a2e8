"""libcst helpers: each takes module source and returns edited source.

Every helper edits only the nodes it names and returns the input unchanged when the
edit is already in place, so a step run twice changes nothing and comments and hand
edits elsewhere in the file survive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import libcst as cst
import libcst.matchers as m

from skill.codemod import parse_cache
from skill.codemod.literals import python_string


class CodemodError(ValueError):
    """The source does not have the shape an edit expects."""


def _parse(source: str) -> cst.Module:
    try:
        return parse_cache.parse_module(source)
    except cst.ParserSyntaxError as e:
        raise CodemodError(f"cannot parse source: {e}") from e


def _replace_all(text: str, pairs: Sequence[tuple[str, str]]) -> str:
    for old, new in pairs:
        if old and old != new:
            text = text.replace(old, new)
    return text


class _Renamer(cst.CSTTransformer):
    def __init__(self, pairs: Sequence[tuple[str, str]]):
        super().__init__()
        self.pairs = pairs

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        return updated_node.with_changes(value=_replace_all(updated_node.value, self.pairs))

    def leave_SimpleString(self, original_node: cst.SimpleString, updated_node: cst.SimpleString) -> cst.SimpleString:
        return updated_node.with_changes(value=_replace_all(updated_node.value, self.pairs))

    def leave_Comment(self, original_node: cst.Comment, updated_node: cst.Comment) -> cst.Comment:
        return updated_node.with_changes(value=_replace_all(updated_node.value, self.pairs))


def rename_identifiers(source: str, pairs: Sequence[tuple[str, str]]) -> str:
    """Rename every identifier, dotted module path, string and comment by substring pairs.

    ``[("Qwen2", "Mistral"), ("QWEN2", "MISTRAL"), ("qwen2", "mistral")]`` turns
    ``Qwen2Model`` into ``MistralModel``, ``archon_models.qwen2.model`` into
    ``archon_models.mistral.model`` and ``QWEN2_SPEC`` into ``MISTRAL_SPEC``.
    """
    return _parse(source).visit(_Renamer(pairs)).code


# --- imports -------------------------------------------------------------------------


def _stmt_key(stmt: cst.CSTNode) -> str:
    """A statement's code without comments or layout, for equality checks."""
    module = cst.Module(body=[])
    if isinstance(stmt, cst.SimpleStatementLine):
        return " ; ".join(module.code_for_node(s) for s in stmt.body)
    return module.code_for_node(stmt)


def _is_import_line(stmt: cst.CSTNode) -> TypeGuard[cst.SimpleStatementLine]:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def has_statement(source: str, statement: str) -> bool:
    """Whether a module-level statement equal to ``statement`` (ignoring comments) exists."""
    wanted = _stmt_key(cst.parse_statement(statement))
    return any(_stmt_key(s) == wanted for s in _parse(source).body)


def _same_import_group(stmt: cst.SimpleStatementLine, new: cst.BaseStatement) -> bool:
    """``from archon_models.X import spec as X_spec`` lines form one group."""

    def shape(node: cst.BaseStatement) -> tuple[str, str] | None:
        if not (isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1):
            return None
        imp = node.body[0]
        if not isinstance(imp, cst.ImportFrom) or imp.module is None or isinstance(imp.names, cst.ImportStar):
            return None
        root = _target_code(imp.module).split(".")[0]
        names = ",".join(_target_code(a.name) for a in imp.names)
        return root, names

    return shape(stmt) is not None and shape(stmt) == shape(new)


def ensure_import_line(source: str, statement: str) -> str:
    """Add ``statement`` after the last module-level import unless it is already there."""
    module = _parse(source)
    new_stmt = cst.parse_statement(statement)
    wanted = _stmt_key(new_stmt)
    body = list(module.body)
    if any(_stmt_key(s) == wanted for s in body):
        return source
    wanted_code = _stmt_key(new_stmt)
    siblings = [i for i, s in enumerate(body) if _is_import_line(s) and _same_import_group(s, new_stmt)]
    if siblings:
        # Keep a group of like lines (one per registered package) sorted, so the file does
        # not depend on the order in which packages were added.
        later = [i for i in siblings if _stmt_key(body[i]) > wanted_code]
        index = later[0] if later else siblings[-1] + 1
        if isinstance(new_stmt, cst.SimpleStatementLine):
            new_stmt = new_stmt.with_changes(leading_lines=[])
        if later and index == siblings[0]:
            # Take over the blank lines above the group's first line.
            new_stmt = new_stmt.with_changes(leading_lines=body[index].leading_lines)
            body[index] = body[index].with_changes(leading_lines=[])
        body.insert(index, new_stmt)
        return module.with_changes(body=body).code
    last_import = max((i for i, s in enumerate(body) if _is_import_line(s)), default=-1)
    if last_import < 0:
        # after a module docstring, if any
        last_import = 0 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])) else -1
    if isinstance(new_stmt, cst.SimpleStatementLine):
        new_stmt = new_stmt.with_changes(leading_lines=[])
    body.insert(last_import + 1, new_stmt)
    return module.with_changes(body=body).code


def remove_statements(source: str, predicate) -> str:
    """Drop the module-level statements for which ``predicate(code)`` is true."""
    module = _parse(source)
    empty = cst.Module(body=[])
    body = [s for s in module.body if not predicate(_stmt_key(s) if _is_import_line(s) else empty.code_for_node(s))]
    if len(body) == len(module.body):
        return source
    return module.with_changes(body=body).code


# --- dict literals ---------------------------------------------------------------------


def _target_code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


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
        return _target_code(stmt.body[0].value)
    return None


def statements(suite: cst.BaseSuite) -> list[cst.BaseStatement]:
    """The statements of an indented block (a class or function body written on one line,
    ``class A: pass``, has none the edits could match)."""
    if not isinstance(suite, cst.IndentedBlock):
        raise CodemodError(f"expected an indented block, found {_target_code(suite).strip()!r}")
    return list(suite.body)


def replaced_code(
    module: cst.Module, old: cst.CSTNode, new: cst.CSTNode | cst.RemovalSentinel | cst.FlattenSentinel[Any]
) -> str:
    """The code of ``module`` with ``old`` replaced by ``new`` (a node inside the module,
    so the result is a module again). ``new`` may come from ``node.visit(transformer)``,
    typed as possibly removing the node; the transformers here never do."""
    if not isinstance(new, cst.CSTNode):
        raise CodemodError(f"internal error: a transform removed {_target_code(old).strip()[:60]!r}")
    result = replace_node(module, old, new)
    if not isinstance(result, cst.Module):  # only when old is the module itself
        raise CodemodError("internal error: a replacement inside a module did not return a module")
    return result.code


def replace_node(root: cst.CSTNode, old: cst.CSTNode, new: cst.CSTNode) -> cst.CSTNode:
    """``root`` with the node ``old`` (found by identity) replaced by ``new``.

    What libcst's ``deep_replace`` returns, built by rebuilding only ``old``'s ancestors:
    ``deep_replace`` rebuilds every node of the tree, and a port makes hundreds of edits to
    modules of a few thousand nodes (a quarter of an edit's time went there).
    """
    if root is old:
        return new
    path = _path_to(root, old)
    if path is None:
        raise CodemodError(f"internal error: {_target_code(old).strip()[:60]!r} is not inside the module edited")
    node = new
    for parent, name, index in reversed(path):
        if index is None:
            value: Any = node
        else:
            items = getattr(parent, name)
            value = (*items[:index], node, *items[index + 1 :])
        node = parent.with_changes(**{name: value})
    return node


def _path_to(root: cst.CSTNode, target: cst.CSTNode) -> list[tuple[cst.CSTNode, str, int | None]] | None:
    """The (parent, field, index in a sequence field or None) steps from ``root`` to ``target``."""
    stack: list[tuple[cst.CSTNode, list[tuple[cst.CSTNode, str, int | None]]]] = [(root, [])]
    while stack:
        node, path = stack.pop()
        for name in _child_fields(type(node)):
            value = getattr(node, name)
            if isinstance(value, cst.CSTNode):
                step = [*path, (node, name, None)]
                if value is target:
                    return step
                stack.append((value, step))
            elif isinstance(value, (tuple, list)):
                for index, item in enumerate(value):
                    if isinstance(item, cst.CSTNode):
                        step = [*path, (node, name, index)]
                        if item is target:
                            return step
                        stack.append((item, step))
    return None


_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def _child_fields(cls: type) -> tuple[str, ...]:
    fields = _CHILD_FIELDS.get(cls)
    if fields is None:
        fields = _CHILD_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))
    return fields


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

    class _Finder(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            if isinstance(node.value, cst.Dict) and any(_target_code(t.target) == target for t in node.targets):
                found.append(node.value)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            if isinstance(node.value, cst.Dict) and _target_code(node.target) == target:
                found.append(node.value)

    module.visit(_Finder())
    if not found:
        raise CodemodError(f"no dict literal assigned to {target!r}")
    if len(found) > 1:
        raise CodemodError(f"{len(found)} dict literals are assigned to {target!r}; expected one")
    return found[0]


def read_dict_literal(source: str, target: str) -> dict[str, str | None]:
    """The string-keyed entries of the dict literal assigned to ``target``."""
    result: dict[str, str | None] = {}
    for element in _find_dict_literal(_parse(source), target).elements:
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
    source: str,
    target: str,
    set_entries: Mapping[str, str | None] | None = None,
    remove: Iterable[str] = (),
    *,
    raw_values: bool = False,
) -> str:
    """Set, add or remove string entries of the dict literal assigned to ``target``.

    Existing entries keep their place, comments and layout; new entries are appended
    with the layout of the last one. Returns ``source`` unchanged when nothing differs.
    With ``raw_values`` the values are expression sources (``"SequenceParallel()"``).
    """
    set_entries = dict(set_entries or {})
    remove = set(remove)
    if raw_values:

        def make_value(value: str | None) -> cst.BaseExpression:
            return cst.parse_expression(value or "None")

        def holds(node: cst.BaseExpression, value: str | None) -> bool:
            return _target_code(node) == _target_code(make_value(value))

    else:
        make_value = _literal

        def holds(node: cst.BaseExpression, value: str | None) -> bool:
            if m.matches(node, m.Name("None")):
                return value is None
            return _string_value(node) == value

    module = _parse(source)
    original = _find_dict_literal(module, target)
    elements: list[cst.BaseDictElement] = []
    origins: list[int | None] = []
    seen: set[str] = set()
    changed = False
    for position, element in enumerate(original.elements):
        key = _string_value(element.key) if isinstance(element, cst.DictElement) else None
        if key is not None and key in remove:
            changed = True
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
        return source
    elements = _relayout_commas(original, elements, origins)
    new_dict = original.with_changes(elements=elements)
    return replaced_code(module, original, new_dict)


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


def _find_class(module: cst.Module, class_name: str) -> cst.ClassDef:
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == class_name:
            return stmt
    raise CodemodError(f"no top-level class {class_name!r}")


def has_class(source: str, class_name: str) -> bool:
    return any(isinstance(s, cst.ClassDef) and s.name.value == class_name for s in _parse(source).body)


def _find_function(module: cst.Module, class_name: str | None, func_name: str) -> cst.FunctionDef:
    scope: Sequence[cst.CSTNode] = (
        module.body if class_name is None else statements(_find_class(module, class_name).body)
    )
    for stmt in scope:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == func_name:
            return stmt
    where = "module" if class_name is None else f"class {class_name}"
    raise CodemodError(f"no function {func_name!r} in {where}")


def replace_function(source: str, class_name: str | None, func_name: str, new_source: str) -> str:
    """Replace one function or method (decorators included) by ``new_source``.

    ``new_source`` is written at column 0; a method is re-indented by libcst.
    """
    module = _parse(source)
    old = _find_function(module, class_name, func_name)
    new = _parse_def(new_source, in_class=class_name is not None)
    if not isinstance(new, cst.FunctionDef):
        raise CodemodError(f"replacement for {func_name!r} is not a function definition")
    new = new.with_changes(leading_lines=old.leading_lines)
    if _target_code(new.with_changes(leading_lines=[])) == _target_code(old.with_changes(leading_lines=[])):
        return source
    return replaced_code(module, old, new)


def _parse_def(new_source: str, *, in_class: bool) -> cst.BaseStatement:
    """Parse a definition written at column 0; a method is parsed inside a class body so
    that multi-line strings (docstrings) keep the indentation they are written with."""
    if not in_class:
        return cst.parse_statement(new_source)
    indented = "".join(("    " + line) if line.strip() else line for line in new_source.splitlines(keepends=True))
    wrapper = cst.parse_statement("class _Wrapper:\n" + indented)
    assert isinstance(wrapper, cst.ClassDef)
    return statements(wrapper.body)[0]


def replace_class(source: str, class_name: str, new_source: str, *, new_name: str | None = None) -> str:
    """Replace a top-level class by ``new_source`` (which may define another name)."""
    module = _parse(source)
    old = _find_class(module, class_name)
    new = cst.parse_statement(new_source)
    if not isinstance(new, cst.ClassDef):
        raise CodemodError(f"replacement for class {class_name!r} is not a class definition")
    new = new.with_changes(leading_lines=old.leading_lines)
    if _target_code(new) == _target_code(old):
        return source
    return replaced_code(module, old, new)


def insert_before_class(source: str, anchor: str, new_source: str) -> str:
    """Insert top-level statements before class ``anchor`` unless a class they define exists."""
    module = _parse(source)
    new_module = _parse(new_source)
    existing = {s.name.value for s in module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))}
    new_stmts = [
        s for s in new_module.body if not (isinstance(s, (cst.ClassDef, cst.FunctionDef)) and s.name.value in existing)
    ]
    if not new_stmts:
        return source
    body = list(module.body)
    index = body.index(_find_class(module, anchor))
    spaced = [
        s.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        if isinstance(s, (cst.ClassDef, cst.FunctionDef))
        else s
        for s in new_stmts
    ]
    body[index:index] = spaced
    return module.with_changes(body=body).code


def remove_class(source: str, class_name: str) -> str:
    module = _parse(source)
    try:
        old = _find_class(module, class_name)
    except CodemodError:
        return source
    return module.with_changes(body=[s for s in module.body if s is not old]).code


def replace_in_function(source: str, class_name: str | None, func_name: str, old: str, new: str) -> str:
    """Replace one statement (matched by its code, ignoring layout) inside a function body.

    ``old`` and ``new`` are single statements; ``new`` may be several lines or empty
    (the statement is removed). Already-applied edits are a no-op.
    """
    module = _parse(source)
    func = _find_function(module, class_name, func_name)
    wanted = _stmt_key(cst.parse_statement(old))
    replacement = _parse_statements(new) if new.strip() else []
    replacement_keys = [_stmt_key(s) for s in replacement]

    class _Swap(cst.CSTTransformer):
        hits = 0

        def leave_IndentedBlock(
            self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
        ) -> cst.IndentedBlock:
            body: list[cst.BaseStatement] = []
            carried: Sequence[cst.EmptyLine] | None = None
            for stmt in updated_node.body:
                if _stmt_key(stmt) == wanted:
                    self.hits += 1
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
                    if carried is not None and hasattr(stmt, "leading_lines") and not stmt.leading_lines:
                        stmt = stmt.with_changes(leading_lines=carried)
                    carried = None
                    body.append(stmt)
            return updated_node.with_changes(body=body)

    swap = _Swap()
    new_func = func.visit(swap)
    if swap.hits == 0:
        keys = [_stmt_key(s) for s in statements(func.body)]
        if not replacement_keys or all(k in _all_stmt_keys(func) for k in replacement_keys):
            return source  # already applied
        raise CodemodError(f"statement {old.strip()!r} not found in {func_name!r}; found: {keys}")
    return replaced_code(module, func, new_func)


def _parse_statements(source: str) -> list[cst.BaseStatement]:
    """Statements of ``source`` with a leading comment kept on the first one (a bare parse
    would move it into the module header and lose it)."""
    body: list[cst.BaseStatement] = list(cst.parse_module("pass\n" + source).body)
    return body[1:]


def _all_stmt_keys(node: cst.CSTNode) -> set[str]:
    keys: set[str] = set()

    class _Collect(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, n):
            keys.add(_stmt_key(n))

        def visit_If(self, n):
            keys.add(_stmt_key(n))

        def visit_For(self, n):
            keys.add(_stmt_key(n))

    node.visit(_Collect())
    return keys


def class_field_names(source: str, class_name: str) -> list[str]:
    """Annotated field names of a (dataclass) class, in order."""
    cls = _find_class(_parse(source), class_name)
    names = []
    for stmt in statements(cls.body):
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                    names.append(small.target.value)
    return names


def set_class_fields(
    source: str,
    class_name: str,
    fields: Mapping[str, str],
    remove: Iterable[str] = (),
) -> str:
    """Set annotated class fields: ``{"name": "int = 4"}``; add missing ones after the last field.

    Fields named in ``remove`` are dropped. Existing fields keep their comments.
    """
    remove = set(remove)
    module = _parse(source)
    cls = _find_class(module, class_name)
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
            if _stmt_key(new_stmt) != _stmt_key(stmt):
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
        return source
    new_cls = cls.with_changes(body=cls.body.with_changes(body=new_body))
    return replaced_code(module, cls, new_cls)


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


def top_level_names(source: str) -> list[str]:
    """Names of top-level classes and functions."""
    return [s.name.value for s in _parse(source).body if isinstance(s, (cst.ClassDef, cst.FunctionDef))]


def _call_name(call: cst.Call) -> str:
    return _target_code(call.func)


def get_call_kwarg(source: str, func_name: str, kwarg: str) -> str | None:
    """The source of keyword ``kwarg`` in the first call to ``func_name``, or ``None``."""
    found: list[str] = []

    class _Finder(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if _call_name(node) == func_name and not found:
                for arg in node.args:
                    if arg.keyword is not None and arg.keyword.value == kwarg:
                        found.append(_target_code(arg.value))

    _parse(source).visit(_Finder())
    return found[0] if found else None


def remove_call_kwarg(source: str, func_name: str, kwarg: str, *, target: str | None = None) -> str:
    """Drop keyword ``kwarg`` from calls to ``func_name`` (only those assigned to ``target``
    when given); the source unchanged when no such call has it."""

    class _Edit(cst.CSTTransformer):
        def __init__(self) -> None:
            super().__init__()
            self._inside: list[bool] = []

        def visit_Assign(self, node: cst.Assign) -> None:
            self._inside.append(target is None or any(_target_code(t.target) == target for t in node.targets))

        def leave_Assign(self, original_node, updated_node):
            self._inside.pop()
            return updated_node

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            self._inside.append(target is None or _target_code(node.target) == target)

        def leave_AnnAssign(self, original_node, updated_node):
            self._inside.pop()
            return updated_node

        def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
            outside = target is not None and not (self._inside and self._inside[-1])
            if _call_name(updated_node) != func_name or outside:
                return updated_node
            kept = [a for a in updated_node.args if a.keyword is None or a.keyword.value != kwarg]
            if len(kept) == len(updated_node.args):
                return updated_node
            if kept:
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated_node.with_changes(args=kept)

    code = _parse(source).visit(_Edit()).code
    return source if code == source else code


def set_call_kwarg(source: str, func_name: str, kwarg: str, value_source: str, *, target: str | None = None) -> str:
    """Set keyword ``kwarg`` to the expression ``value_source`` in calls to ``func_name``.

    With ``target`` only calls assigned to that target (``self.wo``) are edited. A
    missing keyword is appended. Raises ``CodemodError`` when no call matches.
    """
    value = cst.parse_expression(value_source)
    hits = [0]

    class _Edit(cst.CSTTransformer):
        def __init__(self) -> None:
            super().__init__()
            self._inside: list[bool] = []

        def visit_Assign(self, node: cst.Assign) -> None:
            self._inside.append(target is None or any(_target_code(t.target) == target for t in node.targets))

        def leave_Assign(self, original_node, updated_node):
            self._inside.pop()
            return updated_node

        def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
            if _call_name(updated_node) != func_name:
                return updated_node
            if target is not None and not (self._inside and self._inside[-1]):
                return updated_node
            hits[0] += 1
            args = list(updated_node.args)
            for i, arg in enumerate(args):
                if arg.keyword is not None and arg.keyword.value == kwarg:
                    if _target_code(arg.value) != value_source:
                        args[i] = arg.with_changes(value=value)
                    return updated_node.with_changes(args=args)
            if args and isinstance(args[-1].comma, cst.MaybeSentinel):
                args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(
                cst.Arg(
                    value=value,
                    keyword=cst.Name(kwarg),
                    equal=cst.AssignEqual(
                        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                    ),
                )
            )
            return updated_node.with_changes(args=args)

    new = _parse(source).visit(_Edit())
    if hits[0] == 0:
        where = f" assigned to {target}" if target else ""
        raise CodemodError(f"no call to {func_name}{where}")
    code = new.code
    return source if code == source else code


def set_module_assign(source: str, name: str, value_source: str) -> str:
    """Set the value of a module-level ``name = ...`` (plain or annotated) assignment."""
    module = _parse(source)
    value = cst.parse_expression(value_source)
    body = list(module.body)
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
            continue
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and any(_target_code(t.target) == name for t in small.targets):
            if _target_code(small.value) == _target_code(value):
                return source
            body[i] = stmt.with_changes(body=[small.with_changes(value=value)])
            return module.with_changes(body=body).code
        if isinstance(small, cst.AnnAssign) and _target_code(small.target) == name:
            if small.value is not None and _target_code(small.value) == _target_code(value):
                return source
            body[i] = stmt.with_changes(body=[small.with_changes(value=value)])
            return module.with_changes(body=body).code
    raise CodemodError(f"no module-level assignment to {name!r}")


def upsert_function(source: str, func_name: str, new_source: str, *, before_class: str | None = None) -> str:
    """Replace module-level function ``func_name``, or insert it (before ``before_class``
    or at the end) when the module has none."""
    module = _parse(source)
    if any(isinstance(s, cst.FunctionDef) and s.name.value == func_name for s in module.body):
        return replace_function(source, None, func_name, new_source)
    if before_class is not None:
        return insert_before_class(source, before_class, new_source)
    new = cst.parse_statement(new_source).with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    return module.with_changes(body=[*module.body, new]).code


def replace_return(source: str, class_name: str | None, func_name: str, target: str, new_source: str) -> str:
    """In ``func_name``, turn the last top-level ``return <expr>`` into ``<target> = <expr>``
    followed by the statements of ``new_source`` (which return in its place)."""
    module = _parse(source)
    func = _find_function(module, class_name, func_name)
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
    return replaced_code(module, func, func.with_changes(body=func.body.with_changes(body=body)))


def append_statements(source: str, new_source: str) -> str:
    """Append top-level statements at the end of the module, two blank lines before the
    first (a leading comment stays with it)."""
    module = _parse(source)
    new_stmts = _parse_statements(new_source)
    if not new_stmts:
        return source
    first = new_stmts[0]
    new_stmts[0] = first.with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *leading_lines(first)])
    return module.with_changes(body=[*module.body, *new_stmts]).code


def set_docstring(source: str, class_name: str | None, text: str) -> str:
    """Set the docstring of the module (``class_name=None``) or of a top-level class."""
    module = _parse(source)
    literal = '"""' + text.replace('"""', '\\"\\"\\"') + '"""'
    doc_stmt = cst.SimpleStatementLine(body=[cst.Expr(cst.SimpleString(literal))])
    docstring_pattern = m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())])
    body: list[cst.BaseStatement]
    if class_name is None:
        body = list(module.body)
        if body and isinstance(body[0], cst.SimpleStatementLine) and m.matches(body[0], docstring_pattern):
            if _docstring_code(body[0]) == literal:
                return source
            body[0] = body[0].with_changes(body=doc_stmt.body)
        else:
            body.insert(0, doc_stmt)
        return module.with_changes(body=body).code
    cls = _find_class(module, class_name)
    body = statements(cls.body)
    if body and isinstance(body[0], cst.SimpleStatementLine) and m.matches(body[0], docstring_pattern):
        if _docstring_code(body[0]) == literal:
            return source
        body[0] = body[0].with_changes(body=doc_stmt.body)
    else:
        body.insert(0, doc_stmt)
    return replaced_code(module, cls, cls.with_changes(body=cls.body.with_changes(body=body)))


def read_all(source: str) -> list[str]:
    """The names of the module's ``__all__`` list or tuple literal (``[]`` without one)."""
    for stmt in _parse(source).body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            small = stmt.body[0]
            if (
                isinstance(small, cst.Assign)
                and any(_target_code(t.target) == "__all__" for t in small.targets)
                and isinstance(small.value, (cst.List, cst.Tuple))
            ):
                return [v for e in small.value.elements if (v := _string_value(e.value)) is not None]
    return []


def remove_from_all(source: str, names: Iterable[str]) -> str:
    """Drop ``names`` from the module's ``__all__`` list literal, if present."""
    names = set(names)
    module = _parse(source)
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            small = stmt.body[0]
            if isinstance(small, cst.Assign) and any(_target_code(t.target) == "__all__" for t in small.targets):
                value = small.value
                if isinstance(value, (cst.List, cst.Tuple)):
                    kept = [e for e in value.elements if _string_value(e.value) not in names]
                    if len(kept) == len(value.elements):
                        return source
                    if kept:
                        kept[-1] = kept[-1].with_changes(comma=value.elements[-1].comma)
                    new_value = value.with_changes(elements=kept)
                    return replaced_code(module, value, new_value)
    return source


class _NameSwap(cst.CSTTransformer):
    def __init__(self, old: str, new: cst.BaseExpression):
        super().__init__()
        self.old, self.new = old, new

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name):
        return self.new if updated_node.value == self.old else updated_node

    def leave_Attribute(self, original_node, updated_node):
        # never swap an attribute's member name (x.RMSNorm stays)
        if isinstance(original_node.attr, cst.Name) and original_node.attr.value == self.old:
            return updated_node.with_changes(attr=original_node.attr)
        return updated_node


def replace_name(source: str, old: str, new_expression: str) -> str:
    """Replace every use of the bare name ``old`` by ``new_expression`` (``RMSNorm`` -> ``nn.LayerNorm``)."""
    module = _parse(source)
    return module.visit(_NameSwap(old, cst.parse_expression(new_expression))).code


def _assigns_target(node: cst.CSTNode, target: str) -> bool:
    found = [False]

    class _Find(cst.CSTVisitor):
        def visit_Assign(self, n: cst.Assign) -> None:
            if any(_target_code(t.target) == target for t in n.targets):
                found[0] = True

        def visit_AnnAssign(self, n: cst.AnnAssign) -> None:
            if _target_code(n.target) == target:
                found[0] = True

    node.visit(_Find())
    return found[0]


def replace_statement_assigning(
    source: str, class_name: str | None, func_name: str, target: str, new_source: str
) -> str:
    """Replace the top-level statement of a function body that assigns ``target``
    (a plain assignment or an ``if`` choosing between assignments) by ``new_source``."""
    module = _parse(source)
    func = _find_function(module, class_name, func_name)
    body = statements(func.body)
    replacement = _parse_statements(new_source)
    for i, stmt in enumerate(body):
        if _assigns_target(stmt, target):
            if [_stmt_key(s) for s in replacement] == [_stmt_key(stmt)]:
                return source
            replacement[0] = replacement[0].with_changes(
                leading_lines=[*leading_lines(stmt), *leading_lines(replacement[0])]
            )
            body[i : i + 1] = replacement
            new_func = func.with_changes(body=func.body.with_changes(body=body))
            return replaced_code(module, func, new_func)
    raise CodemodError(f"no statement assigning {target} in {func_name!r}")


def prune_unused_imports(source: str) -> str:
    """Drop names imported with ``from x import a, b`` that the module never uses."""
    module = _parse(source)
    used: set[str] = set()

    class _Uses(cst.CSTVisitor):
        def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
            return False

        def visit_Name(self, node: cst.Name) -> None:
            used.add(node.value)

        def visit_SimpleString(self, node: cst.SimpleString) -> None:
            value = _string_value(node)
            if value and value.isidentifier():
                used.add(value)  # names listed in __all__

    module.visit(_Uses())
    body = []
    changed = False
    carried: Sequence[cst.EmptyLine] | None = None
    for stmt in module.body:
        if carried is not None and hasattr(stmt, "leading_lines") and not stmt.leading_lines:
            stmt = stmt.with_changes(leading_lines=carried)
        carried = None
        imp = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
        if (
            isinstance(stmt, cst.SimpleStatementLine)
            and isinstance(imp, cst.ImportFrom)
            and not isinstance(imp.names, cst.ImportStar)
            and (imp.module is None or _target_code(imp.module) != "__future__")
        ):
            kept = [a for a in imp.names if _target_code(a.asname.name if a.asname else a.name) in used]
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
    return module.with_changes(body=body).code if changed else source


def add_parameter(source: str, class_name: str | None, func_name: str, param_source: str) -> str:
    """Append a parameter (``"sliding_window: int | None = None"``) to a function's signature."""
    module = _parse(source)
    func = _find_function(module, class_name, func_name)
    probe = cst.parse_statement(f"def _probe({param_source}): pass")
    assert isinstance(probe, cst.FunctionDef)
    param = probe.params.params[0] if probe.params.params else probe.params.kwonly_params[0]
    if any(p.name.value == param.name.value for p in (*func.params.params, *func.params.kwonly_params)):
        return source
    params = list(func.params.params)
    if params:
        params[-1] = params[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    params.append(param)
    new_func = func.with_changes(params=func.params.with_changes(params=params))
    return replaced_code(module, func, new_func)


def remove_function(source: str, func_name: str) -> str:
    """Drop a module-level function, if present."""
    module = _parse(source)
    body = [s for s in module.body if not (isinstance(s, cst.FunctionDef) and s.name.value == func_name)]
    return source if len(body) == len(module.body) else module.with_changes(body=body).code


def remove_method(source: str, class_name: str, func_name: str) -> str:
    """Drop a method of a top-level class, if present."""
    module = _parse(source)
    cls = _find_class(module, class_name)
    body = [s for s in cls.body.body if not (isinstance(s, cst.FunctionDef) and s.name.value == func_name)]
    if len(body) == len(cls.body.body):
        return source
    return replaced_code(module, cls, cls.with_changes(body=cls.body.with_changes(body=body)))


def insert_after_statement_assigning(
    source: str, class_name: str | None, func_name: str, target: str, new_source: str
) -> str:
    """Insert statements right after the top-level statement of a function that assigns
    ``target``; a no-op when the first new statement is already there."""
    module = _parse(source)
    func = _find_function(module, class_name, func_name)
    body = statements(func.body)
    new_stmts = _parse_statements(new_source)
    keys = {_stmt_key(s) for s in body}
    if _stmt_key(new_stmts[0]) in keys:
        return source
    for i, stmt in enumerate(body):
        if _assigns_target(stmt, target):
            body[i + 1 : i + 1] = new_stmts
            new_func = func.with_changes(body=func.body.with_changes(body=body))
            return replaced_code(module, func, new_func)
    raise CodemodError(f"no statement assigning {target} in {func_name!r}")


def insert_class_statement_after(source: str, class_name: str, target: str, new_source: str) -> str:
    """Put one class-body statement right after the one assigning ``target``; when a
    statement assigning the same name already exists it is replaced (a no-op if equal)."""
    module = _parse(source)
    cls = _find_class(module, class_name)
    new_stmts = _parse_statements(new_source)
    if len(new_stmts) != 1:
        raise CodemodError("insert_class_statement_after takes exactly one statement")
    new = new_stmts[0]
    new_target = next(
        (_target_code(n.target) for n in getattr(new, "body", []) if isinstance(n, cst.AnnAssign)),
        None,
    ) or next((_target_code(n.targets[0].target) for n in getattr(new, "body", []) if isinstance(n, cst.Assign)), None)
    body = statements(cls.body)
    if new_target is not None:
        for i, stmt in enumerate(body):
            if isinstance(stmt, cst.SimpleStatementLine) and _assigns_target(stmt, new_target):
                if _stmt_key(stmt) == _stmt_key(new):
                    return source
                body[i] = new.with_changes(leading_lines=stmt.leading_lines)
                return replaced_code(module, cls, cls.with_changes(body=cls.body.with_changes(body=body)))
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and _assigns_target(stmt, target):
            body[i + 1 : i + 1] = [new]
            return replaced_code(module, cls, cls.with_changes(body=cls.body.with_changes(body=body)))
    raise CodemodError(f"no class-level statement assigning {target} in class {class_name!r}")


def upsert_method(source: str, class_name: str, func_name: str, new_source: str, *, after: str | None = None) -> str:
    """Replace method ``func_name`` of ``class_name``, or insert it after method ``after``
    (at the end of the class when ``after`` is None or absent)."""
    module = _parse(source)
    cls = _find_class(module, class_name)
    if any(isinstance(s, cst.FunctionDef) and s.name.value == func_name for s in statements(cls.body)):
        return replace_function(source, class_name, func_name, new_source)
    new = _parse_def(new_source, in_class=True).with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    body = statements(cls.body)
    index = len(body)
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == after:
            index = i + 1
    body[index:index] = [new]
    return replaced_code(module, cls, cls.with_changes(body=cls.body.with_changes(body=body)))
