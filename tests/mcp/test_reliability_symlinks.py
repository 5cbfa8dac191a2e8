"""Symbolic links cannot lead the server outside its workspace: not a linked config.json
inside a checkpoint folder, not a linked ``.archon-port`` state directory."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from mcp import Client

from mcp_server import build_server
from skill import tools
from skill.codemod.workspace import Workspace, WorkspaceError
from skill.session import SessionRecorder


def _outside_config(tmp_path: Path) -> Path:
    secret = tmp_path / "outside" / "config.json"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"model_type": "llama", "secret": "do not read me"}))
    return secret


@pytest.mark.parametrize("source", ["ckpt", "ckpt/config.json"])
def test_analyze_over_mcp_refuses_a_config_linked_from_outside(workspace: Path, tmp_path: Path, source: str):
    (workspace / "ckpt").mkdir()
    (workspace / "ckpt" / "config.json").symlink_to(_outside_config(tmp_path))

    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            return await client.call_tool("analyze_hf_model", {"source": source})

    result = anyio.run(main)
    assert result.is_error
    error = result.structured_content["error"]
    assert error["kind"] == "outside_workspace", error
    assert "do not read me" not in json.dumps(result.structured_content)


def test_a_linked_folder_inside_a_checkpoint_is_refused_too(workspace: Path, tmp_path: Path):
    _outside_config(tmp_path)
    (workspace / "ckpt").mkdir()
    (workspace / "ckpt" / "sub").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(WorkspaceError, match="ckpt/sub is a symbolic link"):
        tools.invoke("analyze_hf_model", {"source": "ckpt"}, workspace=workspace)


def test_a_linked_state_directory_is_refused(workspace: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (workspace / ".archon-port").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(WorkspaceError, match="symbolic link"):
        tools.invoke("toy_append_note", {"model_name": "m", "text": "x"}, workspace=workspace)
    with pytest.raises(WorkspaceError, match="symbolic link"):
        SessionRecorder(workspace / "s.jsonl", workspace)
    with pytest.raises(WorkspaceError, match="symbolic link"):
        Workspace(workspace).state_dir("locks")
    assert list(elsewhere.iterdir()) == []
