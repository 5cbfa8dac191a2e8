"""``archon-port export`` (step 11): refusals, dry run, overwrite, the prefix rewrite, and a
real export of llama into a copy of the cached venv's AReaL 1.0.4 with its checks passing."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import anyio
import pytest

from skill.areal.export import ARCHON_DIR, ExportRequest, export_to_areal
from skill.areal.rename import (
    ARCHON_PREFIX,
    AREAL_PREFIX,
    _rewrite_syntax_tree,
    _rewrite_tokens,
    rename_in_text,
    rewrite_prefix,
)
from skill.cli import main
from skill.codemod import Workspace
from skill.codemod.workspace import WorkspaceError
from skill.tools import get_tool, prepare_request
from tests.areal.conftest import AREAL_TREE_GROUP, PROJECT_ROOT, AReaLInstall, ExportedTree, committed_packages

LLAMA_INIT_LINE = "from areal.experimental.models.archon.llama import spec as llama_spec  # noqa: F401"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def areal_copy(areal_install: AReaLInstall, tmp_path: Path) -> Path:
    """A fresh copy of the installed ``areal`` package; the path is the package directory,
    as a user passes an installed AReaL."""
    return areal_install.copy_to(tmp_path / "site") / "areal"


def _export(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["export", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- the prefix rewrite (no AReaL needed) -----------------------------------------------


def test_prefix_rewrite_renames_imports_strings_and_comments():
    source = (
        '"""Llama as in archon_models (see archon_models/qwen2)."""\n'
        "from __future__ import annotations\n"
        "from archon_models.base import BaseModelArgs  # the contract of archon_models.base\n"
        "from archon_models.qwen2.model.rope import (\n"
        "    apply_rotary_emb,  # same formula\n"
        "    precompute_rope_cache,\n"
        ")\n"
        "from archon_models import model_spec\n"
        "from .args import LlamaModelArgs\n"
        "from archon_models_extra.thing import x\n"
        "NAME = 'archon_models.llama'\n"
        'MESSAGE = f"{NAME} is not in archon_models; see archon_models/llama/spec.py"\n'
        "OTHER = 'archon_models_extra and pkg.archon_models'\n"
    )
    out = rewrite_prefix(source)
    assert out == (
        '"""Llama as in areal.experimental.models.archon (see areal/experimental/models/archon/qwen2)."""\n'
        "from __future__ import annotations\n"
        "from areal.experimental.models.archon.base import BaseModelArgs  "
        "# the contract of areal.experimental.models.archon.base\n"
        "from areal.experimental.models.archon.qwen2.model.rope import (\n"
        "    apply_rotary_emb,  # same formula\n"
        "    precompute_rope_cache,\n"
        ")\n"
        "from areal.experimental.models.archon import model_spec\n"
        "from .args import LlamaModelArgs\n"
        "from archon_models_extra.thing import x\n"
        "NAME = 'areal.experimental.models.archon.llama'\n"
        'MESSAGE = f"{NAME} is not in areal.experimental.models.archon; '
        'see areal/experimental/models/archon/llama/spec.py"\n'
        "OTHER = 'archon_models_extra and pkg.archon_models'\n"
    )
    assert rewrite_prefix(out) == out


@AREAL_TREE_GROUP
def test_no_committed_package_names_archon_models_once_exported(areal_exported: ExportedTree):
    # The export of every committed package (its .py files and any other file), into the session's
    # copy of AReaL (the one the tier's checker imports): not one mention of the prefix is left, in
    # code, strings, docstrings or comments, in any file of an exported package or any file written.
    packages = committed_packages()
    files = areal_exported.files
    assert {rel.split("/")[4] for rel in files if rel.count("/") > 4} == set(packages)
    archon = areal_exported.root / ARCHON_DIR
    exported = {
        path.relative_to(areal_exported.root).as_posix(): path.read_text(encoding="utf-8")
        for package in packages
        for path in sorted((archon / package).rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }
    written = {rel: text for rel, text in files.items() if text is not None}
    named = sorted(rel for rel, text in {**exported, **written}.items() if "archon_models" in text)
    assert not named, f"{len(named)} exported files still name archon_models: {named[:10]}"


# Each source names the prefix in one place the token rewrite must treat as libcst does, or
# leave to libcst: (source, whether the token rewrite does it).
PREFIX_PLACES = [
    ("from archon_models.base import X\n", True),
    ("from archon_models import (\n    a,  # archon_models.a\n    b,\n)\n", True),
    ("from archon_models \\\n    .base import X\n", True),
    ("if True: from archon_models.base import X\n", True),
    ("import os; from archon_models.base import X\n", True),
    ("def f():\n    from archon_models.base import X\n    return X\n", True),
    ("from .archon_models import X\nfrom pkg.archon_models import Y\nimport pkg.archon_models\n", True),
    ("from archon_models_extra import X\nfrom archon_modelsx.y import Z\n", True),
    ("X = b'archon_models/qwen2'  # see archon_models/qwen3\nY = r'''archon_models\n archon_models.base'''\n", True),
    ("X = 'archon_models' 'archon_models/x' + pkg.archon_models\r\nY = 1\r\n", True),
    ("def f():\n    yield from archon_models.base.gen()\n", False),
    ("def f():\n    raise ValueError() from archon_models.err\n", False),
    ("from x import archon_models\n", False),
    ("X = archon_models\n", False),
    ('X = f"{NAME} in archon_models"\n', False),
    ("X = f\"{'archon_models'}\"\n", False),
    ("import torch\nimport archon_models.base\n", False),
    ("X = (\n", False),  # does not tokenize: libcst says where
]


@pytest.mark.parametrize(("source", "by_tokens"), PREFIX_PLACES)
def test_the_token_rewrite_agrees_with_the_syntax_tree_or_leaves_the_file_to_it(source: str, by_tokens: bool):
    """The export rewrites ~700 files per AReaL tier run token by token (49 CPU-s through libcst);
    where the tokens do it, the result is libcst's to the byte."""
    fast = _rewrite_tokens(source, ARCHON_PREFIX, AREAL_PREFIX)
    assert (fast is not None) == by_tokens, fast
    if fast is not None:
        assert fast == _rewrite_syntax_tree(source, ARCHON_PREFIX, AREAL_PREFIX, "<source>")


def test_prefix_rewrite_refuses_a_plain_import_naming_the_line():
    with pytest.raises(ValueError, match=r"model\.py:2: `import archon_models.base` binds the name"):
        rewrite_prefix("import torch\nimport archon_models.base\n", filename="model.py")


def test_the_export_tool_reaches_outside_the_workspace_only_when_the_face_vouches(tmp_path: Path):

    tool = get_tool("export_to_areal")
    assert tool.entry.destructive and not tool.entry.read_only
    ws = Workspace(PROJECT_ROOT)
    arguments = {"model_name": "llama", "areal": str(tmp_path), "python": "/usr/bin/python3"}
    # A replayed session file gets no trust: the AReaL tree must lie in the scratch copy.
    with pytest.raises(WorkspaceError, match=r"areal=.* is outside the workspace"):
        prepare_request(tool, arguments, ws)
    request = prepare_request(tool, arguments, ws, allow_external=True)
    assert request.areal == tmp_path and request.python == Path("/usr/bin/python3")  # a venv's link stays a link
    assert request.workspace == ws.root


# --- against a copy of the real AReaL 1.0.4 ------------------------------------------------


@pytest.mark.areal
@pytest.mark.parametrize("package", ["qwen2", "qwen3"])
def test_refuses_a_package_areal_ships(areal_copy: Path, capsys, package: str):
    before = _snapshot(areal_copy)
    code, out, err = _export(capsys, package, "--areal", str(areal_copy), "--overwrite")
    assert code == 2 and out == ""
    assert err == f"archon-port: error: {package}: AReaL ships its own {package} package; an export never replaces it\n"
    assert _snapshot(areal_copy) == before


@pytest.mark.areal
def test_refuses_a_model_type_another_areal_package_serves(areal_copy: Path, capsys):
    kin = areal_copy / "experimental/models/archon/kin"
    kin.mkdir()
    (kin / "__init__.py").write_text("")
    (kin / "spec.py").write_text('SPEC = ModelSpec(name="kin", supported_model_types=frozenset({"llama"}))\n')
    before = _snapshot(areal_copy)
    for extra in ((), ("--overwrite",)):  # a model_type belongs to one package: overwrite does not help
        code, out, err = _export(capsys, "llama", "--areal", str(areal_copy), "--no-checks", *extra)
        assert code == 2 and out == ""
        assert "model_type llama is already served by AReaL's package kin" in err
        assert err.count("\n") == 1
    assert _snapshot(areal_copy) == before


@pytest.mark.areal
def test_dry_run_prints_the_diff_and_writes_nothing(areal_copy: Path, capsys):
    before = _snapshot(areal_copy)
    code, out, err = _export(capsys, "llama", "--areal", str(areal_copy), "--dry-run")
    assert code == 0, err
    assert _snapshot(areal_copy) == before
    source_files = sorted(
        p.relative_to(PROJECT_ROOT / "archon_models/llama").as_posix()
        for p in (PROJECT_ROOT / "archon_models/llama").rglob("*.py")
    )
    for rel in source_files:
        assert f"--- /dev/null\n+++ b/{ARCHON_DIR}/llama/{rel}\n" in out
    assert f"--- a/{ARCHON_DIR}/__init__.py\n+++ b/{ARCHON_DIR}/__init__.py\n" in out
    assert f"\n+{LLAMA_INIT_LINE}\n" in out
    added = [line[1:] for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert not [line for line in added if line.lstrip().startswith(("from archon_models", "import archon_models"))]
    assert any(line.startswith("from areal.experimental.models.archon.") for line in added)
    # An AReaL source checkout (the directory holding areal/) gives the same diff.
    code, checkout_out, err = _export(capsys, "llama", "--areal", str(areal_copy.parent), "--dry-run")
    assert code == 0 and checkout_out == out, err


@pytest.mark.areal
def test_overwrite_replaces_a_different_package_and_a_second_export_changes_nothing(areal_copy: Path, capsys):
    code, out, err = _export(capsys, "llama", "--areal", str(areal_copy), "--no-checks")
    assert code == 0, err
    target = areal_copy / "experimental/models/archon/llama"
    exported = _snapshot(target)
    init = areal_copy / "experimental/models/archon/__init__.py"
    assert init.read_text().splitlines().count(LLAMA_INIT_LINE) == 1
    # The same package again: nothing to write, no --overwrite needed.
    code, out, err = _export(capsys, "llama", "--areal", str(areal_copy), "--no-checks")
    assert code == 0 and "0 file(s) written" in out, (out, err)
    assert _snapshot(target) == exported and init.read_text().splitlines().count(LLAMA_INIT_LINE) == 1

    (target / "model/model.py").write_text((target / "model/model.py").read_text() + "# a hand edit in AReaL\n")
    (target / "model/stray.py").write_text("X = 1\n")
    edited = _snapshot(target)
    code, out, err = _export(capsys, "llama", "--areal", str(areal_copy), "--no-checks")
    assert code == 2 and "exists in that AReaL and differs from this package; pass --overwrite" in err
    assert _snapshot(target) == edited

    code, out, err = _export(capsys, "llama", "--areal", str(areal_copy), "--no-checks", "--overwrite")
    assert code == 0, err
    assert _snapshot(target) == exported  # the stray file is gone, the edit undone
    assert f"{ARCHON_DIR}/llama/model/stray.py" in out and f"{ARCHON_DIR}/llama/model/model.py" in out


@pytest.mark.areal
def test_exported_files_differ_from_the_package_only_where_they_name_the_prefix(areal_copy: Path, capsys):
    code, _, err = _export(capsys, "llama", "--areal", str(areal_copy), "--no-checks")
    assert code == 0, err
    source = PROJECT_ROOT / "archon_models/llama"
    target = areal_copy / "experimental/models/archon/llama"
    for path in sorted(source.rglob("*.py")):
        ours = path.read_text().splitlines()
        theirs = (target / path.relative_to(source)).read_text().splitlines()
        assert len(ours) == len(theirs), path
        for a, b in zip(ours, theirs, strict=True):
            if a != b:
                assert rename_in_text(a) == b, (path, a, b)
        tree = ast.parse("\n".join(theirs))
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in modules if m.split(".")[0] == "archon_models"], path


@pytest.mark.areal
def test_a_package_that_cannot_be_rewritten_writes_nothing(areal_copy: Path, tmp_path: Path):
    project = tmp_path / "project"
    (project / "archon_models").mkdir(parents=True)
    (project / "archon_models/__init__.py").write_text("")
    shutil.copytree(
        PROJECT_ROOT / "archon_models/llama",
        project / "archon_models/llama",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (project / "archon_models/llama/model/legacy.py").write_text("import archon_models.base\n")
    before = _snapshot(areal_copy)
    with pytest.raises(ValueError, match=r"legacy\.py:1: `import archon_models.base`"):
        export_to_areal(ExportRequest(model_name="llama", areal=areal_copy, workspace=project, run_checks=False))
    assert _snapshot(areal_copy) == before


@pytest.mark.areal
@pytest.mark.slow
def test_export_llama_into_areal_and_its_checks_pass(areal_install: AReaLInstall, areal_copy: Path, capsys):
    code, out, err = _export(capsys, "llama", "--areal", str(areal_copy), "--python", str(areal_install.python))
    assert code == 0, out + err
    assert (areal_copy / "experimental/models/archon/llama/spec.py").is_file()
    assert "llama inside AReaL (areal.experimental.models.archon.llama): PASSED" in out
    table = out.split("\n\n")[1]
    rows = table.splitlines()[2:]
    assert rows and all(row.split("  ")[0] == "llama" for row in rows)
    assert not [row for row in rows if "FAILED" in row]
    for required in (
        "[AReaL, sdpa]",
        "[AReaL, varlen]",
        "to_hf reproduces",
        "_orig_mod",
        "critic",
        "(tp=2)",
        "(fsdp=2)",
    ):
        assert required in table, f"missing check {required!r}"


@pytest.mark.areal
def test_export_over_mcp_dry_run(areal_install: AReaLInstall, tmp_path: Path):
    """Over MCP the AReaL tree lies inside the workspace (tests/areal/test_export_safety.py)."""
    from mcp import Client

    from mcp_server import build_server
    from tests.mcp.conftest import make_workspace

    workspace = make_workspace(tmp_path / "ws")
    areal_copy = areal_install.copy_to(workspace / "site") / "areal"

    async def call():
        async with Client(build_server(workspace, record=False)) as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            assert listed["export_to_areal"].annotations.destructive_hint is True
            arguments = {"model_name": "llama", "areal": "site/areal", "dry_run": True}
            return await client.call_tool("export_to_areal", arguments)

    before = _snapshot(areal_copy)
    result = anyio.run(call)
    assert not result.is_error, result.content
    content = result.structured_content
    assert content["model_types"] == ["llama"] and content["passed"] is None and content["changed_files"] == []
    assert f"+{LLAMA_INIT_LINE}" in content["diff"]
    assert _snapshot(areal_copy) == before


@pytest.mark.areal
def test_checks_that_cannot_run_are_reported_after_the_write(areal_copy: Path, capsys):
    """This interpreter lacks AReaL's dependencies (aiohttp, ...): the package is written, the
    failure to check it is said in one place, and the exit status is 1."""
    import sys

    code, out, _err = _export(capsys, "llama", "--areal", str(areal_copy), "--python", sys.executable)
    assert code == 1
    assert (areal_copy / "experimental/models/archon/llama/spec.py").is_file()
    assert f"the AReaL checks could not run: the AReaL checks in {sys.executable} ended (exit 1)" in out
    assert "ModuleNotFoundError" in out
