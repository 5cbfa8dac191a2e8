"""Fixtures of the MCP-face tests: a throw-away workspace and the toy steps registered."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from skill import tools
from tests.mcp.toy_steps import TOY_ENTRIES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def toy_tools():
    """Register the toy steps once per test process (xdist workers each have their own registry)."""
    registered = []
    for entry in TOY_ENTRIES:
        if entry.name not in tools.load_tools():
            tools.register_tool(entry)
            registered.append(entry.name)
    yield
    for name in registered:
        tools.unregister_tool(name)


def make_workspace(root: Path) -> Path:
    """A project root holding a copy of this repo's archon_models/ and SKILL.md."""
    shutil.copytree(REPO / "archon_models", root / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    if (REPO / "SKILL.md").is_file():
        shutil.copy(REPO / "SKILL.md", root / "SKILL.md")
    return root


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


def make_project(root: Path, *, without: tuple[str, ...] = ()) -> Path:
    """A copy of this project with the packages named in ``without`` taken out."""
    from skill.replay import copy_repository
    from tests.mcp.scripted_client import remove_packages

    copy_repository(REPO, root)
    remove_packages(root, without)
    return root
