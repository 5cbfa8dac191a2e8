"""``export`` writes all files or none (the registry last) and recovers after a kill like ``add``
does; it copies no file a symbolic link points to; an MCP client cannot point it outside the
workspace or at a program; and the AReaL checks import nothing from the tree but ``areal``.

A fake AReaL tree and a toy package (``tests/areal/fake_areal.py``) keep these tests free of
torch and of the real AReaL, except the one that runs the checks' own process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client

from mcp_server import build_server
from skill.areal.export import AReaLChecksDidNotRun, ExportError, ExportRequest, export_to_areal, run_checks_in
from skill.cli import main as cli_main
from skill.codemod.workspace import STATE_DIR
from tests.areal.fake_areal import ARCHON, TOY, TOY_LINE, imports, make_fake_areal, make_toy_project

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (no caches, no engine state) with its sha256."""
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts[0] == STATE_DIR or "__pycache__" in rel.parts or not path.is_file():
            continue
        files[rel.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def _dirs(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_dir() and STATE_DIR not in p.relative_to(root).parts and p.name != "__pycache__"
    }


def _pending(root: Path) -> list[str]:
    txn = root / STATE_DIR / "txn"
    return sorted(p.name for p in txn.iterdir()) if txn.is_dir() else []


def _request(project: Path, areal: Path, **fields) -> ExportRequest:
    return ExportRequest(model_name=TOY, areal=areal, workspace=project, run_checks=False, **fields)


# --- all files or none, the registry last, recovered by the next export ---------------------------


@pytest.mark.parametrize("scenario", ["new_package", "changed_package"])
def test_an_export_killed_at_any_file_operation_is_rolled_back_by_the_next_one(tmp_path: Path, scenario: str):
    project = make_toy_project(tmp_path / "project", version=1)
    template = make_fake_areal(tmp_path / "template")
    if scenario == "changed_package":  # v1 exported and registered; v2 changes, adds and deletes files
        export_to_areal(_request(project, template))
        make_toy_project(project, version=2)
    before, before_dirs = _tree(template), _dirs(template)
    runs = tmp_path / "runs"
    runs.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.areal.export_faults", str(project), str(template), str(runs)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    after, after_dirs = _tree(runs / "k0"), _dirs(runs / "k0")
    assert before != after and summary["operations"] > 10
    assert summary["killed"] == list(range(1, summary["operations"] + 1))
    assert TOY_LINE in (runs / "k0" / ARCHON / "__init__.py").read_text()
    outcomes = {"before": 0, "after": 0}
    for kill_at in summary["killed"]:
        root = runs / f"k{kill_at}"
        # AReaL's registry imports at the instant of the kill, before any recovery.
        imported = imports(root)
        assert imported.returncode == 0, f"k={kill_at}: the registry does not import:\n{imported.stderr}"
        # The next export, even a dry run, rolls the unfinished write back instead of refusing.
        dry = export_to_areal(_request(project, root, dry_run=True, overwrite=scenario == "changed_package"))
        state = _tree(root)
        assert state in (before, after), f"k={kill_at}: neither the tree before nor after the export"
        assert _dirs(root) == (before_dirs if state == before else after_dirs), f"k={kill_at}: leftover folders"
        assert not _pending(root), f"k={kill_at}: a transaction folder is left"
        assert (dry.diff == "") == (state == after)
        assert imports(root).returncode == 0
        outcomes["before" if state == before else "after"] += 1
    assert outcomes["before"] > 0 and outcomes["after"] > 0, outcomes


def test_the_registry_is_written_after_every_package_file(tmp_path: Path, monkeypatch):
    project = make_toy_project(tmp_path / "project")
    root = make_fake_areal(tmp_path / "areal")
    replaced: list[str] = []
    real_replace = os.replace

    def recording(src, dst, *args, **kwargs):
        replaced.append(Path(dst).relative_to(root).as_posix())
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", recording)
    result = export_to_areal(_request(project, root))
    into_tree = [rel for rel in replaced if not rel.startswith(STATE_DIR)]
    assert into_tree[-1] == f"{ARCHON}/__init__.py"
    assert sorted(into_tree) == sorted(result.changed_files)


# --- symbolic links inside the package -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "folder", "package"])
def test_a_symbolic_link_in_the_package_is_refused_and_nothing_of_its_target_shown(
    tmp_path: Path, kind: str, capsys, monkeypatch
):
    project = make_toy_project(tmp_path / "project")
    root = make_fake_areal(tmp_path / "areal")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("TOKEN = 'TOP-SECRET-VALUE'\n")
    package = project / "archon_models" / TOY
    if kind == "file":
        (package / "model" / "secret.py").symlink_to(outside / "secret.py")
    elif kind == "folder":
        (package / "linked").symlink_to(outside, target_is_directory=True)
    else:
        real = tmp_path / "real_package"
        package.rename(real)
        package.symlink_to(real, target_is_directory=True)
    before = _tree(root)
    with pytest.raises(ExportError, match="is a symbolic link") as refused:
        export_to_areal(_request(project, root, dry_run=True))
    assert "TOP-SECRET" not in str(refused.value) and "\n" not in str(refused.value)
    monkeypatch.chdir(project)
    code = cli_main(["export", TOY, "--areal", str(root), "--no-checks"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "symbolic link" in err
    assert "TOP-SECRET" not in out + err
    assert _tree(root) == before


# --- what an MCP client may name ---------------------------------------------------------------------


def _call_over_mcp(workspace: Path, arguments: dict):
    async def call():
        async with Client(build_server(workspace, record=False)) as client:
            return await client.call_tool("export_to_areal", arguments)

    return anyio.run(call)


def test_over_mcp_the_areal_tree_must_lie_in_the_workspace(tmp_path: Path):
    project = make_toy_project(tmp_path / "project")
    outside = make_fake_areal(tmp_path / "elsewhere")
    before = _tree(outside)
    result = _call_over_mcp(project, {"model_name": TOY, "areal": str(outside), "run_checks": False})
    assert result.is_error
    error = result.structured_content["error"]
    assert error["kind"] == "outside_workspace" and "is outside the workspace" in error["message"]
    assert _tree(outside) == before
    # A tree inside the workspace is exported as from the command line.
    inside = make_fake_areal(project / "AReaL")
    result = _call_over_mcp(project, {"model_name": TOY, "areal": "AReaL", "run_checks": False})
    assert not result.is_error, result.content
    assert (inside / ARCHON / TOY / "spec.py").is_file()


def test_over_mcp_a_python_to_run_is_refused(tmp_path: Path):
    project = make_toy_project(tmp_path / "project")
    inside = make_fake_areal(project / "AReaL")
    marker = tmp_path / "ran"
    program = project / "fake-python"
    program.write_text(f"#!/bin/sh\ntouch {marker}\n")
    program.chmod(0o755)
    before = _tree(inside)
    for python in (str(program), "fake-python", sys.executable):
        result = _call_over_mcp(project, {"model_name": TOY, "areal": "AReaL", "python": python})
        assert result.is_error
        error = result.structured_content["error"]
        assert error["kind"] == "outside_workspace" and "names a program to run" in error["message"], error
    assert not marker.exists() and _tree(inside) == before


# --- the checks' process imports only `areal` from the tree ------------------------------------------


def test_the_checks_import_nothing_planted_in_the_areal_tree(tmp_path: Path):
    root = make_fake_areal(tmp_path / "areal")
    marker = tmp_path / "planted-code-ran"
    planted = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    planted_files = ("skill/__init__.py", "skill/areal/__init__.py", "skill/areal/checks.py", "torch/__init__.py")
    for rel in (*planted_files, "json.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(planted)
    with pytest.raises(AReaLChecksDidNotRun, match="without a result for every model type"):
        run_checks_in(Path(sys.executable), root, [TOY], distributed=False)
    assert not marker.exists(), marker.read_text()
