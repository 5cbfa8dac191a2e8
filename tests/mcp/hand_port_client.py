"""A client that follows SKILL.md's "Porting by hand" for a family no edit fully supports.

The scripted client (:mod:`tests.mcp.scripted_client`) follows SKILL.md's "Step by step";
this one takes the same **Call:** lines for the same tools and departs from them exactly
where "Porting by hand" says to:

1. ``analyze_hf_model``; its ``unsupported`` list must be the features the hand edit writes;
2. steps 2-8 as usual, with ``"allow_unsupported": true`` added to ``edit_args`` and
   ``edit_model`` (which returns the skipped features and leaves a
   ``# archon-port: hand edit needed: <feature>`` marker where each goes);
3. the hand edit, written below as exact replacements in the package's files and applied
   to the workspace between two tool calls, so that the server's session captures it as
   a patch (and ``archon-port replay --trust-remote-code`` applies it again: a hand edit is
   Python the session brings, which a replay runs only when told to);
4. ``run_test_stage`` 1-6, then the stages again with ``config_overrides`` that make the
   tiny model show the feature in a second way (a case added to the package's test file);
   ``locate_divergence`` (with the same overrides) when a stage fails, and stop;
5. ``check_package`` last: it must pass (no marker left, every plan entry a module).

The recorded sessions of these families are in ``tests/mcp/sessions/`` next to the others and
re-recorded with them (``python -m tests.mcp.scripted_client --refresh [family ...]``). To
port one into a workspace of your own and see each call::

    python -m tests.mcp.hand_port_client FAMILY --workspace DIR [--session FILE]
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from mcp import Client

from skill.codemod import format_python
from tests.mcp.scripted_client import PlaybookRun, Transcript, stdio_server

logger = logging.getLogger(__name__)

# SKILL.md § Porting by hand, step 2: the steps that take allow_unsupported.
ALLOW_UNSUPPORTED = ("edit_args", "edit_model")
# Run after the hand edit and the stages (SKILL.md § Porting by hand, step 6).
LAST = "check_package"


@dataclass(frozen=True)
class Replace:
    """Replace ``old`` (which must occur exactly once) by ``new`` in the workspace file ``path``."""

    path: str
    old: str
    new: str

    def apply(self, root: Path) -> None:
        target = root / self.path
        text = target.read_text(encoding="utf-8")
        count = text.count(self.old)
        if count != 1:
            raise RuntimeError(
                f"hand edit: {self.path} holds the text to replace {count} times, not once; "
                f"the tools now write something else there:\n{self.old}"
            )
        target.write_text(text.replace(self.old, self.new), encoding="utf-8")


@dataclass(frozen=True)
class HandPort:
    """One family's hand port: the features it writes by hand, the edit, and the case proving it."""

    source: str
    features: list[str]  # the analysis's `unsupported`, verbatim
    description: str
    edits: tuple[Replace, ...]
    config_overrides: dict[str, Any] = field(default_factory=dict)

    def apply(self, root: Path) -> None:
        """Apply the edits, then format the files they touched as the project's gates ask
        (what a person does after a hand edit; the package stays ruff-clean)."""
        for edit in self.edits:
            edit.apply(root)
        for path in sorted({edit.path for edit in self.edits}):
            target = root / path
            target.write_text(format_python(target.read_text(encoding="utf-8"), path), encoding="utf-8")


# The families whose committed session is a hand port, by package name. smollm3 was the
# one (layers without RoPE) until the nope_layers edit made it port with `add`; its hand
# edit is in the git history of this file.
HAND_PORTS: dict[str, HandPort] = {}


async def follow_hand_port(client: Client, workspace: Path, hand_port: HandPort) -> Transcript:
    """Port ``hand_port.source`` as SKILL.md's "Porting by hand" says, the hand edit included."""
    run = await PlaybookRun.start(client, hand_port.source)
    first, *rest = run.playbook.steps
    analysis = await run.call_step(first.tool, run.arguments(first))
    if analysis.get("unsupported") != hand_port.features:
        raise RuntimeError(
            f"{hand_port.source}: the analysis lists unsupported {analysis.get('unsupported')}, "
            f"the hand edit writes {hand_port.features}; update the hand edit"
        )
    for step in rest:
        if step.stages or step.tool == LAST:
            continue
        arguments = run.arguments(step)
        if step.tool in ALLOW_UNSUPPORTED:
            arguments["allow_unsupported"] = True
        content = await run.call_step(step.tool, arguments)
        if step.tool == "edit_model" and content.get("skipped_features") != hand_port.features:
            raise RuntimeError(f"edit_model skipped {content.get('skipped_features')}, not {hand_port.features}")
    logger.info("hand edit for %s:\n%s", ", ".join(hand_port.features), hand_port.description)
    hand_port.apply(workspace)
    stages = next(step for step in run.playbook.steps if step.stages)
    for stage in stages.stages:
        if not await run.run_stage(stages, stage):
            return run.transcript
    if hand_port.config_overrides:
        for stage in stages.stages:
            if not await run.run_stage(stages, stage, config_overrides=hand_port.config_overrides):
                return run.transcript
    check = await run.call_step(LAST, run.arguments(run.step(LAST)))
    run.transcript.passed = bool(check.get("passed"))
    if not run.transcript.passed:
        run.transcript.failed_at = LAST
    return run.transcript


async def hand_port_over_stdio(workspace: Path, hand_port: HandPort, *, session: Path | None) -> Transcript:
    async with Client(stdio_server(workspace, session), read_timeout_seconds=600) as client:
        return await follow_hand_port(client, workspace, hand_port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(HAND_PORTS))
    parser.add_argument("--workspace", type=Path, required=True, help="project root the server works in")
    parser.add_argument("--session", type=Path, help="record the server's session here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workspace = args.workspace.resolve()
    transcript = anyio.run(
        lambda: hand_port_over_stdio(
            workspace, HAND_PORTS[args.family], session=args.session.resolve() if args.session else None
        )
    )
    for tool, arguments, content, ok in transcript.calls:
        summary = {k: content[k] for k in ("passed", "max_abs_diff", "skipped_features") if content and k in content}
        logger.info("%-18s %s %s %s", tool, "ok " if ok else "ERR", arguments, summary)
    logger.info("passed=%s failed_at=%s calls=%d", transcript.passed, transcript.failed_at, len(transcript.calls))
    return 0 if transcript.passed else 1


if __name__ == "__main__":
    sys.exit(main())
