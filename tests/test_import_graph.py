"""The import graph of the engine (``skill``) and the MCP face (``mcp_server``).

Built with ``ast`` from the source, nothing imported. Module-level imports (including
those under ``try``/``if`` at module level, except ``if TYPE_CHECKING:`` blocks, which
never run) form the graph that must be acyclic; imports inside functions are collected
separately, so a cycle cannot hide behind a deferred import either: the two known
cycles (``skill.session`` <-> ``skill.tools``, ``skill.analysis.analyze`` <->
``skill.analysis.reference``) were broken by layering, not by deferring.

The engine never imports the MCP face at module level. The one allowed function-level
import is the CLI's ``serve`` command starting the server (``skill.cli.serve`` ->
``mcp_server.main``), listed below: the CLI is a face too, and ``archon-port serve`` is how
it starts the other one. The MCP face never imports the CLI: what both faces share (the
serve options, the bind and token rules, the one-line errors and exit statuses) is the
engine's (``skill.serving``, ``skill.console``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("skill", "mcp_server")

# Function-level imports of mcp_server from skill: (importing module, imported module).
ALLOWED_ENGINE_TO_MCP = {("skill.cli.serve", "mcp_server.main")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(module-level, function-level) imports of ``module`` among ``known`` modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    top: set[str] = set()
    deferred: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> set[str]:
        found: set[str] = set()
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _resolve(module, is_package, node)
            # ``from pkg import sub`` is an edge to the submodule when there is one (its
            # package is already being imported), else to ``pkg`` itself.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for name in names:
            # The module itself or its nearest known parent (``import a.b.c`` runs a/__init__ too).
            parts = name.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != module:
                found.add(".".join(parts))
        return found

    def visit(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (deferred if in_function else top).update(targets(node))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, True)
            elif isinstance(node, ast.If) and not in_function and _is_type_checking(node):
                visit(node.orelse, in_function)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], in_function)
                    elif isinstance(child, ast.excepthandler):
                        visit(child.body, in_function)

    visit(tree.body, False)
    return top, deferred - top


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    known = set(modules)
    top: dict[str, set[str]] = {}
    deferred: dict[str, set[str]] = {}
    for name, path in modules.items():
        top[name], deferred[name] = _imports(name, path, known)
    return top, deferred


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def test_the_graph_sees_the_modules_and_their_imports():
    top, deferred = _graph()
    assert "skill.tools" in top and "mcp_server.server" in top
    assert "skill.codemod.workspace" in top["skill.tools"]
    assert "mcp_server.main" in deferred["skill.cli.serve"]


def test_no_cycle_among_module_level_imports():
    top, _ = _graph()
    assert _cycles(top) == [], "import cycles among module-level imports"


def test_no_cycle_even_through_function_level_imports():
    top, deferred = _graph()
    merged = {m: top[m] | deferred[m] for m in top}
    # skill.cli.serve -> mcp_server -> skill.* is the one expected loop: the CLI starts the server.
    for a, b in ALLOWED_ENGINE_TO_MCP:
        merged[a] = merged[a] - {b}
    assert _cycles(merged) == [], "import cycles through deferred imports"


def test_the_engine_does_not_import_the_mcp_face():
    top, deferred = _graph()
    at_module_level = sorted(
        (m, t) for m, ts in top.items() if m.startswith("skill") for t in ts if t.startswith("mcp_server")
    )
    assert at_module_level == []
    in_functions = {
        (m, t) for m, ts in deferred.items() if m.startswith("skill") for t in ts if t.startswith("mcp_server")
    }
    assert in_functions <= ALLOWED_ENGINE_TO_MCP, sorted(in_functions - ALLOWED_ENGINE_TO_MCP)


def test_the_mcp_face_does_not_import_the_cli():
    """Neither at module level nor in a function: the faces share only the engine."""
    top, deferred = _graph()
    from_mcp = sorted(
        (m, t)
        for graph in (top, deferred)
        for m, ts in graph.items()
        if m.startswith("mcp_server")
        for t in ts
        if t == "skill.cli" or t.startswith("skill.cli.")
    )
    assert from_mcp == []
