"""``python -m mcp_server`` takes exactly ``archon-port serve``'s arguments, with or without ``serve``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

from skill.cli import build_parser as build_cli_parser
from skill.serving import parse_args

REPO = Path(__file__).resolve().parents[2]


def test_both_spellings_parse_to_the_serve_subcommands_options(tmp_path: Path):
    argv = ["--workspace", str(tmp_path), "--no-record", "--lock-timeout", "0", "--http", "8765"]
    bare = vars(parse_args(argv))
    with_serve = vars(parse_args(["serve", *argv]))
    via_cli = vars(build_cli_parser().parse_args(["serve", *argv]))
    assert bare == with_serve
    shared = {k: v for k, v in via_cli.items() if k not in ("command", "func", "record", "verbose")}
    assert {k: bare[k] for k in shared} == shared  # one set of options, the same defaults
    assert bare["workspace"] == str(tmp_path) and bare["lock_timeout"] == 0.0 and bare["host"] == "127.0.0.1"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--no-such-option"])


@pytest.mark.parametrize("spelling", [["serve"], []], ids=["serve", "bare"])
def test_python_m_mcp_server_serves_a_workspace_over_stdio(workspace: Path, spelling: list[str]):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "mcp_server", *spelling, "--workspace", str(workspace), "--no-record"],
        cwd=str(REPO),
        env=env,
    )

    async def main():
        async with Client(server, read_timeout_seconds=120) as client:
            names = {t.name for t in (await client.list_tools()).tools}
            result = await client.call_tool("check_package", {"model_name": "no_such_package"})
            return names, result

    names, result = anyio.run(main)
    assert {"analyze_hf_model", "run_test_stage", "locate_divergence", "port_model"} <= names
    # The call ran inside the workspace passed on the command line.
    assert not result.structured_content["passed"]
    assert result.structured_content["package_dir"] == "archon_models/no_such_package"
