"""The MCP server in-process through the SDK's Client: schemas, errors, locks, progress, resources."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from mcp import Client, MCPError

from mcp_server import build_server
from skill import session as sessions
from skill import tools
from skill.replay import ReplayInput, replay_session


def run(coro_fn, *args):
    return anyio.run(coro_fn, *args)


def test_every_registry_step_is_a_tool_with_schemas_and_annotations(workspace: Path):
    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            return {t.name: t for t in (await client.list_tools()).tools}

    listed = run(main)
    for name, tool in tools.load_tools().items():
        mcp_tool = listed[name]
        assert mcp_tool.description == tool.description or mcp_tool.description.startswith(tool.description)
        assert "workspace" not in mcp_tool.input_schema.get("properties", {})
        assert mcp_tool.output_schema is not None
        assert mcp_tool.annotations.read_only_hint is tool.entry.read_only
        assert mcp_tool.annotations.idempotent_hint is tool.entry.idempotent
    assert listed["check_package"].annotations.read_only_hint is True
    assert listed["copy_reference"].annotations.destructive_hint is True


def test_invalid_arguments_come_back_as_a_structured_error(workspace: Path):
    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            return await client.call_tool("toy_append_note", {"model_name": "Bad Name", "delay_s": "soon"})

    result = run(main)
    assert result.is_error
    error = result.structured_content["error"]
    assert error["kind"] == "invalid_arguments"
    assert {f["field"] for f in error["fields"]} == {"model_name", "text", "delay_s"}
    assert "toy_append_note" in result.content[0].text


def test_a_path_outside_the_workspace_is_refused(workspace: Path, tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")

    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            return await client.call_tool("toy_read_note", {"model_name": "m", "note": str(secret)})

    result = run(main)
    assert result.is_error
    assert result.structured_content["error"]["kind"] == "outside_workspace"
    assert "not yours" not in result.content[0].text


def test_a_failing_step_is_a_structured_error_not_a_crash(workspace: Path):
    (workspace / "empty.txt").write_text("")

    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            failed = await client.call_tool("toy_read_note", {"model_name": "m", "note": "empty.txt"})
            listed = await client.list_tools()  # the server is still serving
            return failed, listed

    failed, listed = run(main)
    assert failed.is_error and failed.structured_content["error"]["exception"] == "ValueError"
    assert "append_note first" in failed.structured_content["error"]["message"]
    assert listed.tools


def _concurrent_notes(workspace: Path, lock_timeout: float):
    async def main():
        results = {}
        async with Client(build_server(workspace, record=False, lock_timeout=lock_timeout)) as client:

            async def call(text: str, delay: float):
                results[text] = await client.call_tool(
                    "toy_append_note", {"model_name": "mistral", "text": text, "delay_s": delay}
                )

            notes = workspace / "archon_models" / "mistral" / "NOTES.txt"
            async with anyio.create_task_group() as group:
                group.start_soon(call, "one", 0.9)
                with anyio.fail_after(30):  # "one" holds the package lock once it has begun writing
                    while not (notes.is_file() and "begin one" in notes.read_text()):
                        await anyio.sleep(0.01)
                group.start_soon(call, "two", 0.0)
        return results

    return run(main)


def test_a_second_call_on_the_same_package_waits_and_never_interleaves(workspace: Path):
    results = _concurrent_notes(workspace, lock_timeout=10)
    assert not results["one"].is_error and not results["two"].is_error
    lines = (workspace / "archon_models" / "mistral" / "NOTES.txt").read_text().splitlines()
    assert lines == ["begin one", "end one", "begin two", "end two"]


def test_a_second_call_on_the_same_package_is_refused_when_told_not_to_wait(workspace: Path):
    results = _concurrent_notes(workspace, lock_timeout=0)
    assert not results["one"].is_error
    refused = results["two"]
    assert refused.is_error and refused.structured_content["error"]["kind"] == "package_busy"
    assert "'mistral' is busy: toy_append_note" in refused.structured_content["error"]["message"]
    lines = (workspace / "archon_models" / "mistral" / "NOTES.txt").read_text().splitlines()
    assert lines == ["begin one", "end one"]


def test_long_steps_report_progress(workspace: Path):
    messages = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append((progress, message))

    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            return await client.call_tool(
                "toy_append_note", {"model_name": "m", "text": "p", "delay_s": 0.1}, progress_callback=on_progress
            )

    result = run(main)
    assert not result.is_error
    texts = [m for _, m in messages]
    assert texts[0] == "toy_append_note started"
    assert texts[1:] == [f"note p: step {i} of 3" for i in (1, 2, 3)]
    assert [p for p, _ in messages] == sorted(p for p, _ in messages)


def test_resources_and_the_add_model_prompt(workspace: Path):
    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            await client.call_tool("toy_append_note", {"model_name": "mistral", "text": "r"})
            listed = {str(r.uri) for r in (await client.list_resources()).resources}
            templates = {t.uri_template for t in (await client.list_resource_templates()).resource_templates}
            read = {}
            for uri in (
                "archon://skill",
                "archon://contracts",
                "archon://references",
                "archon://models/mistral/report",
            ):
                read[uri] = (await client.read_resource(uri)).contents[0].text
            prompt = await client.get_prompt("add_model", {"model": "mistral"})
            return listed, templates, read, prompt

    listed, templates, read, prompt = run(main)
    assert {"archon://skill", "archon://contracts", "archon://references"} <= listed
    assert {"archon://models/{model}/report", "archon://models/{model}/stages"} <= templates
    assert read["archon://skill"].startswith("---\nname: ")
    assert "class BaseStateDictAdapter" in read["archon://contracts"]
    table = json.loads(read["archon://references"])
    assert table["registered"]["qwen3_moe"] == "qwen3"
    assert {r["reference"]: r["model_types"] for r in table["references"]} == {
        "qwen2": ["qwen2"],
        "qwen3": ["qwen3", "qwen3_moe"],
        "deepseek_v3": ["deepseek_v3"],
        "qwen3_5": ["qwen3_5_moe_text", "qwen3_5_text"],
    }
    qwen3 = next(r for r in table["references"] if r["reference"] == "qwen3")
    deepseek = next(r for r in table["references"] if r["reference"] == "deepseek_v3")
    assert deepseek["features"]["deepseek_v3"]["multi-head latent attention"] == "true"
    assert (qwen3["edits_apply"], deepseek["edits_apply"]) == (True, False)
    assert qwen3["features"]["qwen3"]["QK norm"] == "per_head_rms"
    assert {"none", "per_head_rms"} <= set(table["edits"]["QK norm"])
    report = json.loads(read["archon://models/mistral/report"])
    assert report["toy_append_note"]["arguments"]["text"] == "r"
    text = prompt.messages[0].content.text
    assert "`mistral`" in text and "locate_divergence" in text and read["archon://skill"] in text


def test_the_server_records_a_session_that_replays(workspace: Path):
    path = workspace / "served.jsonl"

    async def main():
        async with Client(build_server(workspace, session=path)) as client:
            await client.call_tool("toy_append_note", {"model_name": "qwen_like", "text": "a"})
            await client.call_tool("toy_rewrite_note", {"model_name": "qwen_like", "content": "fresh\n"})
            await client.call_tool("toy_append_note", {"model_name": "Bad"})  # refused before it runs

    run(main)
    records = sessions.read_session(path)
    assert [r.kind for r in records] == ["session", "call", "call", "close"]
    assert records[2].files["archon_models/qwen_like/NOTES.txt"] is not None
    report = replay_session(ReplayInput(session=path, source=workspace))
    assert report.ok, report.describe()


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("archon://models/..%2F..%2Fetc/report", "Unknown resource"),
        ("archon://models/NOPE/stages", "not a package name"),
    ],
)
def test_model_resources_refuse_what_is_not_a_package_name(workspace: Path, uri: str, message: str):
    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            try:
                await client.read_resource(uri)
            except MCPError as e:
                return e
        return None

    error = run(main)
    assert error is not None and message in str(error)


def test_streamable_http_serves_on_localhost(workspace: Path):
    """The HTTP transport: the same tools at http://127.0.0.1:<port>/mcp (the CLI's default host)."""
    import socket
    import threading

    import uvicorn
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    from mcp_server.http import http_app
    from skill.cli import build_parser

    args = build_parser().parse_args(["serve", "--http", "0"])
    assert args.host == "127.0.0.1"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "token-of-test-streamable-http"
    app = http_app(build_server(workspace, record=False), "127.0.0.1", token)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:

        async def main():
            while not server.started:
                await anyio.sleep(0.05)
            http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
            async with http, Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http)) as client:
                names = {t.name for t in (await client.list_tools()).tools}
                result = await client.call_tool("toy_append_note", {"model_name": "http", "text": "over http"})
                return names, result

        names, result = run(main)
    finally:
        server.should_exit = True
        thread.join(10)
    assert set(tools.load_tools()) <= names
    assert not result.is_error and result.structured_content["lines"] == 2
