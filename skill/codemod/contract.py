"""Edits addressed to the Archon module contract rather than to a reference's text.

Both references (and every package copied from them) share one contract: a
``TransformerBlock`` whose ``forward`` adds an attention branch and a feed-forward (or
MoE) branch to the residual stream, ``x + <branch>``; a model class whose ``forward``
embeds tokens and ends by applying ``head`` (``output`` or a critic's ``score``). The
helpers here find those places by their structure (a residual add whose branch calls
``self.attention``; the return that applies ``head``), so two edits on the same place
compose in any combination, on either reference, whatever the other has written.
"""

from __future__ import annotations

from typing import Literal

import libcst as cst
import libcst.matchers as m

from skill.codemod.cst import CodemodError, Document, find_function, leading_lines, replace_in_function, statements
from skill.codemod.document import node_code

Branch = Literal["attention", "ffn"]
RESIDUAL = "x"


def _calls_attention(node: cst.CSTNode) -> bool:
    return bool(m.findall(node, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("attention")))))


def _is_residual_sum(value: cst.BaseExpression) -> bool:
    """``x + E``, or ``x + E1 + E2`` (a parallel block's one sum of both branches)."""
    if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add)):
        return False
    return m.matches(value.left, m.Name(RESIDUAL)) or _is_residual_sum(value.left)


def _branch_of(value: cst.BaseExpression) -> tuple[Branch, cst.BaseExpression] | None:
    """``x + E`` (or the last term ``E`` of ``x + ... + E``) -> (which branch E is, E);
    anything else -> None."""
    if _is_residual_sum(value):
        assert isinstance(value, cst.BinaryOperation)
        return ("attention" if _calls_attention(value.right) else "ffn"), value.right
    return None


def _normalised_sum(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """``self.<norm>(x + E)`` (a post-LN block's normalised residual sum) -> ``x + E``."""
    if (
        isinstance(value, cst.Call)
        and len(value.args) == 1
        and m.matches(value.func, m.Attribute(value=m.Name("self")))
        and _is_residual_sum(value.args[0].value)
    ):
        return value.args[0].value
    return None


class _BranchEdit(cst.CSTTransformer):
    def __init__(self, branch: Branch, edit):
        self.branch = branch
        self.edit = edit
        self.hits = 0

    def _rewrite(self, value: cst.BaseExpression) -> cst.BaseExpression:
        inner = _normalised_sum(value)
        if inner is not None:
            assert isinstance(value, cst.Call)
            return value.with_changes(args=[value.args[0].with_changes(value=self._rewrite(inner))])
        found = _branch_of(value)
        if found is None:
            return value
        assert isinstance(value, cst.BinaryOperation)
        left = self._rewrite(value.left) if isinstance(value.left, cst.BinaryOperation) else value.left
        if found[0] != self.branch:
            return value.with_changes(left=left)
        self.hits += 1
        return value.with_changes(left=left, right=self.edit(found[1]))

    def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
        if len(updated_node.targets) == 1 and m.matches(updated_node.targets[0].target, m.Name(RESIDUAL)):
            return updated_node.with_changes(value=self._rewrite(updated_node.value))
        return updated_node

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> cst.Return:
        if updated_node.value is not None:
            return updated_node.with_changes(value=self._rewrite(updated_node.value))
        return updated_node


def _edit_branch(doc: Document, branch: Branch, edit) -> Document:
    forward = find_function(doc.module, "TransformerBlock", "forward")
    transformer = _BranchEdit(branch, edit)
    new_forward = forward.visit(transformer)
    if transformer.hits == 0:
        raise CodemodError(f"TransformerBlock.forward has no residual add 'x + ...' for the {branch} branch")
    return doc.replaced(forward, new_forward)


def wrap_residual_branch(doc: Document, branch: Branch, template: str, *, applied_if: str) -> Document:
    """Rewrite a residual branch ``E`` as ``template`` with ``{}`` standing for ``E``
    (``"self.post_attention_norm({})"``, ``"{} * self.residual_multiplier"``).

    A branch that already mentions ``applied_if`` is left alone (the edit ran before).
    """

    def edit(expr: cst.BaseExpression) -> cst.BaseExpression:
        code = node_code(expr)
        if applied_if in code:
            return expr
        if isinstance(expr, (cst.BinaryOperation, cst.BooleanOperation, cst.IfExp)):
            code = f"({code})"
        return cst.parse_expression(template.replace("{}", code))

    return _edit_branch(doc, branch, edit)


def normalise_residual_sum(doc: Document, branch: Branch, norm: str) -> Document:
    """Post-LN: the residual sum of a branch, ``x + E``, becomes ``self.<norm>(x + E)`` (the
    statement assigning ``x`` or returning it). The branches inside keep whatever other
    edits write there (:func:`wrap_residual_branch` sees through the norm); a sum already
    normalised is left alone."""
    forward = find_function(doc.module, "TransformerBlock", "forward")
    hits = [0]

    def wrap(value: cst.BaseExpression) -> cst.BaseExpression:
        inner = _normalised_sum(value)
        found = _branch_of(inner if inner is not None else value)
        if found is None or found[0] != branch:
            return value
        hits[0] += 1
        return value if inner is not None else cst.parse_expression(f"self.{norm}({node_code(value)})")

    class _Wrap(cst.CSTTransformer):
        def leave_Assign(self, original_node: cst.Assign, updated_node: cst.Assign) -> cst.Assign:
            if len(updated_node.targets) == 1 and m.matches(updated_node.targets[0].target, m.Name(RESIDUAL)):
                return updated_node.with_changes(value=wrap(updated_node.value))
            return updated_node

        def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> cst.Return:
            if updated_node.value is not None:
                return updated_node.with_changes(value=wrap(updated_node.value))
            return updated_node

    new_forward = forward.visit(_Wrap())
    if hits[0] == 0:
        raise CodemodError(f"TransformerBlock.forward has no residual add 'x + ...' for the {branch} branch")
    return doc.replaced(forward, new_forward)


def replace_in_residual_branch(doc: Document, branch: Branch, old: str, new: str) -> Document:
    """Replace sub-expression ``old`` (matched by code) inside a residual branch by ``new``."""
    old_code = node_code(cst.parse_expression(old))
    replacement = cst.parse_expression(new)

    class _Swap(cst.CSTTransformer):
        def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
            if node_code(original_node) == old_code:
                return replacement
            return updated_node

    return _edit_branch(doc, branch, lambda expr: expr.visit(_Swap()))


def residual_branch_code(doc: Document, branch: Branch) -> list[str]:
    """The code of every residual branch of that kind (for tests and checks)."""
    forward = find_function(doc.module, "TransformerBlock", "forward")
    found: list[str] = []

    class _Collect(cst.CSTVisitor):
        def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
            hit = _branch_of(node)
            if hit is not None and hit[0] == branch:
                found.append(node_code(hit[1]))

    forward.visit(_Collect())
    return found


def _assigns_residual(stmt: cst.CSTNode) -> cst.BaseExpression | None:
    """The value of ``x = <residual sum>``; None for any other statement."""
    if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name(RESIDUAL))])])):
        assert isinstance(stmt, cst.SimpleStatementLine)
        assign = stmt.body[0]
        assert isinstance(assign, cst.Assign)
        return assign.value if _is_residual_sum(assign.value) else None
    return None


def _residual_value(stmt: cst.CSTNode) -> cst.BaseExpression | None:
    """The residual sum a statement assigns to ``x`` or returns."""
    value = _assigns_residual(stmt)
    if value is None and m.matches(stmt, m.SimpleStatementLine(body=[m.Return()])):
        assert isinstance(stmt, cst.SimpleStatementLine)
        ret = stmt.body[0]
        assert isinstance(ret, cst.Return)
        value = ret.value if ret.value is not None and _is_residual_sum(ret.value) else None
    return value


def _graft(value: cst.BaseExpression, base: cst.BaseExpression) -> cst.BaseExpression:
    """``x + F`` -> ``base + F``: the residual ``x`` at the left end of a sum replaced by ``base``."""
    assert isinstance(value, cst.BinaryOperation)
    if m.matches(value.left, m.Name(RESIDUAL)):
        return value.with_changes(left=base)
    return value.with_changes(left=_graft(value.left, base))


def parallel_branches(doc: Document) -> Document:
    """Both residual branches read the block input: ``x = x + A`` followed by ``x + F``
    becomes one sum, ``x + A + F`` (GPT-J/GPT-NeoX-style parallel attention and MLP).

    Found by structure (the assignment whose sum calls ``self.attention``, then the next
    residual sum); the branches keep whatever other edits wrote inside them. A block
    whose one sum already holds both branches is left alone."""
    forward = find_function(doc.module, "TransformerBlock", "forward")
    body = statements(forward.body)
    values = [_residual_value(stmt) for stmt in body]
    if any(value is not None and len(_branch_terms(value)) > 1 for value in values):
        return doc  # already parallel
    attention = next(
        (i for i, stmt in enumerate(body) if (v := _assigns_residual(stmt)) is not None and _calls_attention(v)), None
    )
    ffn = next(
        (i for i, v in enumerate(values) if attention is not None and i > attention and v is not None),
        None,
    )
    if attention is None or ffn is None:
        raise CodemodError("TransformerBlock.forward has no 'x = x + attention(...)' followed by a residual add")
    attention_sum = values[attention]
    ffn_sum = values[ffn]
    assert attention_sum is not None and ffn_sum is not None
    stmt = body[ffn]
    assert isinstance(stmt, cst.SimpleStatementLine)
    combined = _graft(ffn_sum, attention_sum)
    small = stmt.body[0]
    body[ffn] = stmt.with_changes(body=[small.with_changes(value=combined)])
    first = body.pop(attention)
    body[attention] = body[attention].with_changes(leading_lines=leading_lines(first))
    return doc.replaced(forward, forward.with_changes(body=forward.body.with_changes(body=body)))


def prepend_to_block_forward(doc: Document, statement: str, comment: str) -> Document:
    """Put ``statement`` (one line, under ``# comment``) first in ``TransformerBlock.forward``, once."""
    forward = find_function(doc.module, "TransformerBlock", "forward")
    body = statements(forward.body)
    code = node_code(cst.parse_statement(statement))
    if any(node_code(stmt) == code for stmt in body):
        return doc
    line = cst.EmptyLine(comment=cst.Comment(f"# {comment}"))
    new = cst.parse_statement(statement).with_changes(leading_lines=[line])
    return doc.replaced(forward, forward.with_changes(body=forward.body.with_changes(body=[new, *body])))


def _branch_terms(value: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The branch terms of a residual sum ``x + E1 + ... + En``."""
    terms: list[cst.BaseExpression] = []
    while isinstance(value, cst.BinaryOperation) and _is_residual_sum(value):
        terms.insert(0, value.right)
        value = value.left
    return terms


def replace_call(doc: Document, class_name: str, func_name: str, callee: str, template: str) -> Document:
    """Replace every call ``callee(arg)`` inside ``class_name.func_name`` by ``template``
    with ``{}`` standing for ``arg`` (``F.silu`` -> ``F.gelu({}, approximate="tanh")``)."""
    func = find_function(doc.module, class_name, func_name)
    callee_code = node_code(cst.parse_expression(callee))

    class _Swap(cst.CSTTransformer):
        def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
            if node_code(updated_node.func) == callee_code and len(updated_node.args) == 1:
                return cst.parse_expression(template.replace("{}", node_code(updated_node.args[0].value)))
            return updated_node

    return doc.replaced(func, func.visit(_Swap()))


def add_marker(
    doc: Document, class_name: str | None, func_name: str, comment: str, anchor: str | None = None
) -> Document:
    """Put ``# <comment>`` above the statement of a function that the marker names (once):
    the first statement, at any depth, whose code contains ``anchor``; without an anchor, or
    when no statement holds it, the first statement of the body (after the docstring)."""
    line = f"# {comment}"
    if line in doc:
        return doc
    func = find_function(doc.module, class_name, func_name)
    marker = cst.EmptyLine(comment=cst.Comment(line))
    if anchor is not None:
        text = anchor

        class _Mark(cst.CSTTransformer):
            done = False

            def leave_SimpleStatementLine(
                self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
            ) -> cst.SimpleStatementLine:
                if self.done or text not in node_code(original_node):
                    return updated_node
                self.done = True
                return updated_node.with_changes(leading_lines=[*updated_node.leading_lines, marker])

        transformer = _Mark()
        marked_func = func.visit(transformer)
        if transformer.done:
            return doc.replaced(func, marked_func)
    body = statements(func.body)
    index = 0
    if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])):
        index = 1  # after the docstring
    if index >= len(body):
        raise CodemodError(f"{func_name!r} has no statement to mark")
    first = body[index]
    marked = first.with_changes(leading_lines=[*leading_lines(first), marker])
    body[index] = marked
    return doc.replaced(func, func.with_changes(body=func.body.with_changes(body=body)))


def remove_arguments(doc: Document, class_name: str | None, func_name: str, names: tuple[str, ...]) -> Document:
    """Drop parameters ``names`` from ``class_name.func_name``'s signature (a no-op for
    those it lacks)."""
    func = find_function(doc.module, class_name, func_name)
    params = [p for p in func.params.params if p.name.value not in names]
    if len(params) == len(func.params.params):
        return doc
    if params:
        last = params[-1]
        params[-1] = last.with_changes(comma=cst.MaybeSentinel.DEFAULT) if func.params.star_arg is None else last
    new_func = func.with_changes(params=func.params.with_changes(params=params))
    return doc.replaced(func, new_func)


def remove_call_arguments(
    doc: Document, class_name: str | None, func_name: str, callee: str, args: tuple[str, ...]
) -> Document:
    """Inside ``class_name.func_name``, drop the positional arguments whose code is one of
    ``args`` from every call of ``callee`` (``self.attention``, ``layer``)."""
    func = find_function(doc.module, class_name, func_name)
    callee_code = node_code(cst.parse_expression(callee))

    class _Drop(cst.CSTTransformer):
        def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
            if node_code(updated_node.func) != callee_code:
                return updated_node
            kept = [a for a in updated_node.args if a.keyword is not None or node_code(a.value) not in args]
            if len(kept) == len(updated_node.args):
                return updated_node
            if kept:
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated_node.with_changes(args=kept)

    return doc.replaced(func, func.visit(_Drop()))


EMBED_ONE_LINE = "h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens"


def append_to_embedding_stage(doc: Document, model_class: str, statements_source: str) -> Document:
    """Add statements (rewriting ``h``) at the end of the model's embedding stage: the
    branch that runs when ``tok_embeddings`` exists (the first pipeline stage). The
    reference's one-line embedding becomes that branch first, so embedding edits (a scale,
    learned positions, an embedding norm) compose in the canonical order, each after the
    last. A no-op when the first statement is already there."""
    marker = statements_source.strip().splitlines()[-1]
    if marker in doc:
        return doc
    forward = find_function(doc.module, model_class, "forward")
    new_stmts = list(cst.parse_module("pass\n" + statements_source).body)[1:]

    class _Append(cst.CSTTransformer):
        hits = 0

        def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
            if node_code(updated_node.test) != "self.tok_embeddings is not None":
                return updated_node
            self.hits += 1
            body = [*statements(updated_node.body), *new_stmts]
            return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    def one_line_to_branch(doc: Document) -> Document:
        return replace_in_function(
            doc,
            model_class,
            "forward",
            EMBED_ONE_LINE,
            "if self.tok_embeddings is not None:\n    h = self.tok_embeddings(tokens)\nelse:\n    h = tokens\n",
        )

    transformer = _Append()
    new_forward = forward.visit(transformer)
    if transformer.hits == 0:
        if EMBED_ONE_LINE in doc:
            return append_to_embedding_stage(one_line_to_branch(doc), model_class, statements_source)
        raise CodemodError(f"{model_class}.forward has no 'if self.tok_embeddings is not None:' embedding stage")
    return doc.replaced(forward, new_forward)


def append_to_if_block(
    doc: Document, class_name: str | None, func_name: str, test: str, statements_source: str
) -> Document:
    """Append statements to the body of the top-level ``if <test>:`` of a function (a TP
    plan's ``if model.tok_embeddings is not None:``), after whatever earlier edits put
    there; a no-op when the first new statement is there already."""
    func = find_function(doc.module, class_name, func_name)
    new_stmts = list(cst.parse_module("pass\n" + statements_source).body)[1:]
    first = node_code(new_stmts[0]).strip()
    body = statements(func.body)
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.If) and node_code(stmt.test) == test:
            if any(node_code(s).strip() == first for s in statements(stmt.body)):
                return doc
            block = stmt.body.with_changes(body=[*statements(stmt.body), *new_stmts])
            body[i] = stmt.with_changes(body=block)
            return doc.replaced(func, func.with_changes(body=func.body.with_changes(body=body)))
    raise CodemodError(f"{func_name!r} has no top-level 'if {test}:'")
