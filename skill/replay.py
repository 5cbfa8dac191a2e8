"""Replay a recorded session in a fresh copy of the repository and check nothing changed.

The copy is rebuilt to the state the session started from (each file the session
touched gets back the content it had before), then every recorded line runs in order:
edits made outside the tools are applied as patches, tool calls are re-run through
:func:`skill.tools.invoke`. The first call whose outcome, result or changed files
differ from the recording, or the first edit that does not apply, ends the replay with
a mismatch naming it.

A session file is untrusted input (it may come with a pull request that CI replays).
Before anything runs, every path it names (each record's ``base`` and ``files``, each
patch header, each ``binary`` entry) must be a plain relative path, and each is
confined again to the scratch copy, after resolving symbolic links, when it is used.

Nor does a session run code of its own unless the person replaying says so with
``trust_remote_code`` (``--trust-remote-code``): a recorded call with
``trust_remote_code``, and every file the session itself would write that Python could
import or run. The replay writes a session's files three ways, each checked before
anything runs (:func:`vet_session`): a record's ``base`` (a file's content before the
session), an edit's patch and its ``binary`` entries. Such content is code unless it is
data nothing imports (:data:`INERT_SUFFIXES`: text, JSON, safetensors), a deletion, the
file exactly as the repository copy has it, or the registry differing from the copy's
only in one-line ``from archon_models.<package> import spec as <package>_spec`` imports
(what a session's start state legitimately differs in). Otherwise a test file, a
package module or a ``conftest.py`` the session brings would run at import, in a stage
or a divergence run, whichever call the session records (a test case with
``trust_remote_code=True`` and a remote-code folder among them). A session that breaks a
rule is refused with one line naming the record (:class:`UnsafeSessionError`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, Field

from skill.codemod.workspace import (
    Workspace,
    WorkspaceError,
    confine,
    find_project_root,
    transaction,
)
from skill.replay_compare import compare_call, compare_files
from skill.scratch import make_scratch_dir
from skill.session import (
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
    is_ignored_dir,
    patch_paths,
    patch_writes,
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
    trust_remote_code: bool = Field(
        default=False,
        description="let the session run code of its own: recorded calls with trust_remote_code, and the "
        "Python files its starting state and hand edits write",
    )
    rerecord: bool = Field(
        default=False,
        description="re-record the session on this engine (after an engine change altered what its calls "
        "write, e.g. a hand port's files): differences in results, error texts and files are taken, and a "
        "call recorded as failing that now succeeds (an engine fix), but a call recorded as succeeding that "
        "now fails or a hand edit that no longer applies stops it, as in a replay. On "
        "success the session file is replaced by the new recording and the files the session created "
        "(its package and tests) are written into the repository",
    )


class UnsafeSessionError(ValueError):
    """A session that names a path outside the scratch copy, or runs remote code unasked."""


# What a session may write without --trust-remote-code: data that nothing imports or runs.
INERT_SUFFIXES = frozenset({".md", ".txt", ".rst", ".json", ".jsonl", ".csv", ".safetensors"})
REGISTRY = "archon_models/__init__.py"
# The one kind of line a session's registry may add or drop: a package's spec import.
_SPEC_IMPORT = re.compile(
    r"from archon_models\.(?P<package>[a-z][a-z0-9_]*) import spec as (?P=package)_spec(  # noqa: F401)?"
)


def _record_name(record: CallRecord | EditRecord | CloseRecord) -> str:
    return f"call #{record.seq} ({record.tool})" if isinstance(record, CallRecord) else f"{record.kind} #{record.seq}"


def _check_relative(record, what: str, rel: str) -> None:
    parts = rel.replace("\\", "/").split("/")
    if not rel or "\0" in rel or rel.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts:
        raise UnsafeSessionError(
            f"{_record_name(record)}: {what} {rel!r} is not a path inside the workspace; "
            "the session file was edited or crafted, refused before replaying anything"
        )


def _paths_of(record) -> Iterator[tuple[str, str]]:
    for rel in getattr(record, "base", {}):
        yield "base path", rel
    for rel in getattr(record, "files", {}):
        yield "changed file", rel
    if isinstance(record, EditRecord):
        for rel in record.binary:
            yield "binary entry", rel
        for rel in patch_paths(record.patch):
            yield "patch path", rel
    if isinstance(record, CloseRecord):
        for rel in patch_paths(record.patch):
            yield "patch path", rel


def _registry_body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not _SPEC_IMPORT.fullmatch(line.strip())]


def _repository_content(source: Path | None, rel: str) -> bytes | None:
    """The bytes ``rel`` has in the repository the replay copies (None: absent, or unknown)."""
    if source is None:
        return None
    try:
        path = confine(source, rel)
    except WorkspaceError:
        return None
    return path.read_bytes() if path.is_file() else None


def _is_code(rel: str, content: bytes, source: Path | None) -> bool:
    """Whether writing ``content`` to ``rel`` in the copy brings code Python could run."""
    if PurePosixPath(rel).suffix.lower() in INERT_SUFFIXES:
        return False
    current = _repository_content(source, rel)
    if current == content:
        return False
    if rel == REGISTRY and current is not None:
        try:
            return _registry_body(content.decode("utf-8")) != _registry_body(current.decode("utf-8"))
        except UnicodeDecodeError:
            return True
    return True


def _written_code(record, source: Path | None) -> Iterator[tuple[str, str]]:
    """``(what, path)`` for each file ``record`` would write that holds code (see the module docstring)."""
    for rel, content in getattr(record, "base", {}).items():
        if content is not None and _is_code(rel, content.to_bytes(), source):
            yield "its starting content", rel
    if isinstance(record, EditRecord):
        for rel in patch_writes(record.patch):
            if PurePosixPath(rel).suffix.lower() not in INERT_SUFFIXES:
                yield "a hand edit", rel
        for rel, content in record.binary.items():
            if _is_code(rel, content.to_bytes(), source):
                yield "a binary file", rel


def vet_session(records: list, *, trust_remote_code: bool, source: Path | None = None) -> None:
    """Refuse a session whose records name paths outside the workspace, or run code of their own
    unasked: a call with ``trust_remote_code``, or a file the session writes that holds code.
    ``source`` is the repository the replay copies (a session's base is compared with it)."""
    for record in records[1:]:
        try:
            for what, rel in _paths_of(record):
                _check_relative(record, what, rel)
        except PatchError as e:
            raise UnsafeSessionError(f"{_record_name(record)}: {e}; refused before replaying anything") from e
        if trust_remote_code:
            continue
        if isinstance(record, CallRecord) and record.arguments.get("trust_remote_code"):
            raise UnsafeSessionError(
                f"{_record_name(record)} runs the checkpoint's own code (trust_remote_code=true); "
                "replay with --trust-remote-code only if you trust that code"
            )
        for what, rel in _written_code(record, source):
            raise UnsafeSessionError(
                f"{_record_name(record)} writes {rel} ({what}), code that replaying would import or run; "
                "replay with --trust-remote-code only if you trust that code"
            )


class ReplayMismatch(BaseModel):
    """The first place where the replay differs from the recording."""

    seq: int
    tool: str | None = Field(default=None, description="the tool of the differing call; None for an edit")
    kind: Literal["outcome", "fixed", "error", "result", "files", "edit"]
    detail: str


# What a re-recording takes as the engine's new behaviour; any other difference stops it.
# "fixed": a call recorded as failing now succeeds (an engine fix). "outcome" (a recorded success
# that now fails, a call that did not run, a hand edit that no longer applies) is never taken.
RERECORDABLE = frozenset({"fixed", "error", "result", "files", "edit"})


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
    taken: list[ReplayMismatch] = Field(
        default_factory=list, description="with rerecord: the differences taken as the engine's new behaviour"
    )
    written: list[str] = Field(
        default_factory=list, description="with rerecord: the files the session created, written into the repository"
    )
    duration_s: float = Field(default=0.0, json_schema_extra={"volatile": True})

    def describe(self) -> str:
        """One line for a terminal or a CI log."""
        ran = f"{self.calls} call(s), {self.edits} edit(s) outside the tools"
        other = self.transformers_differs
        if self.ok and self.written:
            return (
                f"re-recorded {self.session}: {ran} in {self.duration_s:.1f} s; "
                f"{len(self.taken)} difference(s) taken; wrote {', '.join(self.written)}"
            )
        if self.ok:
            also = ""
            if other:
                also = (
                    f" (recorded with transformers {self.recorded_transformers}, "
                    f"replayed on {self.replay_transformers})"
                )
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
    return {n for n in names if is_ignored_dir(directory, n) or n.endswith(IGNORED_SUFFIXES)}


def copy_repository(source: Path, destination: Path) -> Path:
    """Copy ``source`` without VCS data, caches or engine state; returns the copy's root."""
    shutil.copytree(source, destination, ignore=_ignore, symlinks=True)
    return destination


def _restore_base(root: Path, records: Sequence[object]) -> None:
    """Put back, in the copy, the content each touched file had when the session started."""
    base: dict[str, tuple[FileContent | None, CallRecord | EditRecord | CloseRecord]] = {}
    for record in records:
        if not isinstance(record, (CallRecord, EditRecord, CloseRecord)):
            continue  # the session header holds no file content
        for rel, content in getattr(record, "base", {}).items():
            base.setdefault(rel, (content, record))
    for rel, (content, record) in base.items():
        try:
            path = confine(root, rel)
        except WorkspaceError as e:
            raise UnsafeSessionError(f"{_record_name(record)}: base path {e}") from e
        if content is None:
            if path.is_file():
                path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.to_bytes())


def _compare_files(expected: dict[str, str | None], actual: dict[str, str | None]) -> str | None:
    return compare_files(expected, actual)


def _check_call(record: CallRecord, replayed: CallRecord) -> ReplayMismatch | None:
    difference = compare_call(record, replayed)
    if difference is None:
        return None
    return ReplayMismatch(seq=record.seq, tool=record.tool, kind=difference.kind, detail=difference.detail)


def replay_session(request: ReplayInput) -> ReplayReport:
    """Re-run a recorded session in a fresh temporary copy of the repo; report the first difference."""
    start = time.perf_counter()
    records = read_session(request.session)
    header = records[0]
    assert isinstance(header, SessionHeader)
    source = (request.source or find_project_root()).resolve()
    vet_session(records, trust_remote_code=request.trust_remote_code, source=source)
    # A copy kept for inspection is the user's to remove; any other is removed below, or, after a
    # kill, by the next engine call that makes a scratch folder (skill.scratch).
    tmp = Path(tempfile.mkdtemp(prefix="archon-port-replay-kept-")) if request.keep else make_scratch_dir("replay")
    root = copy_repository(source, tmp / "repo").resolve()
    calls = edits = 0
    mismatch: ReplayMismatch | None = None
    taken: list[ReplayMismatch] = []
    written: list[str] = []

    def settles(difference: ReplayMismatch | None) -> bool:
        """Whether the replay goes on after ``difference`` (re-recording takes some differences)."""
        nonlocal mismatch
        if difference is None:
            return True
        if request.rerecord and difference.kind in RERECORDABLE:
            taken.append(difference)
            return True
        mismatch = difference
        return False

    try:
        _restore_base(root, records)
        workspace = Workspace(root)
        recorder = SessionRecorder(tmp / "replayed.jsonl", workspace)
        for record in records[1:]:
            if isinstance(record, EditRecord):
                try:
                    apply_patch(root, record.patch)
                    for rel, content in record.binary.items():
                        workspace.resolve(rel).write_bytes(content.to_bytes())
                    actual = workspace_hashes(workspace, record.files)
                except WorkspaceError as e:
                    raise UnsafeSessionError(f"{_record_name(record)}: {e}") from e
                except (PatchError, OSError, UnicodeDecodeError) as e:
                    # A hand edit that no longer applies: no re-recording can take it.
                    mismatch = ReplayMismatch(seq=record.seq, kind="outcome", detail=f"the edit does not apply: {e}")
                    break
                differs = _compare_files(record.files, actual)
                if not settles(ReplayMismatch(seq=record.seq, kind="edit", detail=differs) if differs else None):
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
                if recorder.last_call is None:  # the replaying session recorded nothing
                    mismatch = ReplayMismatch(
                        seq=record.seq, tool=record.tool, kind="outcome", detail="the call was not recorded"
                    )
                    break
                if not settles(_check_call(record, recorder.last_call)):
                    break
        closing = records[-1]
        if mismatch is None and isinstance(closing, CloseRecord):
            # Closing names the hand edits in the package's header: replayed like a call.
            differs = _compare_files(closing.files, recorder.close().files)
            settles(ReplayMismatch(seq=closing.seq, kind="files", detail=differs) if differs else None)
        if request.rerecord and mismatch is None:
            written = _adopt_recording(recorder.path, request.session, root, source)
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
        taken=taken,
        written=written,
        duration_s=round(time.perf_counter() - start, 3),
    )
    logger.info("%s", report.describe())
    return report


def _adopt_recording(recorded: Path, session: Path, copy_root: Path, source: Path) -> list[str]:
    """Make a re-recording the session: write into ``source`` each file the session created (a path
    whose base is absent: its package, its tests) as the copy now holds it, then replace the session
    file. Nothing is deleted. Files that existed before the session (the spec registry) are left as
    they are: the copy holds them as they were when the session was recorded, not as they are now."""
    created = sorted(
        rel
        for record in read_session(recorded)[1:]
        for rel, content in getattr(record, "base", {}).items()
        if content is None
    )
    written = []
    with transaction(Workspace(source)) as tree:  # all of them or, on any error, none
        for rel in created:
            origin = confine(copy_root, rel)
            if origin.is_file():  # else created and removed again by the session: nothing to keep or delete
                tree.write_text(rel, origin.read_text(encoding="utf-8"))
                written.append(rel)
    tmp_session = session.with_name(session.name + ".rerecord.tmp")
    shutil.copyfile(recorded, tmp_session)
    os.replace(tmp_session, session)
    return written


def workspace_hashes(workspace: Workspace, paths: dict[str, str | None]) -> dict[str, str | None]:
    """The current sha256 of each path (None when absent)."""
    result: dict[str, str | None] = {}
    for rel in paths:
        path = workspace.resolve(rel)
        result[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return result


__all__ = [
    "ReplayInput",
    "ReplayMismatch",
    "ReplayReport",
    "UnsafeSessionError",
    "copy_repository",
    "replay_session",
    "vet_session",
]
