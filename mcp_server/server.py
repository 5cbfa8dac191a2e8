"""The archon-port MCP server: every engine step a tool, plus the playbook as resources and a prompt.

``build_server(workspace)`` returns an :class:`MCPServer` confined to one workspace (a
project root holding ``archon_models/``). While it runs it records every tool call into
a session (see :mod:`skill.session`), closed when the server shuts down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.server.mcpserver.prompts.base import UserMessage

import skill
from mcp_server.http import serve_http
from mcp_server.state import ServerState
from mcp_server.tools import make_tool
from skill.codemod.workspace import Workspace
from skill.session import SessionRecorder
from skill.tools import DEFAULT_LOCK_TIMEOUT_S, load_tools, state_dir

logger = logging.getLogger(__name__)

SERVER_NAME = "archon-port"
SKILL_URI = "archon://skill"
REFERENCES_URI = "archon://references"
CONTRACTS_URI = "archon://contracts"

INSTRUCTIONS = (
    "Ports a HuggingFace decoder-only model family into Archon (archon_models/) and proves it "
    f"right stage by stage. Read the playbook first: resource {SKILL_URI} (SKILL.md). Each step "
    "is a tool; a failing stage is located with locate_divergence, never guessed."
)


def skill_md_path(workspace: Workspace) -> Path:
    """SKILL.md of the workspace, else the one shipped next to the engine."""
    candidates = [workspace.root / "SKILL.md", Path(skill.__file__).resolve().parent.parent / "SKILL.md"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"SKILL.md not found in {workspace.root} or next to the engine")


def reference_table(workspace: Workspace) -> dict[str, Any]:
    """The guide's decision map: each reference's measured feature values, and what edits produce.

    A family's feature either matches a reference's value, or is in ``edits`` (an engine
    edit produces it, on the references whose ``edits_apply`` is true), or is unsupported;
    ``analyze_hf_model`` does this comparison.
    ``registered`` maps every model_type a package of the workspace already serves to that
    package (read from the spec files): a new package cannot claim those.
    """
    from skill.analysis.reference import EDITABLE_REFERENCES, REFERENCES, reference_values
    from skill.codemod import StagedTree
    from skill.features import FEATURE_TITLES, SUPPORTED_EDITS
    from skill.porting.register_spec import registered_types

    owners = registered_types(StagedTree(workspace))
    references = []
    for name, model_types in REFERENCES.items():
        registered = sorted(t for t, package in owners.items() if package == name)
        features = {
            model_type: {FEATURE_TITLES[f]: value for f, value in reference_values(model_type).items()}
            for model_type in model_types
        }
        references.append(
            {
                "reference": name,
                "package": f"archon_models/{name}",
                "model_types": registered,
                "features": features,
                "edits_apply": name in EDITABLE_REFERENCES,
            }
        )
    edits = {FEATURE_TITLES[f]: sorted(values) for f, values in SUPPORTED_EDITS.items()}
    return {"references": references, "edits": edits, "registered": owners}


def contracts_text(workspace: Workspace) -> str:
    """The contracts a package implements: base.py and model_spec.py, as the workspace has them."""
    parts = ["# Archon contracts\n"]
    for rel in ("archon_models/base.py", "archon_models/model_spec.py"):
        path = workspace.root / rel
        parts.append(f"\n## {rel}\n\n```python\n{path.read_text(encoding='utf-8')}```\n")
    return "".join(parts)


def default_session_path(workspace: Workspace) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return state_dir(workspace, "sessions") / f"serve-{stamp}-{os.getpid()}.jsonl"


class ArchonServer(MCPServer):
    """The MCP server of one workspace; ``archon_state`` is what its tools share (the HTTP face
    cancels the calls in flight through it when it shuts down)."""

    def __init__(self, state: ServerState, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.archon_state = state

    def serve_http(self, host: str, port: int, token: str) -> None:
        """Serve on ``http://host:port/mcp`` behind ``token`` (see :mod:`mcp_server.http`)."""
        serve_http(self, self.archon_state, host, port, token)


def build_server(
    workspace: str | os.PathLike | Workspace | None = None,
    *,
    session: str | os.PathLike | None = None,
    record: bool = True,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
) -> ArchonServer:
    """An MCP server over ``workspace`` (default: the project holding the current directory).

    ``session`` is the session file to record into (default: a new file under
    ``.archon-port/sessions/``); ``record=False`` records nothing. ``lock_timeout`` is how
    long a call waits for a package another call is changing before it is refused.
    """
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    state = ServerState(workspace=ws, lock_timeout=lock_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[ServerState]:
        if record:
            state.recorder = SessionRecorder(session or default_session_path(ws), ws)
        try:
            yield state
        finally:
            if state.recorder is not None:
                state.recorder.close()
                state.recorder = None

    def _latest(model: str, *, stages: bool) -> str:
        try:
            return json.dumps(state.reports.latest(model, stages=stages), indent=2)
        except ValueError as e:  # a client's typo, reported as such rather than as a server fault
            raise ResourceError(str(e)) from e

    server = ArchonServer(
        state,
        SERVER_NAME,
        instructions=INSTRUCTIONS,
        version=skill.__version__,
        tools=[make_tool(tool, state) for tool in load_tools().values()],
        lifespan=lifespan,
    )

    @server.resource(
        SKILL_URI, name="SKILL.md", mime_type="text/markdown", description="The porting playbook for agents"
    )
    def skill_md() -> str:
        return skill_md_path(ws).read_text(encoding="utf-8")

    @server.resource(
        REFERENCES_URI,
        name="references",
        mime_type="application/json",
        description="The references a port starts from (model types, measured feature values), the feature "
        "values engine edits produce, and every model_type a package already registers",
    )
    def references() -> str:
        return json.dumps(reference_table(ws), indent=2)

    @server.resource(
        CONTRACTS_URI,
        name="contracts",
        mime_type="text/markdown",
        description="BaseModelArgs, BaseArchonModel, BaseStateDictAdapter and ModelSpec as this workspace defines them",
    )
    def contracts() -> str:
        return contracts_text(ws)

    @server.resource(
        "archon://models/{model}/report",
        name="model report",
        mime_type="application/json",
        description="The latest result of every non-stage tool run on a package (check_package, port_model, ...)",
    )
    def model_report(model: str) -> str:
        return _latest(model, stages=False)

    @server.resource(
        "archon://models/{model}/stages",
        name="model stage results",
        mime_type="application/json",
        description="The latest run_test_stage result of each stage for a package",
    )
    def model_stages(model: str) -> str:
        return _latest(model, stages=True)

    @server.prompt(name="add_model", description="Start the porting playbook for a HuggingFace model family")
    def add_model(model: str) -> list[UserMessage]:
        playbook = skill_md_path(ws).read_text(encoding="utf-8")
        return [
            UserMessage(
                f"Add the HuggingFace model family `{model}` to Archon in this workspace.\n\n"
                "Follow the playbook below literally, one tool per step, reading each result before "
                "the next call. Do not write package code by hand unless a step says so; when a stage "
                f"fails, call locate_divergence and make the edit it points to.\n\n{playbook}"
            )
        ]

    return server
