"""A process killed at any instant of a commit leaves ``archon_models`` importable, and the
next tool call rolls the tree back to the state before the commit (or it had finished)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from skill import tools
from skill.codemod.workspace import STATE_DIR
from tests.mcp import journal_faults

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


def _run_writers(workdir: Path) -> dict:
    """Every kill point's commit, each in a process of its own (journal_faults forks them)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.mcp.journal_faults", str(workdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import archon_models"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kill_at_every_file_operation_of_a_commit(tmp_path):
    before_root, runs = tmp_path / "before", tmp_path / "runs"
    journal_faults.make_workspace(str(before_root))
    runs.mkdir()
    summary = _run_writers(runs)
    operations, after_root = summary["operations"], runs / "k0"
    before, after = _tree(before_root), _tree(after_root)
    before_dirs, after_dirs = _dirs(before_root), _dirs(after_root)
    assert before != after and operations > 10
    # Every kill point's process died of the SIGKILL it sent itself at that operation.
    assert summary["killed"] == list(range(1, operations + 1))
    outcomes = {"before": 0, "after": 0}
    for kill_at in summary["killed"]:
        root = runs / f"k{kill_at}"
        # Importable at the instant of the kill, before any recovery.
        imported = _imports(root)
        assert imported.returncode == 0, f"k={kill_at}: import archon_models failed:\n{imported.stderr}"
        # The next tool call (any, even one that fails) finishes the job.
        with contextlib.suppress(FileNotFoundError):
            tools.invoke("register_spec", {"model_name": "absent"}, workspace=root)
        state = _tree(root)
        assert state in (before, after), f"k={kill_at}: the tree is neither the state before nor after the commit"
        assert _dirs(root) == (before_dirs if state == before else after_dirs), f"k={kill_at}: leftover directories"
        assert not _pending(root), f"k={kill_at}: transaction folder left behind"
        assert _imports(root).returncode == 0
        outcomes["before" if state == before else "after"] += 1
    assert outcomes["before"] > 0 and outcomes["after"] > 0, outcomes


def test_recovery_rolls_back_in_process_interruptions_too(tmp_path, monkeypatch):
    """An exception during the apply (Ctrl-C) is rolled back at once; no journal is left."""
    from skill.codemod.workspace import StagedTree, Workspace

    journal_faults.make_workspace(str(tmp_path))
    before = _tree(tmp_path)
    real_replace = os.replace
    calls = []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real_replace(src, dst)

    tree = StagedTree(Workspace(tmp_path))
    journal_faults.stage(tree)
    monkeypatch.setattr(os, "replace", interrupted)
    try:
        tree.commit()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interruption did not propagate")
    monkeypatch.setattr(os, "replace", real_replace)
    assert _tree(tmp_path) == before
    assert not _pending(tmp_path)
