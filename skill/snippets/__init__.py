"""Code the porting edits insert into generated packages, kept as real Python.

Each module here is ordinary, importable, linted and tested code (``tests/skill/
test_attention_kernels.py``, ``test_moe_experts.py``, ``test_moe_routers.py`` and others run
them against plain reference computations and HF's modules). An edit
never holds the code it inserts in a string: it asks :func:`snippet` for the source of
a class or function defined here, so what a generated package contains is exactly what
was tested.

The package sits beside ``skill.analysis`` and ``skill.porting``, in neither: the analysis
measures HF's modules against these same functions (ALiBi slopes, sinusoidal tables, the
differential lambda, clamped SwiGLU) and the porting edits insert them, so neither side
imports the other for them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import libcst as cst

from skill.codemod.cst import CodemodError

HERE = Path(__file__).parent


@functools.cache
def _parsed(path: Path) -> cst.Module:
    if not path.is_file():
        raise CodemodError(f"no snippet module {path.stem!r} in {path.parent}")
    return cst.parse_module(path.read_text())


def _module(name: str) -> cst.Module:
    return _parsed(HERE / f"{name}.py")


class _ExactRenamer(cst.CSTTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        new = self.names.get(updated_node.value)
        return updated_node.with_changes(value=new) if new else updated_node


def snippet(module: str, name: str, *, rename: str | None = None, names: dict[str, str] | None = None) -> str:
    """The source of top-level class or function ``name`` of ``snippets/<module>.py``,
    optionally renamed (``rename``) and with the names it uses renamed exactly
    (``names``: ``{"interleaved_rotate_half": "rotate_half"}``), no leading blank lines."""
    return _definition(_module(module), module, name, rename, names)


def snippet_in(path: Path, name: str, *, rename: str | None = None) -> str:
    """:func:`snippet` from the module file ``path`` (a feature module keeps the code it
    inserts beside its edit: skill.feature_modules)."""
    return _definition(_parsed(path), path.stem, name, rename, None)


def _definition(tree: cst.Module, module: str, name: str, rename: str | None, names: dict[str, str] | None) -> str:
    for stmt in tree.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)) and stmt.name.value == name:
            node = stmt.with_changes(leading_lines=[])
            if names:
                renamed = node.visit(_ExactRenamer(names))
                if not isinstance(renamed, (cst.ClassDef, cst.FunctionDef)):
                    raise CodemodError(f"snippets/{module}.py: renaming {name} removed it")
                node = renamed
            if rename is not None:
                node = node.with_changes(name=cst.Name(rename))
            return tree.code_for_node(node)
    raise CodemodError(f"snippets/{module}.py defines no {name!r}")


def snippet_method(module: str, class_name: str, name: str) -> str:
    """The source of method ``name`` of top-level class ``class_name`` of
    ``snippets/<module>.py``, dedented to column 0, no leading blank lines."""
    tree = _module(module)
    for stmt in tree.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == class_name:
            for inner in stmt.body.body:
                if isinstance(inner, cst.FunctionDef) and inner.name.value == name:
                    return cst.Module(body=[inner.with_changes(leading_lines=[])]).code
    raise CodemodError(f"snippets/{module}.py defines no {class_name}.{name}")
