"""What one server holds: its workspace, its session, and each package's latest results."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from skill.codemod.workspace import Workspace
from skill.session import SessionRecorder
from skill.tools import DEFAULT_LOCK_TIMEOUT_S, Tool, state_dir

_PACKAGE_RE = re.compile(r"^[a-z][a-z0-9_]*$")


class ReportStore:
    """Each package's latest result per tool, on disk so a restarted server still serves them.

    Kept under ``.archon-port/reports/<package>/``: ``<tool>.json``, and for stage runs
    ``<tool>-stage<N>.json``, each holding the arguments, the time and the result.
    """

    def __init__(self, workspace: Workspace):
        self.root = state_dir(workspace, "reports")

    def save(self, tool: Tool, arguments: dict[str, Any], result: BaseModel) -> Path | None:
        field_name = tool.entry.package_field
        package = arguments.get(field_name) if field_name else None
        if not isinstance(package, str) or not _PACKAGE_RE.match(package):
            return None
        stem = tool.name
        if "stage" in arguments:
            stem += f"-stage{arguments['stage']}"
        path = self.root / package / f"{stem}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "tool": tool.name,
            "arguments": arguments,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "result": result.model_dump(mode="json"),
        }
        path.write_text(json.dumps(payload, indent=2), encoding="utf-8")
        return path

    def latest(self, package: str, *, stages: bool) -> dict[str, Any]:
        """Saved results of ``package``: its stage runs, or every other tool's latest result."""
        if not _PACKAGE_RE.match(package):
            raise ValueError(f"{package!r} is not a package name (lowercase letters, digits, _)")
        directory = self.root / package
        found: dict[str, Any] = {}
        if directory.is_dir():
            for path in sorted(directory.glob("*.json")):
                if ("-stage" in path.stem) == stages:
                    found[path.stem] = json.loads(path.read_text(encoding="utf-8"))
        return found


@dataclass
class ServerState:
    """Shared by every tool, resource and prompt of one server, and by its shutdown."""

    workspace: Workspace
    recorder: SessionRecorder | None = None
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S
    reports: ReportStore = field(init=False)
    # The cancel event of every call running now (see skill.codemod.workspace.cancellable).
    _calls: set[threading.Event] = field(init=False, default_factory=set)
    _calls_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.reports = ReportStore(self.workspace)

    @contextlib.contextmanager
    def running_call(self, cancel: threading.Event) -> Iterator[None]:
        """Track a call while it runs, so that :meth:`cancel_calls` reaches it."""
        with self._calls_lock:
            self._calls.add(cancel)
        try:
            yield
        finally:
            with self._calls_lock:
                self._calls.discard(cancel)

    def cancel_calls(self) -> int:
        """Cancel every call in flight (their children are killed, nothing is written); how many."""
        with self._calls_lock:
            calls = list(self._calls)
        for cancel in calls:
            cancel.set()
        return len(calls)
