"""Bad input at the command line is one line and exit 2; Ctrl-C is one line and exit 130;
a non-loopback bind needs --allow-remote; a busy message names only live holders."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from skill import tools
from skill.cli import main as cli_main
from skill.codemod.workspace import Workspace
from skill.serving import check_bind

REPO = Path(__file__).resolve().parents[2]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("archon-port: error: "), err
    assert "Traceback" not in err
    return err


def _session_text() -> str:
    return next((REPO / "tests" / "mcp" / "sessions").glob("*.jsonl")).read_text()


BAD_SESSIONS = {
    "missing": None,
    "empty": "",
    "garbage": "\x00\xff not json at all\n",
    "truncated": "TRUNCATED",
    "unknown_format": '{"kind": "session", "format": 99, "session_id": "x", "engine_version": "x", "created": "x"}\n',
    "not_a_record": (
        '{"kind": "session", "format": 1, "session_id": "x", "engine_version": "x", "created": "x"}\n'
        '{"kind": "mystery"}\n'
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_SESSIONS))
def test_replay_of_a_bad_session_file_is_one_line(tmp_path: Path, kind: str, capsys):
    path = tmp_path / "s.jsonl"
    content = BAD_SESSIONS[kind]
    if content == "TRUNCATED":
        text = _session_text()
        content = text[: len(text) // 2]
    if content is not None:
        path.write_bytes(content.encode("utf-8", "surrogateescape") if isinstance(content, str) else content)
    assert cli_main(["replay", str(path)]) == 2
    _one_error_line(capsys)


@pytest.mark.parametrize(
    "command", [["check", "{n}"], ["stage", "{n}", "1"], ["add", "llama", "--name", "{n}", "--stages", ""]]
)
def test_a_name_too_long_for_the_file_system_is_one_line(workspace: Path, monkeypatch, capsys, command):
    monkeypatch.chdir(workspace)
    name = "a" * 260
    assert cli_main([part.format(n=name) for part in command]) == 2
    assert "characters long" in _one_error_line(capsys)


def test_serve_refusals_are_one_line(workspace: Path, tmp_path: Path, capsys):
    empty = tmp_path / "no_models"
    empty.mkdir()
    assert cli_main(["serve", "--workspace", str(empty)]) == 2
    assert "archon_models" in _one_error_line(capsys)
    assert cli_main(["serve", "--workspace", str(workspace), "--http", "99999"]) == 2
    assert "99999" in _one_error_line(capsys)
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text("{ not a session\n")
    assert cli_main(["serve", "--workspace", str(workspace), "--session", str(corrupt)]) == 2
    assert "corrupt.jsonl" in _one_error_line(capsys)


def test_the_cli_analyzes_a_folder_outside_the_workspace_and_a_bad_one_is_one_line(
    workspace: Path, tmp_path: Path, monkeypatch, capsys
):
    """The person at the keyboard may name any local path (only the MCP server and replay
    confine sources to the workspace); a folder that is no checkpoint is one error line,
    advising no flag the CLI lacks."""
    outside = tmp_path / "outside_model"
    outside.mkdir()
    (outside / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.chdir(workspace)
    assert cli_main(["analyze", str(outside)]) == 0
    assert "llama" in capsys.readouterr().out
    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    assert cli_main(["analyze", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("archon-port analyze: "), err
    assert "config.json" in err and "--workspace" not in err


def test_a_non_loopback_bind_needs_allow_remote_and_warns(workspace: Path, capsys, caplog):
    assert cli_main(["serve", "--workspace", str(workspace), "--host", "0.0.0.0", "--http", "8765"]) == 2
    assert "--allow-remote" in _one_error_line(capsys)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_bind(host, 8765, allow_remote=False)
    with caplog.at_level(logging.WARNING, logger="skill.serving"):
        check_bind("0.0.0.0", 8765, allow_remote=True)
    assert any("Host/Origin" in r.getMessage() for r in caplog.records)


def test_ctrl_c_is_one_line_and_exit_130(workspace: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "skill.cli", "serve", "--workspace", str(workspace), "--no-record"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if "serving over stdio" in line or not line:
            break
    # The line is logged once the interrupt handler is in place; the signal may then land
    # anywhere in the server's start-up or loop, as a person's Ctrl-C would.
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"exit {proc.returncode}: " + "".join(lines) + rest
    assert rest.strip().splitlines() == ["archon-port: interrupted (an interrupted write is rolled back)"], rest


def test_the_busy_message_names_only_live_holders(workspace: Path):
    ws = Workspace(workspace)
    # A call that changed the package and finished long ago...
    with tools.package_lock(ws, "mistral", exclusive=True, holder="finished_writer", timeout=0):
        pass
    # ...and a record left by a process that was killed while holding it.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holders = ws.state_dir("locks") / "mistral.holders"
    holders.mkdir(exist_ok=True)
    stale = tools.LockHolder(tool="killed_writer", pid=int(dead.stdout), exclusive=True, since="00:00:00")
    (holders / f"{dead.stdout.strip()}-1.json").write_text(stale.model_dump_json())
    reading, release = threading.Event(), threading.Event()

    def reader():
        with tools.package_lock(ws, "mistral", exclusive=False, holder="live_reader", timeout=5):
            reading.set()
            release.wait(10)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        assert reading.wait(10)
        with (
            pytest.raises(tools.ToolBusyError) as busy,
            tools.package_lock(ws, "mistral", exclusive=True, holder="second_writer", timeout=0),
        ):
            pass
    finally:
        release.set()
        thread.join()
    message = str(busy.value)
    assert "live_reader" in message and f"pid {os.getpid()}" in message
    assert "finished_writer" not in message and "killed_writer" not in message
    assert not any(holders.glob(f"{dead.stdout.strip()}-*.json")), "the stale record was not removed"
