"""A client that knows only SKILL.md and the tool list, and follows the playbook literally.

It reads the ``**Tool:**`` / ``**Call:**`` lines of SKILL.md's "Step by step" section in
order, fills the placeholders SKILL.md defines (``<source>``, ``<model_name>``,
``<model_types>``, ``<reference>``, ``<stage>``) and calls each tool over MCP. When a stage
fails it calls the tool of the "When a stage fails" section and stops. It is the
end-to-end proof that SKILL.md plus the tools port a family, and the recorder of the
sessions kept under ``tests/mcp/sessions/``, re-recorded when the engine's output changes:

    python -m tests.mcp.scripted_client --refresh [family ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, StdioServerParameters

logger = logging.getLogger(__name__)

_TOOL_RE = re.compile(r"^\*\*Tool:\*\* `(?P<tool>[a-z_]+)`\s*$")
_CALL_RE = re.compile(r"^\*\*Call:\*\* `(?P<call>\{.*\})`(?P<rest>.*)$")
_STAGES_RE = re.compile(r"`<stage>` = (?P<stages>[\d, ]+)")
# SKILL.md step 3: a step that names the right reference to copy from.
_RECOPY_RE = re.compile(r"Run copy_reference\(reference='(?P<reference>[a-z0-9_]+)', overwrite=True\) first")
# SKILL.md's "Values you fill in": placeholders taken from earlier results, by result field.
RESULT_VALUES = {"reference": "reference", "model_types": "variant_types"}


@dataclass
class PlaybookStep:
    tool: str
    call: str
    stages: list[int] = field(default_factory=list)


@dataclass
class Playbook:
    steps: list[PlaybookStep]
    on_stage_failure: PlaybookStep | None


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\s*$(?P<body>.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError(f"SKILL.md has no section '## {title}'")
    return match["body"]


def _steps(section: str) -> list[PlaybookStep]:
    steps: list[PlaybookStep] = []
    lines = section.splitlines()
    for index, line in enumerate(lines):
        tool = _TOOL_RE.match(line)
        if tool is None:
            continue
        call = _CALL_RE.match(lines[index + 1]) if index + 1 < len(lines) else None
        if call is None:
            raise ValueError(f"SKILL.md: the **Tool:** line of {tool['tool']} is not followed by a **Call:** line")
        stages = _STAGES_RE.search(call["rest"])
        steps.append(
            PlaybookStep(
                tool=tool["tool"],
                call=call["call"],
                stages=[int(s) for s in stages["stages"].replace(" ", "").split(",") if s] if stages else [],
            )
        )
    return steps


def read_playbook(skill_md: str) -> Playbook:
    """The ordered tool calls of SKILL.md's "Step by step" and its stage-failure tool."""
    steps = _steps(_section(skill_md, "Step by step"))
    failure = _steps(_section(skill_md, "When a stage fails"))
    return Playbook(steps=steps, on_stage_failure=failure[0] if failure else None)


def fill(template: str, values: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments: each ``<name>`` placeholder replaced by its JSON value."""
    text = template
    for name, value in values.items():
        text = text.replace(f'"<{name}>"', json.dumps(value)).replace(f"<{name}>", json.dumps(value))
    left = re.findall(r"<([a-z_]+)>", text)
    if left:
        raise ValueError(f"SKILL.md placeholder(s) {left} have no value at this step")
    return json.loads(text)


def _find(value: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in a JSON result."""
    if isinstance(value, dict):
        if key in value:
            return value[key]
        for item in value.values():
            found = _find(item, key)
            if found is not None:
                return found
    if isinstance(value, list):
        for item in value:
            found = _find(item, key)
            if found is not None:
                return found
    return None


@dataclass
class Transcript:
    calls: list[tuple[str, dict[str, Any], dict[str, Any] | None, bool]] = field(default_factory=list)
    passed: bool = False
    failed_at: str | None = None


class PlaybookRun:
    """One port driven over MCP: SKILL.md's playbook, the placeholder values it defines, the
    transcript of every call. What the scripted client and the hand-port client share."""

    def __init__(self, client: Client, playbook: Playbook, source: str, model_name: str | None = None):
        self.client = client
        self.playbook = playbook
        self.name = model_name or source.lower().replace("-", "_")
        self.values: dict[str, Any] = {"source": source, "model_name": self.name, "model_types": [source]}
        self.transcript = Transcript()

    @classmethod
    async def start(cls, client: Client, source: str, model_name: str | None = None) -> PlaybookRun:
        """Read SKILL.md from the server and check it names only tools the server lists."""
        skill_md = (await client.read_resource("archon://skill")).contents[0].text
        playbook = read_playbook(skill_md)
        available = {tool.name for tool in (await client.list_tools()).tools}
        missing = [step.tool for step in playbook.steps if step.tool not in available]
        if missing:
            raise RuntimeError(f"SKILL.md names tools the server does not list: {missing}")
        return cls(client, playbook, source, model_name)

    def step(self, tool: str) -> PlaybookStep:
        return next(step for step in self.playbook.steps if step.tool == tool)

    def arguments(self, step: PlaybookStep, **extra: Any) -> dict[str, Any]:
        """The step's **Call:** filled with the values known so far."""
        return fill(step.call, {**self.values, **extra})

    async def call(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any] | None:
        result = await self.client.call_tool(tool, arguments)
        content = result.structured_content
        self.transcript.calls.append((tool, arguments, content, not result.is_error))
        logger.info("%s %s -> %s", tool, json.dumps(arguments), "error" if result.is_error else "ok")
        if result.is_error:
            self.transcript.failed_at = tool
            raise RuntimeError(f"{tool} failed: {result.content[0].text}")
        return content

    async def call_step(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any] | None:
        """One step; when it says the copy came from the wrong reference, recopy as SKILL.md says.
        Then take SKILL.md's placeholder values from the result."""
        try:
            content = await self.call(tool, arguments)
        except RuntimeError as e:
            wrong_copy = _RECOPY_RE.search(str(e))
            if wrong_copy is None:
                raise
            self.transcript.failed_at = None
            self.values["reference"] = wrong_copy["reference"]
            await self.call("copy_reference", {**self.arguments(self.step("copy_reference")), "overwrite": True})
            content = await self.call(tool, arguments)
        for placeholder, key in RESULT_VALUES.items():
            found = _find(content, key)
            if found:
                self.values[placeholder] = found
        if "variant_types" in content:  # SKILL.md: less the types another package registers
            table = json.loads((await self.client.read_resource("archon://references")).contents[0].text)
            owners = table["registered"]
            self.values["model_types"] = [
                t for t in self.values["model_types"] if owners.get(t, self.name) == self.name
            ]
        return content

    async def run_stage(self, step: PlaybookStep, stage: int, **extra: Any) -> bool:
        """One stage; when it fails, the tool of SKILL.md's "When a stage fails" (same ``extra``)."""
        content = await self.call(step.tool, {**self.arguments(step, stage=stage), **extra})
        if content.get("passed", False):
            return True
        self.transcript.failed_at = f"{step.tool} stage {stage}"
        failure = self.playbook.on_stage_failure
        if failure is not None:
            await self.call(failure.tool, {**self.arguments(failure), **extra})
        return False


async def follow_playbook(
    client: Client, source: str, *, model_name: str | None = None, stages: list[int] | None = None
) -> Transcript:
    """Port ``source`` by calling the tools SKILL.md names, in its order, with its arguments."""
    run = await PlaybookRun.start(client, source, model_name)
    for step in run.playbook.steps:
        if step.stages:
            for stage in [s for s in step.stages if stages is None or s in stages]:
                if not await run.run_stage(step, stage):
                    return run.transcript
            continue
        await run.call_step(step.tool, run.arguments(step))
    run.transcript.passed = True
    return run.transcript


def stdio_server(workspace: Path, session: Path | None) -> StdioServerParameters:
    """The server as a subprocess: ``python -m mcp_server --workspace ...``."""
    args = ["-m", "mcp_server", "--workspace", str(workspace)]
    args += ["--session", str(session)] if session is not None else ["--no-record"]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(workspace))


async def port_over_stdio(
    workspace: Path,
    source: str,
    *,
    session: Path | None,
    model_name: str | None = None,
    stages: list[int] | None = None,
) -> Transcript:
    async with Client(stdio_server(workspace, session), read_timeout_seconds=600) as client:
        return await follow_playbook(client, source, model_name=model_name, stages=stages)


REPO = Path(__file__).resolve().parents[2]
SESSIONS = Path(__file__).resolve().parent / "sessions"
# A committed session records steps 1-9 (analysis to check_package), which is what
# produces the package; the stages themselves run in CI from tests/archon/test_<family>.py.
SESSION_STAGES: list[int] = []


def ported_families(root: Path = REPO) -> list[str]:
    """The packages under ``archon_models/`` the engine ported (every spec-bearing package
    that is not a hand-written reference)."""
    from skill.analysis.reference import REFERENCES

    return sorted(
        path.parent.name for path in (root / "archon_models").glob("*/spec.py") if path.parent.name not in REFERENCES
    )


def remove_packages(root: Path, packages: tuple[str, ...]) -> None:
    """Take ``packages`` out of a project copy, as it was before they were ported."""
    init = root / "archon_models" / "__init__.py"
    for package in packages:
        shutil.rmtree(root / "archon_models" / package)
        (root / "tests" / "archon" / f"test_{package}.py").unlink(missing_ok=True)
        lines = init.read_text(encoding="utf-8").splitlines(keepends=True)
        init.write_text("".join(line for line in lines if f"archon_models.{package} " not in line), encoding="utf-8")


def export_head(destination: Path) -> Path:
    """The committed tree (``git archive HEAD``), so a session's base is what CI checks out."""
    destination.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)
    return destination


Porter = Callable[[Path, str, Path], Awaitable[Transcript]]


def add_source(family: str, root: Path = REPO) -> str:
    """What ``add`` ports ``family`` from, as its generated header names it (the model_type
    ``openai-gpt`` for the package ``openai_gpt``); the family name for a package without one."""
    from skill.porting.regenerate import header_command, parse_add_command

    model = root / "archon_models" / family / "model" / "model.py"
    command = header_command(model.read_text(encoding="utf-8")) if model.is_file() else None
    return parse_add_command(command, family).source if command is not None else family


def _skill_md_port(root: Path, family: str, session: Path) -> Awaitable[Transcript]:
    # SKILL.md names the package after the source (``openai-gpt`` -> ``openai_gpt``).
    return port_over_stdio(root, add_source(family), session=session, stages=SESSION_STAGES)


def porter(family: str) -> Porter:
    """How ``family``'s session is recorded: SKILL.md's step-by-step path, or, for a family
    that keeps an unsupported feature, the hand-port path with its recorded hand edit."""
    from tests.mcp.hand_port_client import HAND_PORTS, hand_port_over_stdio

    if family in HAND_PORTS:
        return lambda root, family, session: hand_port_over_stdio(root, HAND_PORTS[family], session=session)
    return _skill_md_port


def refresh_session(family: str) -> Path:
    """Re-record ``tests/mcp/sessions/<family>.jsonl``: port the committed family again
    over stdio, following SKILL.md, in a copy of HEAD without it."""
    target = SESSIONS / f"{family}.jsonl"
    port = porter(family)
    with tempfile.TemporaryDirectory(prefix="archon-port-session-") as tmp:
        root = export_head(Path(tmp) / "repo")
        remove_packages(root, (family,))
        session = Path(tmp) / f"{family}.jsonl"
        transcript = anyio.run(lambda: port(root, family, session))
        if not transcript.passed:
            raise RuntimeError(f"{family}: the SKILL.md flow failed at {transcript.failed_at}; session not written")
        produced, committed = root / "archon_models" / family, REPO / "archon_models" / family
        if subprocess.run(["diff", "-rq", "-x", "__pycache__", str(produced), str(committed)]).returncode:
            raise RuntimeError(
                f"{family}: the SKILL.md flow produces an archon_models/{family}/ unlike the committed one"
            )
        test_file = Path("tests") / "archon" / f"test_{family}.py"
        if (root / test_file).is_file() and (root / test_file).read_bytes() != (REPO / test_file).read_bytes():
            raise RuntimeError(f"{family}: the SKILL.md flow produces a {test_file} unlike the committed one")
        SESSIONS.mkdir(exist_ok=True)
        shutil.copy(session, target)
    logger.info("recorded %s", target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="*", help="model_type(s) or checkpoint folder to port")
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="re-record tests/mcp/sessions/<family>.jsonl for each family named (default: every ported family)",
    )
    parser.add_argument("--workspace", type=Path, help="project root the server works in (not with --refresh)")
    parser.add_argument("--session", type=Path, help="record the server's session here")
    parser.add_argument("--model-name")
    parser.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], help="e.g. 1,2,3 (default all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.refresh:
        committed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "archon_models/*/spec.py"], check=True, capture_output=True, text=True
        ).stdout.split()
        failed = []
        for family in args.source or [f for f in ported_families() if f"archon_models/{f}/spec.py" in committed]:
            try:
                refresh_session(family)
            except Exception as e:  # report every family, not only the first failure
                logger.error("%s: %s", family, e)
                failed.append(family)
        return 1 if failed else 0
    if args.workspace is None or len(args.source) != 1:
        parser.error("give one source and --workspace (or --refresh with family names)")
    transcript = anyio.run(
        lambda: port_over_stdio(
            args.workspace.resolve(),
            args.source[0],
            session=args.session.resolve() if args.session else None,
            model_name=args.model_name,
            stages=args.stages,
        )
    )
    logger.info("passed=%s failed_at=%s calls=%d", transcript.passed, transcript.failed_at, len(transcript.calls))
    return 0 if transcript.passed else 1


if __name__ == "__main__":
    sys.exit(main())
