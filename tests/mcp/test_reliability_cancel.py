"""Cancelled work stops: a client that cancels or disconnects gets nothing written, and a
killed command leaves neither a running child nor its scratch folder behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client

from mcp_server import build_server
from skill.codemod.workspace import CallCancelledError, cancellable
from skill.porting.child_process import run_child, scratch_dir, sweep_stale_scratch
from tests.processes import process_gone, wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_a_call_the_client_abandons_writes_nothing(workspace: Path, how: str):
    note = workspace / "archon_models" / "mistral" / "NOTES.txt"
    arguments = {"model_name": "mistral", "content": "written\n", "delay_s": 1.0}

    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            if how == "cancel":
                with anyio.move_on_after(0.3):
                    await client.call_tool("toy_rewrite_note", arguments)
                return
            async with anyio.create_task_group() as group:
                group.start_soon(client.call_tool, "toy_rewrite_note", arguments)
                await anyio.sleep(0.3)
                group.cancel_scope.cancel()
        # leaving the block disconnects the client

    anyio.run(main)
    time.sleep(1.5)  # past the step's delay: it would have committed by now
    assert not note.exists()


def test_a_killed_parent_takes_its_stage_child_and_scratch_folder_along(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from skill.porting.child_process import run_child, scratch_dir

        with scratch_dir("archon-port-stage") as folder:
            print(folder, flush=True)
            child = "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
            run_child([sys.executable, "-c", child], cwd=Path("."), env={{}}, timeout=300)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    folder = Path(proc.stdout.readline().strip())
    assert wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip()), "the child never started"
    child_pid = int(pid_file.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    assert wait_for(lambda: process_gone(child_pid)), f"child {child_pid} still runs after its parent was killed"
    assert folder.is_dir() and folder.name.startswith(f"archon-port-stage-{proc.pid}-")
    assert folder in sweep_stale_scratch("archon-port-stage", Path(tempfile.gettempdir()))
    assert not folder.exists()


def test_interrupting_a_stage_kills_its_child(tmp_path: Path):
    event = threading.Event()
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    threading.Timer(1.0, event.set).start()
    started = time.monotonic()
    with cancellable(event), pytest.raises(CallCancelledError):
        run_child([sys.executable, "-c", child], cwd=tmp_path, env=dict(os.environ), timeout=60)
    assert time.monotonic() - started < 10
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_killed_add_leaves_its_plan_folder_only_until_the_next_scratch_folder(tmp_path: Path, monkeypatch):
    """``add`` traces the TP plan on a copy of the package in a scratch folder; a SIGKILL during
    the trace runs no cleanup (at 19fb638 ``/tmp/archon-port-plan-*`` stayed forever). The next
    engine call that makes a scratch folder of any kind removes it."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    tracer = textwrap.dedent(
        f"""
        from skill.codemod import StagedTree, Workspace
        from skill.porting.tp_plan import trace_tp_plan
        trace_tp_plan(StagedTree(Workspace({str(REPO)!r})), "llama", [])
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", tracer],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(private_tmp)},
    )

    def copied() -> list[Path]:
        return [f for f in private_tmp.glob("archon-port-plan-*") if (f / "archon_models" / "llama").is_dir()]

    try:
        assert wait_for(copied, timeout=120), "the trace never made its folder"
        folders = copied()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert all(folder.is_dir() for folder in folders)
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    with scratch_dir("archon-port-stage"):
        pass
    assert not [folder for folder in folders if folder.exists()]
