"""Transactional, confined file writes inside a project workspace.

A step never writes straight to disk: it stages whole-file contents in a
``StagedTree`` and the transaction applies them at the end, all or nothing, through
the journal of :mod:`skill.codemod.journal`. If anything raises before or during the
apply (KeyboardInterrupt included) the files written so far are restored and the
directories created are removed; a process killed mid-write is rolled back by the next
call. The tree never holds half a package or an import line pointing at a package that
is not there.

Commits run one at a time per workspace (the commit lock). A shared file edited by a
function of its content (the registry's import lines, :meth:`StagedTree.update_text`)
is re-edited on top of what another call committed meanwhile instead of overwriting
it, and the checks a step registers with :meth:`StagedTree.add_commit_check` run again
under the lock, so two calls cannot both claim what only one may have.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from skill.codemod import journal

logger = logging.getLogger(__name__)

_DELETED = object()

# Where the engine keeps per-workspace state (locks, journals, sessions, reports).
STATE_DIR = ".archon-port"


class WorkspaceError(ValueError):
    """A path or workspace the engine refuses to touch."""


class ConcurrentEditError(RuntimeError):
    """A file changed on disk between staging an edit and applying it."""


class CallCancelledError(RuntimeError):
    """The call was cancelled (its client went away) before its changes were committed."""


_cancel_event: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "archon_port_cancel", default=None
)


@contextlib.contextmanager
def cancellable(event: threading.Event | None) -> Iterator[None]:
    """Within the block, a commit refuses to start once ``event`` is set."""
    token = _cancel_event.set(event)
    try:
        yield
    finally:
        _cancel_event.reset(token)


def check_cancelled() -> None:
    """Raise :class:`CallCancelledError` when the running call has been cancelled."""
    event = _cancel_event.get()
    if event is not None and event.is_set():
        raise CallCancelledError("the call was cancelled before its changes were written; nothing was written.")


def _read_bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


class Workspace:
    """A project root holding ``archon_models/``; every path is confined inside it."""

    def __init__(self, root: str | os.PathLike | None = None, marker: str = "archon_models"):
        """``marker`` is the directory the root must hold: ``archon_models`` for this
        project, ``areal/experimental/models/archon`` for an AReaL tree an export writes to."""
        self.root = Path(root if root is not None else find_project_root()).resolve()
        self.models_dir = marker
        if not (self.root / marker).is_dir():
            raise WorkspaceError(
                f"{self.root} holds no {marker}/ directory; run from the archon-port "
                "project root or pass workspace=<that root>."
            )

    @property
    def registry(self) -> str:
        """The registry module, ``<marker>/__init__.py``: the import lines of the model packages,
        written last by every commit (see :mod:`skill.codemod.journal`)."""
        return f"{self.models_dir}/__init__.py"

    def resolve(self, rel: str | os.PathLike) -> Path:
        """The absolute path of ``rel``; raises ``WorkspaceError`` if it leaves the root."""
        return confine(self.root, rel)

    @property
    def state_root(self) -> Path:
        """``<root>/.archon-port``, where the engine keeps its state (not created here)."""
        return self.root / STATE_DIR

    def state_dir(self, *parts: str) -> Path:
        """``<root>/.archon-port/<parts>``, created; refused when a link leads it outside.

        Sessions, locks and journals must live inside the workspace: a symbolic link on
        the way would put them (and every lock's meaning) somewhere else.
        """
        root = self.root / STATE_DIR
        if root.is_symlink():
            raise WorkspaceError(
                f"{root} is a symbolic link; the engine keeps its state only inside the workspace. "
                f"Remove the link (rm {root}) and run again."
            )
        if not root.is_dir():
            root.mkdir(exist_ok=True)
            (root / ".gitignore").write_text("*\n", encoding="utf-8")
        path = root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        if path.resolve() != path:
            raise WorkspaceError(f"{path} leads outside the workspace through a symbolic link; remove the link.")
        return path

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"


def confine(root: Path, rel: str | os.PathLike) -> Path:
    """``root / rel`` with symbolic links resolved; ``WorkspaceError`` unless it stays inside ``root``.

    ``root`` must be resolved already. Absolute paths, ``..`` that climbs out, NUL bytes
    and links (anywhere on the way) that lead outside are all refused.
    """
    text = os.fspath(rel)
    if "\0" in text:
        raise WorkspaceError(f"{text!r} holds a NUL byte; refused.")
    rel_path = PurePosixPath(text.replace(os.sep, "/"))
    if rel_path.is_absolute():
        raise WorkspaceError(f"{text} is absolute; engine paths are relative to the workspace.")
    target = (root / rel_path).resolve()
    if target != root and root not in target.parents:
        raise WorkspaceError(f"{text} resolves outside the workspace {root}; refused.")
    return target


def find_project_root(start: str | os.PathLike | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) holding ``archon_models/``."""
    here = Path(start or os.getcwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "archon_models").is_dir() and (candidate / "archon_models" / "__init__.py").is_file():
            return candidate
    raise WorkspaceError(
        f"No archon_models/ found at or above {here}; run inside the archon-port project "
        "or pass workspace=<project root>."
    )


class StagedTree:
    """Whole-file writes staged in memory over a workspace; reads see the staged state."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self._staged: dict[str, object] = {}
        # Disk content of every path when this tree first looked at it; commit refuses
        # to overwrite a file that changed since (a concurrent edit would be lost)...
        self._base: dict[str, bytes | None] = {}
        # ...unless every change to it was a function of its content, re-run on the new one.
        self._edits: dict[str, list[Callable[[str], str]]] = {}
        self._checks: list[Callable[[StagedTree], None]] = []

    def _snapshot(self, key: str) -> None:
        if key not in self._base:
            path = self.workspace.resolve(key)
            self._base[key] = path.read_bytes() if path.is_file() else None

    @staticmethod
    def _key(rel: str | os.PathLike) -> str:
        return str(PurePosixPath(str(rel).replace(os.sep, "/")))

    def exists(self, rel: str | os.PathLike) -> bool:
        """Whether ``rel`` is a file or directory in the staged state."""
        key = self._key(rel)
        if key in self._staged:
            return self._staged[key] is not _DELETED
        prefix = key.rstrip("/") + "/"
        if any(k.startswith(prefix) and v is not _DELETED for k, v in self._staged.items()):
            return True
        return self.workspace.resolve(key).exists()

    def read_text(self, rel: str | os.PathLike) -> str | None:
        """The staged content of ``rel``, else the file on disk, else ``None``."""
        key = self._key(rel)
        if key in self._staged:
            value = self._staged[key]
            return None if value is _DELETED else str(value)
        self._snapshot(key)
        data = self._base[key]
        return None if data is None else data.decode("utf-8")

    def write_text(self, rel: str | os.PathLike, text: str) -> None:
        key = self._key(rel)
        self._snapshot(key)  # also the confinement check, now rather than at commit
        self._staged[key] = text
        self._edits.pop(key, None)

    def update_text(self, rel: str | os.PathLike, edit: Callable[[str], str]) -> str:
        """Stage ``edit`` of an existing file's text; returns the new staged text.

        Unlike :meth:`write_text`, the edit is re-applied at commit when another call
        changed the file meanwhile (for shared files such as the registry).
        """
        key = self._key(rel)
        current = self.read_text(key)
        if current is None:
            raise FileNotFoundError(f"{key} does not exist")
        rebasable = key not in self._staged or key in self._edits
        new = edit(current)
        self._staged[key] = new
        if rebasable:
            self._edits.setdefault(key, []).append(edit)
        return new

    def add_commit_check(self, check: Callable[[StagedTree], None]) -> None:
        """Run ``check`` again at commit, under the commit lock, over the state about to be written.

        It sees what other calls committed since this tree was staged, so a claim (a
        model_type) made by two calls at once is refused for the second; raise to refuse.
        """
        self._checks.append(check)

    def delete(self, rel: str | os.PathLike) -> None:
        key = self._key(rel)
        self._snapshot(key)
        self._staged[key] = _DELETED
        self._edits.pop(key, None)

    def delete_tree(self, rel_dir: str | os.PathLike) -> None:
        """Stage the removal of every file under ``rel_dir`` (later writes win)."""
        for key in self.list_files(rel_dir):
            self.delete(key)

    def list_files(self, rel_dir: str | os.PathLike) -> list[str]:
        """Files under ``rel_dir`` (recursive, workspace-relative), staged state included."""
        base = self._key(rel_dir).rstrip("/")
        found: set[str] = set()
        root = self.workspace.resolve(base)
        if root.is_dir():
            for path in root.rglob("*"):
                if path.is_file() and "__pycache__" not in path.parts:
                    found.add(str(PurePosixPath(path.relative_to(self.workspace.root).as_posix())))
        for key, value in self._staged.items():
            if key.startswith(base + "/"):
                if value is _DELETED:
                    found.discard(key)
                else:
                    found.add(key)
        return sorted(found)

    def changes(self) -> dict[str, str | None]:
        """Staged writes that differ from disk: path -> new text (``None`` = delete)."""
        result: dict[str, str | None] = {}
        for key, value in self._staged.items():
            path = self.workspace.resolve(key)
            on_disk = path.read_text(encoding="utf-8") if path.is_file() else None
            new = None if value is _DELETED else str(value)
            if new != on_disk:
                result[key] = new
        return result

    def changed_paths(self) -> list[str]:
        return sorted(self.changes())

    def commit(self) -> list[str]:
        """Apply every staged change atomically; returns the paths changed.

        Runs under the workspace's commit lock: unfinished transactions of killed calls
        are rolled back first, files edited with :meth:`update_text` are re-edited on
        top of any newer content, other files changed on disk since staging are refused
        (:class:`ConcurrentEditError`), the commit checks run, and the changes are
        applied through the journal. On any exception (KeyboardInterrupt included) the
        originals are restored and the error re-raised. A cancelled call writes nothing.
        """
        check_cancelled()
        with journal.commit_lock(self.workspace):
            journal.recover_locked(self.workspace)
            self._rebase()
            for check in self._checks:
                check(self._fresh_view())
            changes = self.changes()
            check_cancelled()
            journal.apply(
                self.workspace, {key: None if text is None else text.encode("utf-8") for key, text in changes.items()}
            )
        self._staged.clear()
        self._edits.clear()
        return sorted(changes)

    def _rebase(self) -> None:
        moved = []
        for key in self._staged:
            if key not in self._base:
                continue
            on_disk = _read_bytes(self.workspace.resolve(key))
            if on_disk == self._base[key]:
                continue
            if key in self._edits and on_disk is not None:
                text = on_disk.decode("utf-8")
                for edit in self._edits[key]:
                    text = edit(text)
                self._staged[key] = text
                self._base[key] = on_disk
                logger.info("%s changed on disk meanwhile; re-applied this call's edit on top", key)
            else:
                moved.append(key)
        moved = [key for key in moved if key in self.changes()]
        if moved:
            raise ConcurrentEditError(
                f"{', '.join(sorted(moved))} changed on disk while the edit was being prepared; "
                "nothing was written. Run the step again to apply it on top of the new content."
            )

    def _fresh_view(self) -> StagedTree:
        """This tree's staged changes over the disk as it is now."""
        view = StagedTree(self.workspace)
        view._staged = dict(self._staged)
        return view


@contextlib.contextmanager
def transaction(workspace: Workspace, *, dry_run: bool = False) -> Iterator[StagedTree]:
    """Stage writes; apply them all when the block exits cleanly, none otherwise."""
    staged = StagedTree(workspace)
    yield staged
    if not dry_run:
        staged.commit()
