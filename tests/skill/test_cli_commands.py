"""Every tool of the registry is an ``archon-port`` command whose options are the tool's input
fields (issue 20, item 5: one registry generates both faces, so a shell user can follow
every step SKILL.md names). Exit statuses: 0 done, 1 the step ran and says ``passed:
false``, 2 bad input on one line naming the option."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client

from mcp_server import build_server
from skill import session as sessions
from skill.cli import build_parser, command_tools, main, sub_commands
from skill.cli.tool_options import call_arguments
from skill.porting.copy_reference import CopyReferenceResult
from skill.tools import TOOL_ENTRIES, get_tool, register_tool, tool_entries, unregister_tool
from tests.mcp.scripted_client import _section
from tests.mcp.toy_steps import TOY_ENTRIES

REPO = Path(__file__).resolve().parents[2]
HAND_WRITTEN = {
    "analyze": "analyze_hf_model",
    "add": "port_model",
    "check": "check_package",
    "stage": "run_test_stage",
    "diverge": "locate_divergence",
    "export": "export_to_areal",
}
# Options of a command that are not input fields: what the CLI itself adds to each command,
# and analyze's --list (a listing, no tool call).
CLI_OPTIONS = {"help", "json"}
EXTRA_OPTIONS = {"analyze": {"list"}}


def _command_parser(command: str) -> argparse.ArgumentParser:
    commands = sub_commands(build_parser())
    commands.populate(command)
    return commands.choices[command]


def _command_of(tool: str) -> str:
    return {t: c for c, t in command_tools().items() if t is not None}[tool]


def _one_line(text: str) -> str:
    assert text.count("\n") == 1 and text.endswith("\n"), text
    return text


def test_every_registry_tool_is_exactly_one_command():
    commands = command_tools()
    run = [tool for tool in commands.values() if tool is not None]
    assert sorted(run) == sorted(entry.name for entry in tool_entries())
    assert len(run) == len(set(run))
    assert {command for command, tool in commands.items() if tool is None} == {"serve", "replay"}
    assert {command: commands[command] for command in HAND_WRITTEN} == HAND_WRITTEN
    generated = {command: tool for command, tool in commands.items() if tool and command not in HAND_WRITTEN}
    assert generated and all(command == tool.replace("_", "-") for command, tool in generated.items())


@pytest.mark.parametrize("tool", [entry.name for entry in TOOL_ENTRIES])
def test_a_commands_options_are_its_tools_input_fields(tool: str):
    command = _command_of(tool)
    parser = _command_parser(command)
    fields = get_tool(tool).input_model.model_fields
    actions = {action.dest: action for action in parser._actions}
    assert set(actions) - CLI_OPTIONS - EXTRA_OPTIONS.get(command, set()) == set(fields) | {"workspace"}
    for name, info in fields.items():
        action = actions[name]
        if action.option_strings:
            # Required on the command line exactly when the tool requires it (a flag never is).
            assert action.required == (info.is_required() and action.nargs != 0), (command, name)
        elif command != "analyze":  # analyze's source may be left out for --list (the command says so)
            assert info.is_required() and action.nargs is None, (command, name)


def test_the_options_read_values_as_the_fields_types(tmp_path: Path, monkeypatch):
    (tmp_path / "archon_models").mkdir()
    commands = sub_commands(parser := build_parser())
    for command in ("edit-adapter-map", "export", "copy-reference"):
        commands.populate(command)
    edits = ["--add", "a.weight=b.weight", "--add", "c.bias=null", "--remove", "x", "--remove", '["y", "z"]']
    args = parser.parse_args(["edit-adapter-map", "m", *edits])
    assert call_arguments(args, get_tool("edit_adapter_map"), tmp_path) == {
        "model_name": "m",
        "add": {"a.weight": "b.weight", "c.bias": None},
        "remove": ["x", "y", "z"],
    }
    # A flag whose field defaults to true turns it off; a path inside the workspace is kept
    # relative to it (a recorded call replays in a copy), one outside is absolute.
    monkeypatch.chdir(tmp_path)
    args = parser.parse_args(["export", "m", "--areal", "areal", "--no-checks", "--python", "/usr/bin/python3"])
    assert call_arguments(args, get_tool("export_to_areal"), tmp_path) == {
        "model_name": "m",
        "areal": "areal",
        "run_checks": False,
        "python": "/usr/bin/python3",
    }
    # Left out: left out of the call, so the tool's own default applies.
    args = parser.parse_args(["copy-reference", "m", "--reference", "qwen2"])
    assert call_arguments(args, get_tool("copy_reference"), tmp_path) == {"model_name": "m", "reference": "qwen2"}


def test_the_mcp_server_serves_the_tools_the_cli_runs(tmp_path: Path):
    (tmp_path / "archon_models").mkdir()

    async def listed() -> set[str]:
        async with Client(build_server(tmp_path, record=False)) as client:
            return {tool.name for tool in (await client.list_tools()).tools}

    assert anyio.run(listed) == {tool for tool in command_tools().values() if tool is not None}


@pytest.fixture
def toy_tools():
    """Steps registered at run time, as a plugin would add them."""
    added = []
    registered = {entry.name for entry in tool_entries()}
    for entry in TOY_ENTRIES:
        if entry.name not in registered:
            register_tool(entry)
            added.append(entry.name)
    yield
    for name in added:
        unregister_tool(name)


def test_a_tool_registered_at_run_time_is_a_command_with_exit_statuses(toy_tools, tmp_path: Path, capsys):
    (tmp_path / "archon_models").mkdir()
    assert command_tools()["toy-peer-lost"] == "toy_peer_lost"
    # The step ran and its result says passed: false -> 1, the result on stdout.
    assert main(["toy-peer-lost", "m", "--workspace", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "passed: no" in out and "Connection closed by peer" in out
    assert main(["toy-append-note", "m", "--text", "hello", "--workspace", str(tmp_path)]) == 0
    assert (tmp_path / "archon_models/m/NOTES.txt").read_text() == "begin hello\nend hello\n"
    capsys.readouterr()
    # The step refused its input -> 2, one line, with the engine's message.
    (tmp_path / "empty.txt").write_text("")
    assert main(["toy-read-note", "m", "--note", str(tmp_path / "empty.txt"), "--workspace", str(tmp_path)]) == 2
    assert _one_line(capsys.readouterr().err).startswith("archon-port: error: empty.txt is empty")
    # A value the input model refuses -> 2, naming the option that carried it.
    assert main(["toy-append-note", "m", "--text", "x", "--delay-s", "9", "--workspace", str(tmp_path)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("archon-port: error: --delay-s (delay_s): ") and "toy-append-note --help" in err


def _cli(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "skill.cli", *map(str, argv)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _in_process(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """``archon-port ARGV`` run by the same ``main`` the shell's ``python -m skill.cli`` runs: its
    exit status (argparse's own refusals included), stdout and stderr."""
    capsys.readouterr()
    try:
        status = main([str(a) for a in argv])
    except SystemExit as done:
        status = int(done.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_a_generated_command_runs_a_real_tool_from_a_shell(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    workspace = tmp_path / "ws"
    shutil.copytree(REPO / "archon_models", workspace / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    session = tmp_path / "session.jsonl"

    # From a shell: a fresh interpreter running the console entry point.
    done = _cli("--record", session, "copy-reference", "toyport", "--reference", "qwen2", "--workspace", workspace)
    assert done.returncode == 0, done.stderr
    assert "package_dir: archon_models/toyport" in done.stdout and "reference: qwen2" in done.stdout
    assert "class ToyportModel" in (workspace / "archon_models/toyport/model/model.py").read_text()
    # The rest through the same main() in this process (each shell start costs ~7 CPU seconds of
    # imports and proves nothing the first did not). Again, as JSON: the result model an MCP
    # client gets; nothing changes the second time.
    status, out, err = _in_process(
        capsys,
        "--record",
        session,
        "copy-reference",
        "toyport",
        "--reference",
        "qwen2",
        "--workspace",
        workspace,
        "--json",
    )
    assert status == 0, err
    result = CopyReferenceResult.model_validate_json(out)
    assert result.changed_files == [] and result.package_dir == "archon_models/toyport"
    # Recorded as an MCP client would send the call, so the session replays.
    calls = [r for r in sessions.read_session(session) if r.kind == "call"]
    assert [(c.tool, c.arguments) for c in calls] == [
        ("copy_reference", {"model_name": "toyport", "reference": "qwen2"})
    ] * 2

    # Bad input: 2, one line naming the problem and the fix; nothing written.
    status, _, err = _in_process(capsys, "copy-reference", "Toy-Port", "--reference", "qwen2", "--workspace", workspace)
    assert status == 2
    assert _one_line(err).startswith("archon-port: error: model_name: Model name 'Toy-Port'")
    assert "try 'toy_port'" in err and not (workspace / "archon_models/Toy-Port").exists()
    status, _, err = _in_process(capsys, "copy-reference", "toyport", "--workspace", workspace)
    assert status == 2 and "required: --reference" in _one_line(err)

    # The package is copied, not yet ported: check runs and fails -> 1.
    status, out, err = _in_process(capsys, "check", "toyport", "--workspace", workspace, "--json")
    assert status == 1, err
    assert json.loads(out)["passed"] is False


def test_archon_port_help_lists_every_command_without_importing_the_engine():
    probe = (
        "import sys\n"
        "from skill.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as done:\n"
        "    code = done.code\n"
        "heavy = ('torch', 'transformers', 'mcp', 'mcp_server', 'skill.porting')\n"
        "print(code, sorted(m for m in heavy if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []"
    builtin = {entry.name for entry in TOOL_ENTRIES}  # the child registers no run-time tool
    for command, tool in command_tools().items():
        if tool is None or tool in builtin:
            assert f"\n    {command}" in done.stdout, command


def test_an_unknown_command_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["copy_reference", "x"])
    assert exit_.value.code == 2
    err = _one_line(capsys.readouterr().err)
    assert "invalid choice: 'copy_reference'" in err and "'archon-port --help'" in err


# --- SKILL.md and README name commands that exist, with the options they take ---------------

DOCS = {name: (REPO / name).read_text(encoding="utf-8") for name in ("SKILL.md", "README.md")}
_SHELL_LINE = re.compile(r"^(?:[A-Z_]+=\S+ )?(archon-port .*?)(?:\s+#\s*(.*))?$")
# A placeholder's stand-in where the command needs a number; any other is a word.
_PLACEHOLDER_VALUES = {"stage": "4"}


def _fill(command_line: str) -> list[str]:
    filled = re.sub(r"<([a-z_]+)>", lambda m: _PLACEHOLDER_VALUES.get(m[1], "x"), command_line)
    return shlex.split(filled)[1:]  # without "archon-port"


def _shell_lines(text: str) -> list[tuple[str, str]]:
    """Each ``archon-port`` line of a bash block: (the command line, its comment)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            match = _SHELL_LINE.match(line.strip())
            if match and not line.rstrip().endswith("\\"):
                lines.append((match[1], match[2] or ""))
    return lines


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_command_line_the_docs_show_parses_and_runs_the_tool_it_names(doc: str):
    tools = {entry.name for entry in tool_entries()}
    lines = _shell_lines(DOCS[doc])
    assert len(lines) >= 10, lines
    for command_line, comment in lines:
        try:
            args = build_parser().parse_args(_fill(command_line))
        except SystemExit as error:  # argparse refused it: say which line
            raise AssertionError(f"{doc}: `{command_line}` does not parse") from error
        named = [word for word in re.findall(r"[a-z_]+", comment) if word in tools]
        if named:
            assert args.cli_command.tool == named[-1], (doc, command_line)


def test_skill_md_shows_a_shell_command_for_every_tool():
    hand = _section(DOCS["SKILL.md"], "Porting by hand")
    tools = {entry.name for entry in TOOL_ENTRIES}
    shown = {build_parser().parse_args(_fill(line)).cli_command.tool for line, _ in _shell_lines(hand)}
    assert shown == tools


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_option_the_docs_give_a_command_is_one_of_its_options(doc: str):
    parser = build_parser()
    commands = sub_commands(parser)
    global_options = {s for action in parser._actions for s in action.option_strings}
    checked = 0
    for text in re.findall(r"`(archon-port [^`]+)`", DOCS[doc]) + [line for line, _ in _shell_lines(DOCS[doc])]:
        tokens = [t for t in _fill(re.sub(r"[\[\]]|\.\.\.", " ", text)) if t.startswith("-") or t in commands.choices]
        command = next((t for t in tokens if t in commands.choices), None)
        if command is None:
            continue
        commands.populate(command)
        options = {s for action in commands.choices[command]._actions for s in action.option_strings}
        before = tokens[: tokens.index(command)]
        after = tokens[tokens.index(command) + 1 :]
        assert set(before) <= global_options, (doc, text)
        assert set(after) <= options, (doc, text, sorted(set(after) - options))
        checked += 1
    assert checked >= 10


def test_a_stage_s_not_run_check_shows_why_on_the_terminal():
    """SKILL.md: a parallelism the model cannot run is a passing `not run (...)` check naming
    why; the text output showed only its name (gpt_neox_japanese's tied head, pp=2)."""
    from skill.cli.stage import format_stage
    from skill.porting.run_test_stage import RunTestStageResult, StageCheck, StageTest

    reason = "the embedding and LM head are tied, which pipeline_llm cannot split over stages"
    checks = [
        StageCheck(name="not run (pp=2)", passed=True, detail=reason),
        StageCheck(name="logits (tp=2)", passed=True, detail="ranks 0,1", max_abs_diff=1e-7),
    ]
    result = RunTestStageResult(
        stage=5,
        test_file="tests/archon/test_x.py",
        passed=True,
        tests=[StageTest(test="test_stage5_distributed[x]", outcome="passed", seconds=1.0, checks=checks)],
        seconds=1.0,
    )
    lines = format_stage(result, "x").splitlines()
    assert lines[1].strip() == f"ok  not run (pp=2)  {reason}"
    assert "ranks 0,1" not in lines[2]  # a passing check's detail stays off the terminal
