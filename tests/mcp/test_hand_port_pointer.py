"""A step that fails for an unsupported feature or a missing file points to SKILL.md § Porting by hand."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mcp import Client

from mcp_server import build_server
from skill.console import reports_bad_input
from skill.errors import HAND_PORT_POINTER, HAND_PORT_SECTION, UnsupportedFeatureError
from tests.mcp.conftest import REPO


def _call(workspace: Path, tool: str, arguments: dict):
    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            return await client.call_tool(tool, arguments)

    return anyio.run(main)


def test_skill_md_has_the_section_the_errors_point_to():
    skill_md = (REPO / "SKILL.md").read_text(encoding="utf-8")
    assert f"\n## {HAND_PORT_SECTION}\n" in skill_md


def test_an_unsupported_feature_points_to_the_hand_port_section(workspace: Path):
    result = _call(workspace, "toy_port_feature", {"model_name": "olmo", "feature": "clip_qkv"})
    assert result.is_error
    error = result.structured_content["error"]
    assert error["kind"] == "step_failed" and error["exception"] == "UnsupportedFeatureError"
    assert error["message"].startswith("olmo has a feature no edit supports: clip_qkv. Nothing was written.")
    assert error["message"].endswith(f"({HAND_PORT_POINTER})")
    assert error["see"] == f"{HAND_PORT_POINTER} (resource archon://skill)"


def test_a_missing_file_names_the_step_that_writes_it_and_points_to_the_section(workspace: Path):
    result = _call(workspace, "register_spec", {"model_name": "nopkg", "model_types": ["nopkg"]})
    error = result.structured_content["error"]
    assert error["exception"] == "FileNotFoundError"
    # The message names the steps that create the package, and the way past it.
    assert "archon-port add" in error["message"] and "copy_reference" in error["message"]
    assert HAND_PORT_POINTER in error["message"]
    assert error["see"] is not None


def test_other_failures_do_not_point_there(workspace: Path):
    (workspace / "empty.txt").write_text("")
    error = _call(workspace, "toy_read_note", {"model_name": "m", "note": "empty.txt"}).structured_content["error"]
    assert HAND_PORT_POINTER not in error["message"] and error["see"] is None


@pytest.mark.parametrize(
    ("error", "pointed"),
    [
        (UnsupportedFeatureError("granite has a feature no edit supports: x.", ["x"]), True),
        (FileNotFoundError("archon_models/x/model/model.py does not exist; run copy_reference first."), True),
        (ValueError("stage 7 does not exist; stages are 1 to 6."), False),
    ],
)
def test_the_cli_prints_the_pointer_on_the_same_errors(capsys, error: Exception, pointed: bool):
    @reports_bad_input
    def command() -> int:
        raise error

    assert command() == 2
    err = capsys.readouterr().err
    assert err.startswith(f"archon-port: error: {error}")
    assert (HAND_PORT_POINTER in err) is pointed
