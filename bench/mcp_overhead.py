"""Warm cost of calling an engine step through the registry, a session and the MCP server.

For each step and each face, after one warm-up call (imports, caches), in a throw-away
copy of the workspace, the face's call and the direct function call are timed in
alternation, and the overhead is the median of the per-pair differences: on a shared,
loaded machine that cancels the drift that makes two separate medians incomparable.
Faces:

- ``invoke``: ``skill.tools.invoke`` (validation, workspace confinement, package lock);
- ``invoke +session``: the same, recorded into a session (workspace scans, hashes, one JSON line);
- ``mcp in-process``: the SDK's ``Client`` against ``build_server`` in this process;
- ``mcp stdio``: the server as a subprocess over stdio (what an agent sees);

each MCP face without and with a session (the server records by default). Prints the
table and the time to replay the session recorded by the stdio run.

    python bench/mcp_overhead.py [--repeat 30] [--workspace DIR]
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

from mcp_server import build_server
from skill.codemod.workspace import find_project_root
from skill.replay import ReplayInput, copy_repository, replay_session
from skill.session import recording
from skill.tools import get_tool, invoke

logger = logging.getLogger("bench.mcp_overhead")

# Steps cheap and deterministic enough that the face's cost is visible: a read-only
# check and an idempotent write that finds nothing to change.
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("register_spec", {"model_name": "llama", "model_types": ["llama"]}),
    ("check_package", {"model_name": "llama", "source": "llama"}),
]


class Row:
    def __init__(self, tool: str, face: str, face_ms: list[float], direct_ms: list[float]):
        self.tool = tool
        self.face = face
        self.face_ms = statistics.median(face_ms)
        self.direct_ms = statistics.median(direct_ms)
        self.overhead_ms = statistics.median(f - d for f, d in zip(face_ms, direct_ms, strict=True))


async def _paired(
    tool: str, face: str, call: Callable[[], Awaitable[Any]], direct: Callable[[], Any], repeat: int
) -> Row:
    await call()  # warm-up
    direct()
    face_ms, direct_ms = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        await call()
        face_ms.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        direct()
        direct_ms.append((time.perf_counter() - start) * 1000)
    return Row(tool, face, face_ms, direct_ms)


def _as_async(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return fn()

    return call


def _mcp_call(client: Client, name: str, arguments: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> None:
        result = await client.call_tool(name, arguments)
        if result.is_error:
            raise RuntimeError(f"{name} failed: {result.content[0].text}")

    return call


def measure(workspace: Path, repeat: int) -> tuple[list[Row], float, int]:
    rows: list[Row] = []
    directs = {}
    for name, arguments in CALLS:
        tool = get_tool(name)
        directs[name] = functools.partial(
            tool.function, tool.input_model.model_validate({**arguments, "workspace": workspace})
        )

    async def registry_faces() -> None:
        for name, arguments in CALLS:
            call = functools.partial(invoke, name, arguments, workspace=workspace)
            rows.append(await _paired(name, "invoke", _as_async(call), directs[name], repeat))
            with recording(workspace / f"bench-invoke-{name}.jsonl", workspace, close=True) as session:
                recorded = _as_async(functools.partial(call, session=session))
                rows.append(await _paired(name, "invoke +session", recorded, directs[name], repeat))

    async def in_process(record: bool) -> None:
        server = build_server(workspace, session=workspace / "bench-inproc.jsonl", record=record)
        async with Client(server) as client:
            for name, arguments in CALLS:
                face = "mcp in-process" + (" +session" if record else "")
                rows.append(await _paired(name, face, _mcp_call(client, name, arguments), directs[name], repeat))

    stdio_session = workspace / "bench-stdio.jsonl"

    async def stdio(record: bool) -> None:
        recording_args = ["--session", str(stdio_session)] if record else ["--no-record"]
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "mcp_server", "--workspace", str(workspace), *recording_args],
            cwd=str(workspace),
        )
        async with Client(params, read_timeout_seconds=300) as client:
            for name, arguments in CALLS:
                face = "mcp stdio" + (" +session" if record else "")
                rows.append(await _paired(name, face, _mcp_call(client, name, arguments), directs[name], repeat))

    anyio.run(registry_faces)
    for record in (False, True):
        anyio.run(in_process, record)
    for record in (False, True):
        anyio.run(stdio, record)
    start = time.perf_counter()
    report = replay_session(ReplayInput(session=stdio_session, source=workspace))
    replay_s = time.perf_counter() - start
    if not report.ok:
        raise RuntimeError(report.describe())
    return rows, replay_s, report.calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="timed pairs per face (after one warm-up)")
    parser.add_argument("--workspace", type=Path, help="project to copy (default: this one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    source = (args.workspace or find_project_root()).resolve()
    with tempfile.TemporaryDirectory(prefix="archon-port-bench-") as tmp:
        workspace = copy_repository(source, Path(tmp) / "ws")
        rows, replay_s, calls = measure(workspace, args.repeat)
    out = sys.stdout
    out.write(f"{'tool':<15} {'face':<24} {'face ms':>9} {'direct ms':>10} {'overhead ms':>12}\n")
    for row in sorted(rows, key=lambda r: r.tool):
        out.write(
            f"{row.tool:<15} {row.face:<24} {row.face_ms:>9.2f} {row.direct_ms:>10.2f} {row.overhead_ms:>12.2f}\n"
        )
    out.write(f"\nreplay of the stdio session ({calls} calls, fresh copy, in-process): {replay_s:.1f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
