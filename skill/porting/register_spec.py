"""Steps 8-9: ``spec.py`` with the package's ModelSpec, and its import line."""

from __future__ import annotations

import ast
import logging

from pydantic import Field, field_validator

from skill.codemod import StagedTree, format_python
from skill.codemod.cst import CodemodError, Document, ensure_import_line, prune_unused_imports, set_call_kwarg
from skill.porting.common import PackageLayout, PackageRequest, StepResult, require_package, staged, write_if_changed

logger = logging.getLogger(__name__)

ARCHON_INIT = "archon_models/__init__.py"

SPEC_TEMPLATE = '''"""Registers the {camel} ModelSpec when imported."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.{package}.infra.parallelize import parallelize_{package}
from archon_models.{package}.model.args import {camel}ModelArgs
from archon_models.{package}.model.model import {camel}Model
from archon_models.{package}.model.state_dict_adapter import {camel}StateDictAdapter

{upper}_SPEC = ModelSpec(
    name="{camel}",
    model_class={camel}Model,
    model_args_class={camel}ModelArgs,
    state_dict_adapter_class={camel}StateDictAdapter,
    parallelize_fn=parallelize_{package},
    supported_model_types=frozenset({types}),
    pipelining_fn=pipeline_llm,
)

register_model_spec({upper}_SPEC)

__all__ = ["{upper}_SPEC"]
'''


class RegisterSpecRequest(PackageRequest):
    model_types: list[str] = Field(
        default_factory=list, description="HF model_type strings the package handles (default: [model_name])"
    )
    source: str | None = Field(
        default=None,
        description="the family's source (as given to the other steps): every generated file then gets the "
        "header naming the engine version, reference, edits and the command that regenerates it",
    )
    trust_remote_code: bool = Field(default=False, description="the source folder's own code (auto_map)")

    @field_validator("model_types")
    @classmethod
    def _valid_types(cls, value: list[str]) -> list[str]:
        for model_type in value:
            if not model_type or not all(c.isalnum() or c in "_-" for c in model_type):
                raise ValueError(f"model_type {model_type!r} is not a HF model_type string (letters, digits, _ or -).")
        return sorted(set(value))


class RegisterSpecResult(StepResult):
    spec_file: str
    import_line: str
    model_types: list[str]


def import_line_for(package: str) -> str:
    return f"from archon_models.{package} import spec as {package}_spec  # noqa: F401"


def types_literal(model_types: list[str]) -> str:
    return "{" + ", ".join(f'"{t}"' for t in sorted(model_types)) + "}"


def _claims(tree: StagedTree) -> list[tuple[str, str]]:
    """(model_type, package) for every type each ``archon_models/*/spec.py`` registers, read statically."""
    claims: list[tuple[str, str]] = []
    for path in tree.list_files("archon_models"):
        parts = path.split("/")
        if len(parts) != 3 or parts[2] != "spec.py":
            continue
        model_types = spec_model_types(tree.read_text(path) or "")
        if model_types is None:
            raise CodemodError(f"cannot parse {path}")
        claims += [(model_type, parts[1]) for model_type in model_types]
    return claims


def registered_types(tree: StagedTree) -> dict[str, str]:
    """model_type -> package, read statically from every ``archon_models/*/spec.py``."""
    return dict(_claims(tree))


def spec_model_types(spec_text: str) -> list[str] | None:
    """The string literals of ``supported_model_types=`` in a spec module's ``ModelSpec(...)``
    (None when the module does not parse). Read with ``ast``: every spec of the library is
    read at each registration."""
    try:
        module = ast.parse(spec_text)
    except SyntaxError:
        return None
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ModelSpec":
            for keyword in node.keywords:
                if keyword.arg == "supported_model_types":
                    return _types_from_literal(keyword.value)
    return []


def _types_from_literal(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Call) and node.args:
        node = node.args[0]
    if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def register_spec(request: RegisterSpecRequest) -> RegisterSpecResult:
    """Write spec.py (ModelSpec + register_model_spec) for archon_models/<model_name>/ and
    add its import line to archon_models/__init__.py. A second call is a no-op; a
    model_type another package already registers is refused."""
    with staged(request.workspace) as tree:
        return apply_register_spec(tree, request)


def check_model_types_free(tree: StagedTree, package: str, model_types: list[str]) -> None:
    """Raise ``ValueError`` when another package's spec registers one of ``model_types``."""
    clashes = {t: p for t, p in _claims(tree) if t in model_types and p != package}
    if clashes:
        listing = ", ".join(f"{t!r} (archon_models/{p}/spec.py)" for t, p in sorted(clashes.items()))
        raise ValueError(
            f"model_type already registered by another package: {listing}. Each model_type belongs to one "
            "ModelSpec; remove it from that package or pick other model_types."
        )


def _set_pipelining_fn(spec_text: str, layout: PackageLayout, parallelize_text: str) -> str:
    """The spec's ``pipelining_fn``: the package's own when its ``infra/parallelize.py``
    defines one (a model with modules around the blocks that AReaL's ``pipeline_llm``
    would drop), else ``pipeline_llm``."""
    own = layout.pipelining_fn
    if f"def {own}(" not in parallelize_text:
        return spec_text
    doc = set_call_kwarg(Document(spec_text), "ModelSpec", "pipelining_fn", own)
    doc = ensure_import_line(doc, f"from archon_models.{layout.names.package}.infra.parallelize import {own}")
    return prune_unused_imports(doc).code


def apply_register_spec(tree: StagedTree, request: RegisterSpecRequest) -> RegisterSpecResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    model_types = request.model_types or [request.model_name]
    names = layout.names
    check_model_types_free(tree, names.package, model_types)
    # Checked again at commit, over what other calls committed meanwhile.
    tree.add_commit_check(lambda view: check_model_types_free(view, names.package, model_types))
    changed: list[str] = []
    current = tree.read_text(layout.spec)
    if current is None:
        text = SPEC_TEMPLATE.format(
            camel=names.camel, package=names.package, upper=names.upper, types=types_literal(model_types)
        )
    else:
        text = set_call_kwarg(
            Document(current), "ModelSpec", "supported_model_types", f"frozenset({types_literal(model_types)})"
        ).code
    text = _set_pipelining_fn(text, layout, tree.read_text(layout.parallelize) or "")
    write_if_changed(tree, layout.spec, text, changed)
    line = import_line_for(names.package)
    init_text = tree.read_text(ARCHON_INIT)
    if init_text is None:
        raise FileNotFoundError(f"{ARCHON_INIT} is missing; the workspace is not an archon-port project.")
    registry = Document(init_text)
    if ensure_import_line(registry, line) is not registry:
        # A function of the registry's content: re-applied on top of another call's import line.
        # Formatted (imports sorted as ruff sorts them) like every file the engine writes.
        tree.update_text(
            ARCHON_INIT, lambda text: format_python(ensure_import_line(Document(text), line).code, ARCHON_INIT)
        )
        changed.append(ARCHON_INIT)
    if request.source is not None:
        from skill.porting.plan import plan_for
        from skill.porting.provenance import stamp_package

        changed += stamp_package(tree, request.model_name, plan_for(request.source, request.trust_remote_code))
    return RegisterSpecResult(
        spec_file=layout.spec, import_line=line, model_types=sorted(model_types), changed_files=sorted(set(changed))
    )
