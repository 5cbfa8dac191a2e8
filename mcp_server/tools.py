"""Engine steps as MCP tools: schema, annotations, progress and structured errors.

Nothing here does porting work. Each tool validates nothing itself and calls
:func:`skill.tools.invoke` on a worker thread; the engine's input model is the tool's
input schema and its result model the output schema. Failures come back as tool
results with ``isError`` set and a structured ``error`` object (what kind of failure,
the message, and for bad arguments each offending field), so an agent can correct its
call instead of seeing a protocol error.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.tools import Tool as MCPTool
from mcp.server.mcpserver.utilities.func_metadata import ArgModelBase, FuncMetadata
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from mcp_server.state import ServerState
from skill.codemod.workspace import CallCancelledError, WorkspaceError
from skill.errors import HAND_PORT_POINTER, points_to_hand_port, step_error_message
from skill.tools import InvalidArgumentsError, Tool, ToolBusyError, invoke

logger = logging.getLogger(__name__)

# Seconds between "still running" progress notifications of a long step.
HEARTBEAT_S = 5.0


class FieldProblem(BaseModel):
    """One invalid argument: where it is and what is wrong with it."""

    field: str
    problem: str


class ToolFailure(BaseModel):
    """The structured content of a failed call."""

    tool: str
    kind: Literal["invalid_arguments", "outside_workspace", "package_busy", "step_failed"]
    exception: str
    message: str
    fields: list[FieldProblem] = []
    see: str | None = Field(
        default=None,
        description="where the playbook says what to do next (SKILL.md, resource archon://skill), when the "
        "failure is an unsupported feature or a missing file",
    )


class _AnyArguments(ArgModelBase):
    """Lets every argument object through to the engine's own validation.

    The advertised input schema is the engine's input model; validating here as well
    would turn bad arguments into the SDK's plain-text error before the engine could
    name each field.
    """

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    def model_dump_one_level(self) -> dict[str, Any]:
        return {"arguments": dict(self.__pydantic_extra__ or {})}


def input_schema(tool: Tool) -> dict[str, Any]:
    """The engine input model's JSON schema, less ``workspace`` (the server fills it)."""
    schema = tool.input_model.model_json_schema()
    schema.get("properties", {}).pop("workspace", None)
    if "required" in schema:
        schema["required"] = [name for name in schema["required"] if name != "workspace"]
    return schema


def tool_annotations(tool: Tool) -> ToolAnnotations:
    entry = tool.entry
    return ToolAnnotations(
        title=entry.title,
        read_only_hint=entry.read_only,
        destructive_hint=False if entry.read_only else entry.destructive,
        idempotent_hint=entry.idempotent,
        open_world_hint=False,
    )


def failure_result(tool: Tool, error: BaseException) -> CallToolResult:
    """A tool result with ``isError`` and a :class:`ToolFailure` as structured content."""
    if isinstance(error, InvalidArgumentsError):
        failure = ToolFailure(
            tool=tool.name,
            kind="invalid_arguments",
            exception=type(error).__name__,
            message=str(error),
            fields=[FieldProblem(field=field, problem=problem) for field, problem in error.problems],
        )
    else:
        kind = "step_failed"
        if isinstance(error, WorkspaceError):
            kind = "outside_workspace"
        elif isinstance(error, ToolBusyError):
            kind = "package_busy"
        failure = ToolFailure(
            tool=tool.name,
            kind=kind,
            exception=type(error).__name__,
            message=step_error_message(error),
            see=f"{HAND_PORT_POINTER} (resource archon://skill)" if points_to_hand_port(error) else None,
        )
    return CallToolResult(
        content=[TextContent(type="text", text=f"{failure.kind}: {failure.message}")],
        structured_content={"error": failure.model_dump(mode="json")},
        is_error=True,
    )


class _Progress:
    """Sends the running step's log records, and a heartbeat for long steps, as progress."""

    def __init__(self, ctx: Context, tool: Tool):
        self.ctx = ctx
        self.tool = tool
        self.count = 0
        self.start = time.monotonic()

    async def send(self, message: str) -> None:
        self.count += 1
        try:
            await self.ctx.report_progress(self.count, None, message)
        except Exception:  # the client may have gone; the step goes on
            logger.debug("progress notification failed", exc_info=True)

    def from_worker(self, message: str) -> None:
        anyio.from_thread.run(self.send, message)

    async def heartbeat(self) -> None:
        while True:
            await anyio.sleep(HEARTBEAT_S)
            await self.send(f"{self.tool.name} still running ({time.monotonic() - self.start:.0f} s)")


def make_tool(tool: Tool, state: ServerState) -> MCPTool:
    """The MCP tool for one engine step."""

    async def run(arguments: dict[str, Any], ctx: Context) -> Any:
        progress = _Progress(ctx, tool)
        cancel = threading.Event()
        call: Callable[[], BaseModel] = functools.partial(
            invoke,
            tool.name,
            arguments,
            workspace=state.workspace,
            session=state.recorder,
            progress=progress.from_worker,
            lock_timeout=state.lock_timeout,
            cancel=cancel,
            # A client gets a session file's trust, not the person's at the keyboard: export's
            # AReaL tree must lie inside the workspace and it cannot name a Python to run.
            allow_external=False,
        )
        error: Exception | None = None
        async with anyio.create_task_group() as group:
            if tool.entry.long_running:
                await progress.send(f"{tool.name} started")
                group.start_soon(progress.heartbeat)
            try:
                # A client that cancels or goes away stops the wait at once; the step then
                # stops at its next check (before it commits, or its stage child is killed).
                # So does the server's shutdown (state.cancel_calls).
                with state.running_call(cancel):
                    result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
            except anyio.get_cancelled_exc_class():
                logger.info("%s cancelled by the client; it writes nothing", tool.name)
                cancel.set()
                raise
            except Exception as e:  # every failure is the agent's to read, as a structured result
                error = e
            finally:
                group.cancel_scope.cancel()
        if error is not None:
            if isinstance(error, CallCancelledError):
                logger.info("%s cancelled: %s", tool.name, error)
            elif not isinstance(error, WorkspaceError | ToolBusyError | ValueError):
                logger.error("tool %s failed", tool.name, exc_info=error)
            return failure_result(tool, error)
        state.reports.save(tool, arguments, result)
        return result

    description = tool.description
    if tool.entry.long_running:
        description += " Long-running: sends progress notifications while it runs."
    return MCPTool(
        fn=run,
        name=tool.name,
        title=tool.entry.title,
        description=description,
        parameters=input_schema(tool),
        fn_metadata=FuncMetadata(arg_model=_AnyArguments, output_model=tool.result_model),
        is_async=True,
        context_kwarg="ctx",
        annotations=tool_annotations(tool),
    )
