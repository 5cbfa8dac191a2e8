"""Sessions: every tool call recorded as one JSON line, so CI can replay what an agent did.

A session file is JSON Lines:

- ``session``: the header (format, id, engine version, transformers version);
- ``call``: one per tool call: tool, arguments (workspace-relative), a digest of the
  result, the files the call changed with their content hashes, the engine version,
  and the content every file had before the session first changed it (``base``),
  which is what lets a replay rebuild the starting state in a fresh copy;
- ``edit``: edits made outside the tools (by hand, by an agent's editor), detected
  before the next call, as a unified diff plus the resulting hashes;
- ``close``: written when the session closes: the whole patch of edits made outside
  the tools.

The recorder compares the workspace with its state after the previous call. File
contents are kept in a small content-addressed store under ``.archon-port/objects`` so
that a session recorded over several CLI invocations (``archon-port --record S ...``)
still knows what a hand-edited file looked like before the edit.
"""

from __future__ import annotations

import base64
import contextlib
import difflib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter
from pydantic_core import to_jsonable_python

from skill import __version__
from skill.codemod.workspace import STATE_DIR, Workspace, confine
from skill.patch_format import HUNK_RE, PatchError, patch_sections
from skill.patch_format import split_lines as _lines
from skill.replay_compare import normalise_volatile
from skill.tools import Tool, active_recorder, recording_into, state_dir

logger = logging.getLogger(__name__)

SESSION_FORMAT = 1

# Directories never part of a session's file state: VCS, caches, virtual envs, our state.
IGNORED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        STATE_DIR,
        "__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".ipynb_checkpoints",
        ".venv",
        "venv",
        "node_modules",
        "build",
        "dist",
    }
)
IGNORED_SUFFIXES = (".pyc", ".pyo", ".archon-port", ".egg-info")
# Larger files (checkpoint shards, wheels) are not tracked: sessions record source edits.
MAX_TRACKED_BYTES = 2_000_000

# Results larger than this keep only their digest in the session file.
MAX_STORED_RESULT_BYTES = 16_384
# Float results are compared to this many significant digits (CPU kernels differ in the last bits).
DIGEST_SIGNIFICANT_DIGITS = 4
WORKSPACE_TOKEN = "<workspace>"
TMP_TOKEN = "<tmp>"
# A path under the system temporary directory: never the same twice, never worth comparing.
_TMP_PATH_RE = re.compile(re.escape(tempfile.gettempdir().rstrip(os.sep)) + r"/[^\s'\"(),:;]+")


# --- records -------------------------------------------------------------------------------


class FileContent(BaseModel):
    """A file's bytes as stored in a session: UTF-8 text, else base64."""

    text: str | None = None
    b64: str | None = None

    @classmethod
    def of(cls, data: bytes) -> FileContent:
        try:
            return cls(text=data.decode("utf-8"))
        except UnicodeDecodeError:
            return cls(b64=base64.b64encode(data).decode("ascii"))

    def to_bytes(self) -> bytes:
        if self.text is not None:
            return self.text.encode("utf-8")
        return base64.b64decode(self.b64 or "")


class ErrorInfo(BaseModel):
    """Why a call failed: the exception type and its message (workspace path normalised)."""

    type: str
    message: str


class SessionHeader(BaseModel):
    kind: Literal["session"] = "session"
    format: int = SESSION_FORMAT
    session_id: str
    engine_version: str
    created: str
    transformers: str | None = Field(
        default=None,
        description="the transformers version the session ran with (results depend on it: config "
        "defaults, checkpoint key names, the families it knows); absent in older sessions",
    )


class CallRecord(BaseModel):
    kind: Literal["call"] = "call"
    seq: int
    tool: str
    arguments: dict[str, Any]
    ok: bool
    result_digest: str | None = None
    result: Any = Field(default=None, description="the normalised result when small enough to keep")
    error: ErrorInfo | None = None
    files: dict[str, str | None] = Field(
        default_factory=dict, description="path -> sha256 after the call (None: deleted)"
    )
    base: dict[str, FileContent | None] = Field(
        default_factory=dict, description="content before the session first changed the path (None: absent)"
    )
    engine_version: str
    duration_s: float = 0.0


class EditRecord(BaseModel):
    kind: Literal["edit"] = "edit"
    seq: int
    patch: str
    files: dict[str, str | None]
    base: dict[str, FileContent | None] = Field(default_factory=dict)
    binary: dict[str, FileContent] = Field(default_factory=dict, description="new content of non-text files")


class CloseRecord(BaseModel):
    kind: Literal["close"] = "close"
    seq: int
    calls: int
    edits: int
    patch: str = Field(description="every edit made outside the tools during the session, in order")
    files: dict[str, str | None] = Field(
        default_factory=dict,
        description="path -> sha256 after closing: the headers that name what the hand edits changed",
    )


SessionRecord = Annotated[SessionHeader | CallRecord | EditRecord | CloseRecord, Field(discriminator="kind")]
_record_adapter: TypeAdapter[SessionRecord] = TypeAdapter(SessionRecord)


def read_session(path: str | os.PathLike) -> list[SessionHeader | CallRecord | EditRecord | CloseRecord]:
    """Parse a session file; raises ``ValueError`` naming the first bad line."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                records.append(_record_adapter.validate_json(line))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not a session record ({e})") from e
    if not records or not isinstance(records[0], SessionHeader):
        raise ValueError(f"{path}: a session file starts with a 'session' header line")
    if records[0].format != SESSION_FORMAT:
        raise ValueError(f"{path}: session format {records[0].format}, this engine reads {SESSION_FORMAT}")
    return records


# --- engine version ----------------------------------------------------------------------------

_engine_version: str | None = None


def transformers_version() -> str | None:
    """The installed transformers' version, read from its metadata (transformers is not imported)."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def engine_version() -> str:
    """``<version>+<hash of the engine's sources>``: two sessions with equal values ran the same engine."""
    global _engine_version
    if _engine_version is None:
        root = Path(__file__).resolve().parent
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
        _engine_version = f"{__version__}+{digest.hexdigest()[:12]}"
    return _engine_version


# --- normalisation and digests ------------------------------------------------------------------


def _is_volatile(info: Any) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("volatile"))


def _left_out(info: Any, value: Any) -> bool:
    """A field pydantic's own serialisation leaves out for this value (``exclude_if``)."""
    return info.exclude_if is not None and bool(info.exclude_if(value))


def _plain(value: Any) -> Any:
    """JSON-able form of ``value`` with fields marked volatile left out, and those whose
    ``exclude_if`` holds (a fact the family lacks), as ``model_dump`` leaves them out."""
    if isinstance(value, BaseModel):
        return {
            name: _plain(getattr(value, name))
            for name, info in type(value).model_fields.items()
            if not _is_volatile(info) and not _left_out(info, getattr(value, name))
        }
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    return to_jsonable_python(value)


def normalise_text(text: str, root: str) -> str:
    """``text`` with the workspace root as ``<workspace>``, other temporary paths as ``<tmp>``,
    and what else belongs to the run (endpoints, pids, durations: :func:`normalise_volatile`)
    as placeholders."""
    return normalise_volatile(_TMP_PATH_RE.sub(TMP_TOKEN, text.replace(root, WORKSPACE_TOKEN)))


def _normalise(value: Any, root: str) -> Any:
    if isinstance(value, str):
        return normalise_text(value, root)
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0.0:
            return value
        return float(f"{value:.{DIGEST_SIGNIFICANT_DIGITS}g}")
    if isinstance(value, dict):
        return {normalise_text(k, root): _normalise(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalise(v, root) for v in value]
    return value


def normalise_result(result: Any, workspace: Workspace) -> Any:
    """The result as compared across runs: no volatile fields, the workspace path as
    ``<workspace>``, other temporary paths as ``<tmp>``, floats to 4 significant digits."""
    return _normalise(_plain(result), str(workspace.root))


def digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def portable_arguments(arguments: Mapping[str, Any] | BaseModel, workspace: Workspace) -> dict[str, Any]:
    """Arguments as recorded: JSON-able, no ``workspace``, paths inside the workspace made relative."""
    data = _plain(arguments) if isinstance(arguments, BaseModel) else _plain(dict(arguments))
    data.pop("workspace", None)
    root = str(workspace.root)

    def relative(value: Any) -> Any:
        if isinstance(value, str) and (value == root or value.startswith(root + os.sep)):
            return Path(value).relative_to(root).as_posix() or "."
        if isinstance(value, dict):
            return {k: relative(v) for k, v in value.items()}
        if isinstance(value, list):
            return [relative(v) for v in value]
        return value

    return relative(data)


# --- workspace state ------------------------------------------------------------------------------


def is_ignored_dir(parent: str, name: str) -> bool:
    """Whether directory ``parent/name`` is outside a session's file state: a name in
    :data:`IGNORED_DIRS`, build metadata, or a virtual environment under any name (it holds a
    ``pyvenv.cfg``, as ``python -m venv`` writes: ``.venv-areal/``, ``.venv-tf53/``...)."""
    if name in IGNORED_DIRS or name.endswith(".egg-info"):
        return True
    return os.path.isfile(os.path.join(parent, name, "pyvenv.cfg"))


def iter_workspace_files(root: Path) -> Iterator[str]:
    """Workspace-relative POSIX paths of the files a session tracks, sorted per directory."""
    base = str(root)
    for directory, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not is_ignored_dir(directory, d))
        prefix = "" if directory == base else directory[len(base) + 1 :].replace(os.sep, "/") + "/"
        for filename in sorted(filenames):
            if not filename.endswith(IGNORED_SUFFIXES):
                yield prefix + filename


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore:
    """Content-addressed file contents under ``.archon-port/objects`` (like git's, uncompressed)."""

    def __init__(self, workspace: Workspace):
        self.root = state_dir(workspace, "objects")

    def put(self, digest_hex: str, data: bytes) -> None:
        path = self.root / digest_hex[:2] / digest_hex[2:]
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def get(self, digest_hex: str) -> bytes | None:
        path = self.root / digest_hex[:2] / digest_hex[2:]
        return path.read_bytes() if path.is_file() else None


class WorkspaceState:
    """The tracked files' hashes, re-hashing only files whose stat changed since last time."""

    def __init__(self, workspace: Workspace, store: ObjectStore, exclude: frozenset[str] = frozenset()):
        self.workspace = workspace
        self.store = store
        self.exclude = exclude
        self._stat_cache: dict[str, tuple[int, int, int, str]] = {}

    def scan(self) -> dict[str, str]:
        hashes: dict[str, str] = {}
        cache: dict[str, tuple[int, int, int, str]] = {}
        base = str(self.workspace.root)
        for rel in iter_workspace_files(self.workspace.root):
            if rel in self.exclude:
                continue
            path = os.path.join(base, rel)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # removed while we walked
                continue
            if st.st_size > MAX_TRACKED_BYTES:
                continue
            key = (st.st_mtime_ns, st.st_ctime_ns, st.st_size)
            cached = self._stat_cache.get(rel)
            if cached is not None and cached[:3] == key:
                hashes[rel] = cached[3]
            else:
                with open(path, "rb") as handle:
                    data = handle.read()
                hashes[rel] = _sha256(data)
                self.store.put(hashes[rel], data)
            cache[rel] = (*key, hashes[rel])
        self._stat_cache = cache
        return hashes

    def content(self, rel: str, digest_hex: str | None) -> bytes | None:
        if digest_hex is None:
            return None
        data = self.store.get(digest_hex)
        if data is None:
            raise FileNotFoundError(f"no stored content {digest_hex} for {rel} in {self.store.root}")
        return data


# --- patches (edits outside the tools) ---------------------------------------------------------------

_NO_NEWLINE = "\\ No newline at end of file\n"


def unified_diff(rel: str, old: bytes | None, new: bytes | None) -> str:
    """A git-style unified diff of one text file (``/dev/null`` for creation and deletion)."""
    old_lines = _lines((old or b"").decode("utf-8"))
    new_lines = _lines((new or b"").decode("utf-8"))
    out = [f"diff --git a/{rel} b/{rel}\n"]
    if old is None:
        out.append("new file mode 100644\n")
    elif new is None:
        out.append("deleted file mode 100644\n")
    lines = difflib.unified_diff(
        old_lines,
        new_lines,
        fromfile="/dev/null" if old is None else f"a/{rel}",
        tofile="/dev/null" if new is None else f"b/{rel}",
        n=3,
    )
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n" + _NO_NEWLINE)
    return "".join(out)


def patch_paths(patch: str) -> list[str]:
    """The paths a patch names, in order."""
    return [rel for rel, _ in patch_sections(patch)]


def patch_writes(patch: str) -> list[str]:
    """The paths a patch creates or changes (not those it only deletes), in order."""
    return [
        rel
        for rel, lines in patch_sections(patch)
        if not any(line.startswith("deleted file mode") for line in lines[1:3])
    ]


def apply_patch(root: Path, patch: str) -> list[str]:
    """Apply a patch written by :func:`unified_diff` under ``root``, strictly (context must match).

    Every path is confined to ``root`` after resolving symbolic links (a patch is
    untrusted input: :class:`~skill.codemod.workspace.WorkspaceError` for one that
    leaves it). Returns the paths changed. Raises :class:`PatchError` naming the file
    and hunk that does not apply.
    """
    changed: list[str] = []
    root = root.resolve()
    for rel, lines in patch_sections(patch):
        creating = any(line.startswith("new file mode") for line in lines[1:3])
        deleting = any(line.startswith("deleted file mode") for line in lines[1:3])
        path = confine(root, rel)
        if creating and path.exists():
            raise PatchError(f"{rel}: the patch creates it but it already exists")
        old = [] if creating else _lines(path.read_bytes().decode("utf-8"))
        new: list[str] = []
        cursor = 0
        i = next((k for k, line in enumerate(lines) if line.startswith("@@")), len(lines))
        while i < len(lines):
            header = lines[i]
            if not header.startswith("@@"):
                raise PatchError(f"{rel}: expected a hunk header, got {header!r}")
            match = HUNK_RE.match(header)
            if match is None:
                raise PatchError(f"{rel}: malformed hunk header {header.strip()!r}")
            old_start, old_count = int(match["start"]), int(match["count"] or 1)
            # A hunk with no old lines inserts after line ``old_start``.
            start = old_start if old_count == 0 else old_start - 1
            if start < cursor:
                raise PatchError(f"{rel}: hunk {header.strip()} overlaps the previous one")
            new.extend(old[cursor:start])
            cursor = start
            i += 1
            while i < len(lines) and not lines[i].startswith("@@"):
                line = lines[i]
                body = line[1:]
                if i + 1 < len(lines) and lines[i + 1] == _NO_NEWLINE:
                    body = body[:-1] if body.endswith("\n") else body
                    i += 1
                if line.startswith((" ", "-")):
                    if cursor >= len(old) or old[cursor] != body:
                        raise PatchError(f"{rel}: hunk {header.strip()} does not match line {cursor + 1}")
                    cursor += 1
                    if line.startswith(" "):
                        new.append(body)
                elif line.startswith("+"):
                    new.append(body)
                else:
                    raise PatchError(f"{rel}: unexpected patch line {line!r}")
                i += 1
        new.extend(old[cursor:])
        if deleting:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes("".join(new).encode("utf-8"))
        changed.append(rel)
    return changed


# --- the recorder -----------------------------------------------------------------------------------------


class CallHandle:
    """What ``record_call`` yields: the step hands its result back through it."""

    def __init__(self) -> None:
        self.result: BaseModel | None = None

    def set_result(self, result: BaseModel) -> None:
        self.result = result


def open_records(path: str | os.PathLike) -> list:
    """The records of a session file that can be recorded into (``[]`` for a new one).

    Raises ``ValueError`` for a file that is not a session or one already closed.
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return []
    records = read_session(path)
    if isinstance(records[-1], CloseRecord):
        raise ValueError(f"session {path} is closed; record into a new file")
    return records


class SessionRecorder:
    """Appends a workspace's tool calls to one session file.

    Calls that change files run one at a time (a recorder lock), so each call's file
    changes are its own; a read-only call takes the lock only to capture earlier edits,
    then runs alongside others (the package locks keep it off a package being changed).
    Lines are written in completion order, which is the order a replay runs them in.
    Opening an existing session that was not closed continues it.
    """

    def __init__(self, path: str | os.PathLike, workspace: str | os.PathLike | Workspace | None = None):
        self.path = Path(path).resolve()
        self.workspace = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
        # The session file itself may live in the workspace; its own growth is not an edit.
        own = (
            {self.path.relative_to(self.workspace.root).as_posix()}
            if self.workspace.root in self.path.parents
            else set()
        )
        self.state = WorkspaceState(self.workspace, ObjectStore(self.workspace), frozenset(own))
        self._write_lock = threading.Lock()
        self._change_lock = threading.RLock()
        self._closed = False
        key = hashlib.sha256(str(self.path).encode()).hexdigest()[:16]
        self._checkpoint_path = state_dir(self.workspace, "sessions") / f"{key}.checkpoint.json"
        self._touched: set[str] = set()
        self.last_call: CallRecord | None = None
        records = open_records(self.path)
        if records:
            self.session_id = records[0].session_id
            self._seq = max(getattr(r, "seq", 0) for r in records)
            self._calls = sum(isinstance(r, CallRecord) for r in records)
            self._edits = sum(isinstance(r, EditRecord) for r in records)
            for record in records:
                self._touched.update(getattr(record, "base", {}))
            self._expected = self._load_checkpoint()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.session_id = uuid.uuid4().hex
            self._seq = self._calls = self._edits = 0
            header = SessionHeader(
                session_id=self.session_id,
                engine_version=engine_version(),
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                transformers=transformers_version(),
            )
            self._append(header)
            self._expected = self.state.scan()
            self._save_checkpoint()
        logger.info("recording session %s to %s", self.session_id, self.path)

    # checkpoint: the file state after the last recorded change, for sessions spanning processes
    def _load_checkpoint(self) -> dict[str, str]:
        if self._checkpoint_path.is_file():
            return json.loads(self._checkpoint_path.read_text(encoding="utf-8"))["files"]
        logger.warning(
            "session %s has no checkpoint in this workspace; edits made before now are not captured", self.path
        )
        return self.state.scan()

    def _save_checkpoint(self) -> None:
        payload = {"session": str(self.path), "files": self._expected}
        tmp = self._checkpoint_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload), encoding="utf-8")
        os.replace(tmp, self._checkpoint_path)

    def _append(self, record: BaseModel) -> None:
        line = record.model_dump_json(exclude_none=False) + "\n"
        with self._write_lock:
            if self._closed:
                raise RuntimeError(f"session {self.path} is closed")
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line)

    def _next_seq(self) -> int:
        with self._write_lock:
            self._seq += 1
            return self._seq

    def _delta(self, before: dict[str, str], after: dict[str, str]) -> dict[str, str | None]:
        changed: dict[str, str | None] = {}
        for rel in sorted(set(before) | set(after)):
            if before.get(rel) != after.get(rel):
                changed[rel] = after.get(rel)
        return changed

    def _base_for(self, changed: Mapping[str, str | None], before: dict[str, str]) -> dict[str, FileContent | None]:
        """Content before the session first touched each path (for replay's starting state)."""
        base: dict[str, FileContent | None] = {}
        for rel in changed:
            if rel in self._touched:
                continue
            self._touched.add(rel)
            data = self.state.content(rel, before.get(rel))
            base[rel] = None if data is None else FileContent.of(data)
        return base

    def _capture_manual_edits(self) -> None:
        """Record edits made since the last checkpoint as an ``edit`` line."""
        current = self.state.scan()
        changed = self._delta(self._expected, current)
        if not changed:
            return
        patches: list[str] = []
        binary: dict[str, FileContent] = {}
        for rel, new_hash in changed.items():
            old = self.state.content(rel, self._expected.get(rel))
            new = self.state.content(rel, new_hash)
            try:
                patches.append(unified_diff(rel, old, new))
            except UnicodeDecodeError:
                patches.append(f"diff --git a/{rel} b/{rel}\nBinary files differ\n")
                if new is not None:
                    binary[rel] = FileContent.of(new)
        record = EditRecord(
            seq=self._next_seq(),
            patch="".join(patches),
            files=changed,
            base=self._base_for(changed, self._expected),
            binary=binary,
        )
        self._append(record)
        self._edits += 1
        self._expected = current
        self._save_checkpoint()
        logger.info("session %s: captured edits outside the tools in %s", self.session_id, ", ".join(changed))

    @contextlib.contextmanager
    def record_call(self, tool: Tool, arguments: Mapping[str, Any] | BaseModel) -> Iterator[CallHandle]:
        """Record one call of ``tool``: its result (via the handle) or its exception, and its file changes.

        ``arguments`` are recorded portable (:func:`portable_arguments`).

        Edits made outside the tools since the last call are captured first, so a replay
        applies them before this call. A call that may change files holds the recorder's
        lock until its changes are recorded; a read-only one runs alongside others.
        """
        recorded_arguments = portable_arguments(arguments, self.workspace)
        handle = CallHandle()
        changes_files = not tool.entry.read_only
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._change_lock)
            self._capture_manual_edits()
            before = self._expected
            if not changes_files:
                stack.close()
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                yield handle
            except BaseException as e:
                error = e
                raise
            finally:
                record = CallRecord(
                    seq=0,
                    tool=tool.name,
                    arguments=recorded_arguments,
                    ok=error is None,
                    engine_version=engine_version(),
                    duration_s=round(time.perf_counter() - start, 4),
                )
                if changes_files:
                    after = self.state.scan()
                    record.files = self._delta(before, after)
                    record.base = self._base_for(record.files, before)
                    self._expected = after
                    self._save_checkpoint()
                if error is not None:
                    record.error = ErrorInfo(
                        type=type(error).__name__,
                        message=normalise_text(str(error), str(self.workspace.root)),
                    )
                elif handle.result is not None:
                    normalised = normalise_result(handle.result, self.workspace)
                    record.result_digest = digest(normalised)
                    if len(json.dumps(normalised)) <= MAX_STORED_RESULT_BYTES:
                        record.result = normalised
                record.seq = self._next_seq()
                self._append(record)
                self._calls += 1
                self.last_call = record

    def _name_hand_edits(self, edits: list[EditRecord]) -> dict[str, str | None]:
        """Name what ``edits`` changed (files and functions, read from each patch and the files
        as it left them) in the header of each hand-edited package; returns the files rewritten."""
        # The porting engine knows package headers; the recorder only hands it the edits.
        from skill.porting.hand_written import changed_definitions, merge, restamp_hand_edited

        changes = []
        for edit in edits:
            after = {}
            for rel, digest_hex in edit.files.items():
                try:
                    data = None if rel in edit.binary else self.state.content(rel, digest_hex)
                except FileNotFoundError:  # recorded in another workspace: the file is named, not its functions
                    data = None
                if data is not None:
                    after[rel] = data.decode("utf-8")
            changes.append(changed_definitions(edit.patch, after))
        if not restamp_hand_edited(self.workspace, merge(changes)):
            return {}
        current = self.state.scan()
        files = self._delta(self._expected, current)
        self._expected = current
        return files

    def close(self) -> CloseRecord:
        """Capture remaining edits outside the tools and write the closing line with their patch."""
        with self._change_lock:
            self._capture_manual_edits()
            edits = [r for r in read_session(self.path) if isinstance(r, EditRecord)]
            patch = "".join(r.patch for r in edits)
            files = self._name_hand_edits(edits)
            record = CloseRecord(seq=self._next_seq(), calls=self._calls, edits=self._edits, patch=patch, files=files)
            self._append(record)
            with self._write_lock:
                self._closed = True
            self._checkpoint_path.unlink(missing_ok=True)
        logger.info("closed session %s: %d call(s), %d edit(s) outside the tools", self.path, self._calls, self._edits)
        return record


def active_session() -> SessionRecorder | None:
    """The session :func:`skill.tools.invoke` records into when none is passed."""
    recorder = active_recorder()
    return recorder if isinstance(recorder, SessionRecorder) else None


@contextlib.contextmanager
def recording(
    path: str | os.PathLike, workspace: str | os.PathLike | Workspace | None = None, *, close: bool = False
) -> Iterator[SessionRecorder]:
    """Make a session active for the calls inside the block (the CLI's ``--record``).

    ``close=False`` leaves the session open so later commands can continue it; close
    it with ``archon-port replay --close`` or :meth:`SessionRecorder.close`.
    """
    recorder = SessionRecorder(path, workspace)
    try:
        with recording_into(recorder):
            yield recorder
    finally:
        if close:
            recorder.close()
