"""Small engine-shaped steps for testing the server's mechanics (locks, progress, errors).

They follow the step contract exactly (one pydantic input, one pydantic result, a
docstring) but do trivial work, so the tests of the MCP face do not depend on how far
the porting engine has got.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import sys
import time
from pathlib import Path

from pydantic import BaseModel, Field

from skill.codemod.workspace import Workspace, transaction
from skill.errors import UnsupportedFeatureError
from skill.porting.child_process import run_child
from skill.tools import ToolEntry

logger = logging.getLogger("skill.tests.toy_steps")


class AppendNoteRequest(BaseModel):
    model_name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    text: str
    delay_s: float = Field(default=0.0, ge=0.0, le=5.0, description="pause between the two halves of the write")
    workspace: Path | None = None


class AppendNoteResult(BaseModel):
    path: str
    lines: int
    elapsed_s: float = Field(json_schema_extra={"volatile": True})


def append_note(request: AppendNoteRequest) -> AppendNoteResult:
    """Append a begin line, wait, then an end line to archon_models/<model_name>/NOTES.txt."""
    start = time.perf_counter()
    ws = Workspace(request.workspace)
    rel = f"archon_models/{request.model_name}/NOTES.txt"
    path = ws.resolve(rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(f"begin {request.text}\n")
        handle.flush()
        for step in range(3):
            logger.info("note %s: step %d of 3", request.text, step + 1)
            time.sleep(request.delay_s / 3)
        handle.write(f"end {request.text}\n")
    lines = path.read_text(encoding="utf-8").count("\n")
    return AppendNoteResult(path=str(path), lines=lines, elapsed_s=time.perf_counter() - start)


class ReadNoteRequest(BaseModel):
    model_name: str
    note: Path = Field(description="file to read, relative to the workspace")
    workspace: Path | None = None


class ReadNoteResult(BaseModel):
    text: str


def read_note(request: ReadNoteRequest) -> ReadNoteResult:
    """Return a text file's content; fails with ValueError when it is empty."""
    text = request.note.read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"{request.note.name} is empty; write to it with append_note first")
    return ReadNoteResult(text=text)


class RewriteRequest(BaseModel):
    model_name: str
    content: str
    delay_s: float = Field(default=0.0, ge=0.0, le=5.0, description="pause between staging and committing")
    workspace: Path | None = None


def rewrite_note(request: RewriteRequest) -> AppendNoteResult:
    """Replace archon_models/<model_name>/NOTES.txt through a transaction."""
    ws = Workspace(request.workspace)
    rel = f"archon_models/{request.model_name}/NOTES.txt"
    with transaction(ws) as tree:
        tree.write_text(rel, request.content)
        logger.info("staged %s", rel)
        time.sleep(request.delay_s)
    return AppendNoteResult(path=rel, lines=request.content.count("\n"), elapsed_s=0.0)


class PortFeatureRequest(BaseModel):
    model_name: str
    feature: str
    workspace: Path | None = None


def port_feature(request: PortFeatureRequest) -> ReadNoteResult:
    """Refuse every feature, as a step does for a feature no edit supports."""
    raise UnsupportedFeatureError(
        f"{request.model_name} has a feature no edit supports: {request.feature}. Nothing was written.",
        [request.feature],
    )


class RunChildRequest(BaseModel):
    model_name: str
    pid_file: str = Field(description="where the child writes its pid once it runs")
    seconds: float = Field(default=300.0, description="how long the child sleeps")
    workspace: Path | None = None


def run_sleeping_child(request: RunChildRequest) -> ReadNoteResult:
    """Run a child process that sleeps, as a stage run waits on pytest: cancelling the call kills it."""
    code = f"import os, time; open({request.pid_file!r}, 'w').write(str(os.getpid())); time.sleep({request.seconds})"
    proc = run_child([sys.executable, "-c", code], cwd=Path(request.pid_file).parent, env={}, timeout=600)
    return ReadNoteResult(text=f"exit {proc.returncode}")


class PeerLostRequest(BaseModel):
    model_name: str
    fail: bool = Field(default=False, description="raise the message instead of returning it")
    workspace: Path | None = None


class PeerLostResult(BaseModel):
    passed: bool
    detail: str


def peer_lost(request: PeerLostRequest) -> PeerLostResult:
    """Report a distributed run whose peer left, as gloo words it: the endpoint (a port the OS
    picks), the peer's process id and the time waited differ in every run."""
    start = time.perf_counter()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    peer = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.01,))
    peer.start()
    peer.join()
    detail = (
        f"rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:{port} (peer pid {peer.pid}, "
        f"exit code {peer.exitcode}, after {time.perf_counter() - start:.3f}s)"
    )
    if request.fail:
        raise RuntimeError(detail)
    return PeerLostResult(passed=False, detail=detail)


TOY_ENTRIES = (
    ToolEntry(name="toy_append_note", target=f"{__name__}:append_note", package_field="model_name", long_running=True),
    ToolEntry(name="toy_read_note", target=f"{__name__}:read_note", read_only=True, package_field="model_name"),
    ToolEntry(name="toy_rewrite_note", target=f"{__name__}:rewrite_note", destructive=True, package_field="model_name"),
    ToolEntry(name="toy_port_feature", target=f"{__name__}:port_feature", read_only=True, package_field="model_name"),
    ToolEntry(
        name="toy_run_child", target=f"{__name__}:run_sleeping_child", package_field="model_name", long_running=True
    ),
    ToolEntry(name="toy_peer_lost", target=f"{__name__}:peer_lost", read_only=True, package_field="model_name"),
)


def register_toy_tools() -> list[str]:
    """Register the toy steps not registered yet (a server process of a test); their names."""
    from skill import tools

    added = []
    for entry in TOY_ENTRIES:
        if entry.name not in tools.load_tools():
            tools.register_tool(entry)
            added.append(entry.name)
    return added
