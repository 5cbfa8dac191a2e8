"""Replay a recorded session in a fresh copy of the repository and check nothing changed.

The copy is rebuilt to the state the session started from (each file the session
touched gets back the content it had before), then every recorded line runs in order:
edits made outside the tools are applied as patches, tool calls are re-run through
:func:`skill.tools.invoke`. The first call whose outcome, result or changed files
differ from the recording, or the first edit that does not apply, ends the replay with
a mismatch naming it.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from skill.codemod.workspace import Workspace, find_project_root
from skill.session import (
    IGNORED_DIRS,
    IGNORED_SUFFIXES,
    CallRecord,
    CloseRecord,
    EditRecord,
    FileContent,
    PatchError,
    SessionHeader,
    SessionRecorder,
    apply_patch,
    engine_version,
    first_difference,
    read_session,
    transformers_version,
)
from skill.tools import invoke

logger = logging.getLogger(__name__)


class ReplayInput(BaseModel):
    """Which session to replay, and from which repository copy."""

    session: Path = Field(description="the session file (JSON Lines) to replay")
    source: Path | None = Field(
        default=None, description="repository to copy (default: the project holding the current directory)"
    )
    keep: bool = Field(default=False, description="keep the temporary copy for inspection")


class ReplayMismatch(BaseModel):
    """The first place where the replay differs from the recording."""

    seq: int
    tool: str | None = Field(default=None, description="the tool of the differing call; None for an edit")
    kind: Literal["outcome", "error", "result", "files", "edit"]
    detail: str


class ReplayReport(BaseModel):
    """What the replay ran and whether everything matched."""

    session: Path
    ok: bool
    calls: int = Field(description="tool calls replayed")
    edits: int = Field(description="edits outside the tools applied")
    closed: bool = Field(description="whether the recorded session was closed")
    mismatch: ReplayMismatch | None = None
    recorded_engine: str
    replay_engine: str
    recorded_transformers: str | None = Field(
        default=None, description="the transformers version the session was recorded with (None: not recorded)"
    )
    replay_transformers: str | None = Field(default=None, description="the transformers version of this replay")
    kept_copy: Path | None = Field(default=None, description="the temporary repository copy, when kept")
    duration_s: float = Field(default=0.0, json_schema_extra={"volatile": True})

    def describe(self) -> str:
        """One line for a terminal or a CI log."""
        ran = f"{self.calls} call(s), {self.edits} edit(s) outside the tools"
        other = self.transformers_differs
        if self.ok:
            also = ""
            if other:
                also = f" (recorded with transformers {self.recorded_transformers}, replayed on {self.replay_transformers})"
            return f"replay OK: {self.session}: {ran} matched in {self.duration_s:.1f} s{also}"
        m = self.mismatch
        assert m is not None
        what = f"call #{m.seq} ({m.tool})" if m.tool else f"edit #{m.seq}"
        if other:
            # Results depend on transformers (config defaults, checkpoint key names, known
            # families): a difference here is first of all a version difference.
            return (
                f"replay FAILED: recorded with transformers {self.recorded_transformers}, this is "
                f"{self.replay_transformers}: results differ from {what} on: {m.kind}: {m.detail} (after {ran}); "
                f"replay it under transformers {self.recorded_transformers}, or re-record it under this version"
            )
        return f"replay FAILED at {what}: {m.kind}: {m.detail} (after {ran})"

    @property
    def transformers_differs(self) -> bool:
        return (
            self.recorded_transformers is not None
            and self.replay_transformers is not None
            and self.recorded_transformers != self.replay_transformers
        )


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in IGNORED_DIRS or n.endswith(IGNORED_SUFFIXES)}


def copy_repository(source: Path, destination: Path) -> Path:
    """Copy ``source`` without VCS data, caches or engine state; returns the copy's root."""
    shutil.copytree(source, destination, ignore=_ignore, symlinks=True)
    return destination


def _restore_base(root: Path, records: list) -> None:
    """Put back, in the copy, the content each touched file had when the session started."""
    base: dict[str, FileContent | None] = {}
    for record in records:
        for rel, content in getattr(record, "base", {}).items():
            base.setdefault(rel, content)
    for rel, content in base.items():
        path = root / rel
        if content is None:
            if path.is_file():
                path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.to_bytes())


def _compare_files(expected: dict[str, str | None], actual: dict[str, str | None]) -> str | None:
    for rel in sorted(set(expected) | set(actual)):
        if rel not in actual:
            return f"{rel}: the recording changed it (to {expected[rel]}), the replay did not"
        if rel not in expected:
            return f"{rel}: the replay changed it (to {actual[rel]}), the recording did not"
        if expected[rel] != actual[rel]:
            state = "deleted" if actual[rel] is None else f"sha256 {actual[rel][:12]}"
            return f"{rel}: expected sha256 {str(expected[rel])[:12]}, got {state}"
    return None


def _check_call(record: CallRecord, replayed: CallRecord) -> ReplayMismatch | None:
    def mismatch(kind: str, detail: str) -> ReplayMismatch:
        return ReplayMismatch(seq=record.seq, tool=record.tool, kind=kind, detail=detail)

    if record.ok != replayed.ok:
        if record.ok:
            return mismatch("outcome", f"recorded success, replay failed: {replayed.error}")
        return mismatch("outcome", f"recorded failure ({record.error}), replay succeeded")
    if not record.ok and (record.error is None or replayed.error is None or record.error != replayed.error):
        return mismatch("error", f"expected {record.error}, got {replayed.error}")
    if record.result_digest != replayed.result_digest:
        detail = None
        if record.result is not None and replayed.result is not None:
            detail = first_difference(record.result, replayed.result)
        return mismatch("result", detail or f"digest {record.result_digest} != {replayed.result_digest}")
    files = _compare_files(record.files, replayed.files)
    if files:
        return mismatch("files", files)
    return None


def replay_session(request: ReplayInput) -> ReplayReport:
    """Re-run a recorded session in a fresh temporary copy of the repo; report the first difference."""
    start = time.perf_counter()
    records = read_session(request.session)
    header = records[0]
    assert isinstance(header, SessionHeader)
    source = (request.source or find_project_root()).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="archon-port-replay-"))
    root = copy_repository(source, tmp / "repo")
    calls = edits = 0
    mismatch: ReplayMismatch | None = None
    try:
        _restore_base(root, records)
        workspace = Workspace(root)
        recorder = SessionRecorder(tmp / "replayed.jsonl", workspace)
        for record in records[1:]:
            if isinstance(record, EditRecord):
                try:
                    apply_patch(root, record.patch)
                    for rel, content in record.binary.items():
                        (root / rel).write_bytes(content.to_bytes())
                except (PatchError, OSError, UnicodeDecodeError) as e:
                    mismatch = ReplayMismatch(seq=record.seq, kind="edit", detail=str(e))
                    break
                differs = _compare_files(record.files, workspace_hashes(workspace, record.files))
                if differs:
                    mismatch = ReplayMismatch(seq=record.seq, kind="edit", detail=differs)
                    break
                edits += 1
            elif isinstance(record, CallRecord):
                logger.info("replaying call #%d %s", record.seq, record.tool)
                before = recorder.last_call
                try:
                    invoke(record.tool, record.arguments, workspace=workspace, session=recorder)
                except Exception as e:  # recorded in the replayed session, compared below
                    logger.debug("replayed call #%d raised %s", record.seq, e)
                    if recorder.last_call is before:  # refused before it ran: unknown tool, bad arguments
                        mismatch = ReplayMismatch(
                            seq=record.seq, tool=record.tool, kind="outcome", detail=f"the call did not run: {e}"
                        )
                        break
                calls += 1
                mismatch = _check_call(record, recorder.last_call)
                if mismatch:
                    break
    finally:
        if not request.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    report = ReplayReport(
        session=request.session,
        ok=mismatch is None,
        calls=calls,
        edits=edits,
        closed=isinstance(records[-1], CloseRecord),
        mismatch=mismatch,
        recorded_engine=header.engine_version,
        replay_engine=engine_version(),
        recorded_transformers=header.transformers,
        replay_transformers=transformers_version(),
        kept_copy=root if request.keep else None,
        duration_s=round(time.perf_counter() - start, 3),
    )
    logger.info("%s", report.describe())
    return report


def workspace_hashes(workspace: Workspace, paths: dict[str, str | None]) -> dict[str, str | None]:
    """The current sha256 of each path (None when absent)."""
    result: dict[str, str | None] = {}
    for rel in paths:
        path = workspace.root / rel
        result[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return result


__all__ = ["ReplayInput", "ReplayMismatch", "ReplayReport", "copy_repository", "replay_session"]
