"""The AReaL tier: every committed package inside a real AReaL 1.0.4.

Once per test worker: the cached venv ``.venv-areal/`` is created or reused
(``skill.areal.environment``: ``areal`` with ``--no-deps`` next to this interpreter's
torch and transformers), unless the Python running the tests imports ``areal`` itself (a
cached venv such as ``.venv-areal-torch210/``, AReaL on its own torch, running pytest): then
that Python is the AReaL. Its ``areal`` package is copied to a scratch directory, every
committed package is exported into that copy (this project's references replace
AReaL's own qwen2 and qwen3 there, so they are proven too), and one checker process
that imports that AReaL answers every test. The tier never skips for lack of AReaL: it
installs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skill.areal.environment import DEFAULT_VENV_DIR, ensure_areal_env
from skill.areal.export import PROJECT_ROOT, AReaLChecker, stage_export
from skill.codemod import StagedTree, Workspace

_PROPERTY = "areal_tier_result"


def areal_venv_dir() -> Path:
    return Path(os.environ.get("ARCHON_PORT_AREAL_VENV", PROJECT_ROOT / DEFAULT_VENV_DIR))


def committed_packages() -> dict[str, list[str]]:
    """Package name -> the model types its spec serves, for every committed package."""
    import archon_models

    by_package: dict[str, list[str]] = {}
    for model_type in sorted(archon_models.get_supported_model_types()):
        spec = archon_models.get_model_spec(model_type)
        package = spec.model_class.__module__.split(".")[1]
        by_package.setdefault(package, []).append(model_type)
    return by_package


@dataclass(frozen=True)
class AReaLInstall:
    """The cached venv's Python and the site-packages directory holding its ``areal``."""

    python: Path
    site: Path

    def copy_to(self, root: Path) -> Path:
        """A scratch copy of the installed ``areal`` package under ``root``; returns ``root``."""
        shutil.copytree(self.site / "areal", root / "areal", ignore=shutil.ignore_patterns("__pycache__"))
        return root


@pytest.fixture(scope="session")
def areal_install() -> AReaLInstall:
    python = Path(sys.executable) if importlib.util.find_spec("areal") else ensure_areal_env(areal_venv_dir())
    # find_spec locates the package without running its __init__, which imports torch and
    # most of AReaL: 45 s against 0.2 s per test worker on the loaded 2-core machine.
    locate = (
        "import importlib.util, os; "
        "print(os.path.dirname(importlib.util.find_spec('areal').submodule_search_locations[0]))"
    )
    site = subprocess.run(
        [str(python), "-c", locate],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return AReaLInstall(python=python, site=Path(site))


# The tests that read the session's exported tree share one xdist worker under ``--dist
# loadgroup`` (pyproject.toml's addopts), so the export of every package and the checker's
# start happen once per run, not once per worker.
AREAL_TREE_GROUP = pytest.mark.xdist_group("areal_tree")


@dataclass(frozen=True)
class ExportedTree:
    """A scratch copy of AReaL with every committed package exported into it, and the text the
    export wrote to each file (``None`` for a file it removed), by path under the copy."""

    root: Path
    files: dict[str, str | None]


@pytest.fixture(scope="session")
def areal_exported(areal_install: AReaLInstall, tmp_path_factory: pytest.TempPathFactory) -> ExportedTree:
    """Every committed package exported into one scratch copy of AReaL (this project's references
    replace AReaL's own qwen2 and qwen3 there): the tree the tier's checker imports."""
    root = areal_install.copy_to(tmp_path_factory.mktemp("areal-tree"))
    tree = StagedTree(Workspace(root, marker="areal/experimental/models/archon"))
    for package in committed_packages():
        stage_export(tree, PROJECT_ROOT, package, overwrite=True, replace_builtin=True)
    files = tree.changes()
    tree.commit()
    return ExportedTree(root=root, files=files)


@pytest.fixture(scope="session")
def areal_checker(areal_install: AReaLInstall, areal_exported: ExportedTree) -> Iterator[AReaLChecker]:
    root = areal_exported.root
    checker = AReaLChecker(areal_install.python, root, log_path=root / "checker.log")
    yield checker
    checker.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    rows = []
    for report in terminalreporter.getreports("passed") + terminalreporter.getreports("failed"):
        for name, value in getattr(report, "user_properties", []):
            if name == _PROPERTY:
                rows.append(json.loads(value))
    if not rows:
        return
    terminalreporter.section("AReaL tier: max abs diff vs HF fp32 inside AReaL 1.0.4")
    terminalreporter.write_line(f"{'model_type':<14} {'package':<44} {'logits':>9} {'grads':>9} {'time':>6}  result")
    for row in sorted(rows, key=lambda r: r["model_type"]):
        logit = "-" if row["logits"] is None else f"{row['logits']:.2e}"
        grad = "-" if row["grads"] is None else f"{row['grads']:.2e}"
        terminalreporter.write_line(
            f"{row['model_type']:<14} {row['package']:<44} {logit:>9} {grad:>9} {row['seconds']:>5.1f}s  "
            f"{'ok' if row['passed'] else 'FAILED'}"
        )
