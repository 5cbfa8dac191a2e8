"""``serve --http``: a bearer token on every request, Host/Origin checks on every loopback host,
SIGTERM cancels the calls in flight, and Ctrl-C on ``python -m mcp_server`` is one line.

Each test starts the server as a user does, in its own process (``python -m skill.cli serve``
or ``python -m mcp_server``), with the toy steps registered."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx2 as httpx
import pytest

from skill.serving import TOKEN_ENV, server_token
from tests.mcp.conftest import make_workspace
from tests.processes import process_gone, wait_for

REPO = Path(__file__).resolve().parents[2]
TOKEN = "a-token-for-the-tests-0123456789"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}
MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass
class Served:
    process: subprocess.Popen[str]
    url: str
    log: list[str]

    def post(self, headers: dict[str, str] | None = None, token: str | None = TOKEN) -> httpx.Response:
        sent = {**MCP_HEADERS, **(headers or {})}
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        return httpx.post(self.url, json=INITIALIZE, headers=sent, timeout=60)


def _serve(workspace: Path, host: str, *, env: dict[str, str] | None = None) -> Served:
    port = _free_port("127.0.0.1" if host.lower() == "localhost" else host)
    script = textwrap.dedent(
        f"""
        import sys
        from tests.mcp.toy_steps import register_toy_tools
        register_toy_tools()
        from mcp_server.main import main
        sys.exit(main(["--workspace", {str(workspace)!r}, "--no-record", "--http", "{port}", "--host", {host!r}]))
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env if env is not None else {TOKEN_ENV: TOKEN})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log: list[str] = []
    deadline = time.monotonic() + 180
    assert process.stderr is not None
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        log.append(line)
        if "serving streamable HTTP" in line or not line:
            break
    assert "serving streamable HTTP" in log[-1], "".join(log)
    name = f"[{host}]" if ":" in host else host.lower()
    served = Served(process, f"http://{name}:{port}/mcp", log)
    # The log line comes just before uvicorn binds: wait for the port.
    assert wait_for(lambda: _listening(host, port), timeout=60), "".join(log)
    return served


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=1):
            return True
    except OSError:
        return False


def _stop(served: Served) -> str:
    """Kill the server if it still runs; the rest of its stderr."""
    if served.process.poll() is None:
        served.process.kill()
    return served.process.communicate(timeout=60)[1]


# One server (a process importing the engine, ~8 CPU-s to start) answers both tests that only
# send it requests; their xdist group keeps them on one worker, so it starts once per run.
SHARED_SERVER = pytest.mark.xdist_group("http_token_server")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = _serve(make_workspace(tmp_path_factory.mktemp("http") / "ws"), "127.0.0.1")
    yield server
    _stop(server)


@SHARED_SERVER
def test_a_request_without_the_token_gets_401_and_one_line(served: Served):
    for token in (None, "wrong-token-wrong-token", TOKEN.upper()):
        refused = served.post(token=token)
        assert refused.status_code == 401, refused.text
        assert refused.text.count("\n") == 1 and refused.text.startswith("archon-port: unauthorized: ")
        assert "Bearer" in refused.headers["www-authenticate"]
    accepted = served.post()
    assert accepted.status_code == 200, accepted.text
    assert "serverInfo" in accepted.text


@SHARED_SERVER
def test_a_client_with_the_token_calls_tools(served: Served):
    from mcp import Client
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    async def call():
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"})
        async with http, Client(streamable_http_client(served.url, http_client=http)) as client:
            return await client.call_tool("toy_append_note", {"model_name": "http", "text": "over http"})

    result = anyio.run(call)
    assert not result.is_error and result.structured_content["lines"] == 2


def test_without_the_environment_variable_a_token_is_made_and_printed(workspace: Path):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    server = _serve(workspace, "127.0.0.1", env=env)
    try:
        printed = re.search(r"Authorization: Bearer ([\w-]+)'", server.log[-1])
        assert printed is not None, server.log[-1]
        assert server.post(token=printed.group(1)).status_code == 200
        assert server.post(token=None).status_code == 401
    finally:
        _stop(server)


def test_a_weak_token_in_the_environment_is_refused_with_one_line():
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} must hold at least 16"):
        server_token({TOKEN_ENV: "short"})
    token, made = server_token({})
    assert made and len(token) >= 32
    assert server_token({TOKEN_ENV: TOKEN}) == (TOKEN, False)


@pytest.mark.parametrize("host", ["127.0.0.2", "LOCALHOST"])
def test_every_loopback_host_keeps_the_host_and_origin_checks(workspace: Path, host: str):
    server = _serve(workspace, host)
    try:
        port = server.url.rsplit(":", 1)[1].split("/")[0]
        assert server.post().status_code == 200
        assert server.post({"Origin": f"http://{host.lower()}:{port}"}).status_code == 200
        assert server.post({"Host": f"evil.example:{port}"}).status_code == 421
        assert server.post({"Origin": "http://evil.example"}).status_code == 403
    finally:
        _stop(server)


def test_the_checks_cover_every_spelling_of_loopback_and_no_remote_host():
    from mcp_server.http import transport_security

    for host, name in (("::1", "[::1]"), ("[::1]", "[::1]"), ("127.9.9.9", "127.9.9.9"), ("LocalHost.", "localhost")):
        checks = transport_security(host)
        assert checks.enable_dns_rebinding_protection, host
        assert f"{name}:*" in checks.allowed_hosts and f"http://{name}:*" in checks.allowed_origins
    assert not transport_security("0.0.0.0").enable_dns_rebinding_protection
    assert not transport_security("192.168.1.5").enable_dns_rebinding_protection


SLEEPING_CALL = "toy_run_child"


def test_sigterm_with_a_call_in_flight_cancels_it_and_exits_within_seconds(workspace: Path, tmp_path: Path):
    from mcp import Client
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    server = _serve(workspace, "127.0.0.1")
    pid_file = tmp_path / "child.pid"

    async def call():
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"})
        async with http, Client(streamable_http_client(server.url, http_client=http)) as client:
            await client.call_tool(SLEEPING_CALL, {"model_name": "sleepy", "pid_file": str(pid_file)})

    def client_thread() -> None:
        with contextlib.suppress(BaseException):  # the server goes away under it: that is the point
            anyio.run(call)

    threading.Thread(target=client_thread, daemon=True).start()
    try:
        assert wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip(), timeout=120), "never started"
        child = int(pid_file.read_text())
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        exited = wait_for(lambda: server.process.poll() is not None, timeout=30)
        took = time.monotonic() - started
        assert exited, f"the server still runs {took:.0f} s after SIGTERM"
        assert took < 20, took
        assert wait_for(lambda: process_gone(child), timeout=10), "the call's child outlived the server"
    finally:
        rest = _stop(server)
    assert server.process.returncode == 143, rest
    assert "Traceback" not in rest, rest


def test_ctrl_c_on_python_m_mcp_server_is_one_line_and_exit_130(workspace: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcp_server", "--workspace", str(workspace), "--no-record"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if "serving over stdio" in line or not line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"exit {proc.returncode}: " + "".join(lines) + rest
    assert rest.strip().splitlines() == ["archon-port: interrupted (an interrupted write is rolled back)"], rest
