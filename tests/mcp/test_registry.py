"""The step registry: every entry resolves, requests are confined, package locks hold."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import BaseModel

from skill import tools
from skill.codemod.workspace import Workspace, WorkspaceError


def test_every_registered_step_resolves_to_typed_function():
    loaded = tools.load_tools()
    for entry in tools.TOOL_ENTRIES:
        tool = loaded[entry.name]
        assert issubclass(tool.input_model, BaseModel) and issubclass(tool.result_model, BaseModel)
        assert len(tool.description) > 20, f"{entry.name} needs a docstring telling an agent what it does"
        if entry.package_field:
            assert entry.package_field in tool.input_model.model_fields


def _two_params(a: BaseModel, b: BaseModel) -> BaseModel:
    """Not a step: two parameters."""
    return a


def _untyped(request):
    """Not a step: no annotations."""
    return request


@pytest.mark.parametrize(
    ("target", "match"), [(f"{__name__}:_two_params", "exactly one"), (f"{__name__}:_untyped", "BaseModel")]
)
def test_registry_rejects_what_is_not_a_step(target, match):
    with pytest.raises(tools.ToolRegistryError, match=match):
        tools.register_tool(tools.ToolEntry(name="not_a_step", target=target))


def test_unknown_tool_lists_the_available_ones():
    with pytest.raises(KeyError, match="copy_reference"):
        tools.get_tool("no_such_tool")


def test_request_paths_are_confined_to_the_workspace(workspace: Path, tmp_path: Path):
    ws = Workspace(workspace)
    tool = tools.get_tool("toy_read_note")
    request = tool.input_model and tools.prepare_request(tool, {"model_name": "m", "note": "notes/a.txt"}, ws)
    assert request.note == workspace / "notes" / "a.txt"
    assert request.workspace == ws.root
    outside = tmp_path / "elsewhere.txt"
    for value in (str(outside), "../elsewhere.txt", "archon_models/../../elsewhere.txt"):
        with pytest.raises(WorkspaceError, match="outside the workspace"):
            tools.prepare_request(tool, {"model_name": "m", "note": value}, ws)
    with pytest.raises(WorkspaceError, match="outside the workspace"):
        tools.prepare_request(tool, {"model_name": "m", "note": "a.txt", "workspace": str(tmp_path)}, ws)


def test_path_fields_given_as_strings_are_confined(workspace: Path):
    ws = Workspace(workspace)
    tool = tools.get_tool("check_package")
    with pytest.raises(WorkspaceError, match="source='/etc'"):
        tools.prepare_request(tool, {"model_name": "m", "source": "/etc"}, ws)
    # A bare model_type is not a path and passes unchanged.
    assert tools.prepare_request(tool, {"model_name": "m", "source": "mistral"}, ws).source == "mistral"


def test_exclusive_package_lock_refuses_or_waits(workspace: Path):
    ws = Workspace(workspace)
    held = threading.Event()
    release = threading.Event()

    def holder():
        with tools.package_lock(ws, "mistral", exclusive=True, holder="edit_model"):
            held.set()
            release.wait(5)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(5)
    with (
        pytest.raises(tools.ToolBusyError, match="edit_model"),
        tools.package_lock(ws, "mistral", exclusive=False, holder="check_package", timeout=0),
    ):
        pass
    # Another package is independent.
    with tools.package_lock(ws, "llama", exclusive=True, holder="edit_model", timeout=0):
        pass
    threading.Timer(0.2, release.set).start()
    with tools.package_lock(ws, "mistral", exclusive=True, holder="register_spec", timeout=5):
        pass
    thread.join()


def test_shared_package_locks_coexist(workspace: Path):
    ws = Workspace(workspace)
    with (
        tools.package_lock(ws, "mistral", exclusive=False, holder="a", timeout=0),
        tools.package_lock(ws, "mistral", exclusive=False, holder="b", timeout=0),
    ):
        pass


def test_a_change_to_a_not_yet_named_package_holds_the_whole_workspace(workspace: Path):
    """port_model without model_name may write any package: it excludes every package call."""
    ws = Workspace(workspace)
    with tools.package_lock(ws, tools.WORKSPACE_LOCK, exclusive=True, holder="port_model"):
        with pytest.raises(tools.ToolBusyError, match="the workspace is busy: port_model"):
            tools.invoke("toy_append_note", {"model_name": "m", "text": "x"}, workspace=ws, lock_timeout=0)
        # A step that names no package (the analysis) does not wait for it.
        assert tools.get_tool("analyze_hf_model").entry.package_field is None
    tools.invoke("toy_append_note", {"model_name": "m", "text": "x"}, workspace=ws, lock_timeout=0)
