"""Warm cost of calling an engine step through the registry, a session and the MCP server.

For each step, times the direct function call and the same call through each face, after
one warm-up call (imports, caches), in a throw-away copy of the workspace:

- ``direct``: ``step(InputModel(...))``;
- ``invoke``: ``skill.tools.invoke`` (validation, workspace confinement, package lock);
- ``invoke+session``: the same, recorded into a session (workspace scan, hashes, one JSON line);
- ``mcp in-process``: the SDK's ``Client`` against ``build_server`` in this process, recording;
- ``mcp stdio``: the server as a subprocess over stdio, recording (what an agent sees).

Prints a table of the median per call and the overhead over ``direct``, and the replay
time of the session recorded by the stdio run.

    python bench/mcp_overhead.py [--repeat 20] [--workspace DIR]
"""

from __future__ import annotations

import argparse
import functools
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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
    ("check_package", {"model_name": "llama", "source": "llama"}),
    ("register_spec", {"model_name": "llama", "model_types": ["llama"]}),
]


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


async def _mcp_median_ms(client: Client, name: str, arguments: dict[str, Any], repeat: int) -> float:
    async def once() -> None:
        result = await client.call_tool(name, arguments)
        if result.is_error:
            raise RuntimeError(f"{name} failed: {result.content[0].text}")

    await once()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        await once()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(workspace: Path, repeat: int) -> tuple[list[tuple[str, str, float]], float]:
    rows: list[tuple[str, str, float]] = []
    for name, arguments in CALLS:
        tool = get_tool(name)
        request = tool.input_model.model_validate({**arguments, "workspace": workspace})
        rows.append((name, "direct", _median_ms(functools.partial(tool.function, request), repeat)))
        call = functools.partial(invoke, name, arguments, workspace=workspace)
        rows.append((name, "invoke", _median_ms(call, repeat)))
        with recording(workspace / f"bench-invoke-{name}.jsonl", workspace, close=True) as session:
            rows.append((name, "invoke+session", _median_ms(functools.partial(call, session=session), repeat)))

    async def in_process() -> None:
        async with Client(build_server(workspace, session=workspace / "bench-inproc.jsonl")) as client:
            for name, arguments in CALLS:
                rows.append((name, "mcp in-process", await _mcp_median_ms(client, name, arguments, repeat)))

    stdio_session = workspace / "bench-stdio.jsonl"

    async def stdio() -> None:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "mcp_server", "--workspace", str(workspace), "--session", str(stdio_session)],
            cwd=str(workspace),
        )
        async with Client(params, read_timeout_seconds=300) as client:
            for name, arguments in CALLS:
                rows.append((name, "mcp stdio", await _mcp_median_ms(client, name, arguments, repeat)))

    anyio.run(in_process)
    anyio.run(stdio)
    start = time.perf_counter()
    report = replay_session(ReplayInput(session=stdio_session, source=workspace))
    replay_s = time.perf_counter() - start
    if not report.ok:
        raise RuntimeError(report.describe())
    return rows, replay_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per face (after one warm-up)")
    parser.add_argument("--workspace", type=Path, help="project to copy (default: this one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    source = (args.workspace or find_project_root()).resolve()
    with tempfile.TemporaryDirectory(prefix="archon-port-bench-") as tmp:
        workspace = copy_repository(source, Path(tmp) / "ws")
        rows, replay_s = measure(workspace, args.repeat)
        shutil.rmtree(workspace / ".archon-port", ignore_errors=True)
    direct = {name: ms for name, face, ms in rows if face == "direct"}
    out = sys.stdout
    out.write(f"{'tool':<16} {'face':<16} {'median ms':>10} {'overhead ms':>12}\n")
    for name, face, ms in rows:
        out.write(f"{name:<16} {face:<16} {ms:>10.2f} {ms - direct[name]:>12.2f}\n")
    calls = 2 * (args.repeat + 1)
    out.write(f"\nreplay of the stdio session ({calls} calls, fresh copy, in-process): {replay_s:.1f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
