"""Transactional, confined file writes inside a project workspace.

A step never writes straight to disk: it stages whole-file contents in a
``StagedTree`` and the transaction applies them at the end, all or nothing. If
anything raises before or during the apply (KeyboardInterrupt included) the files
written so far are restored and the directories created are removed, so the tree
never holds half a package or an import line pointing at a package that is not there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

logger = logging.getLogger(__name__)

_DELETED = object()


class WorkspaceError(ValueError):
    """A path or workspace the engine refuses to touch."""


class ConcurrentEditError(RuntimeError):
    """A file changed on disk between staging an edit and applying it."""


def _read_bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


class Workspace:
    """A project root holding ``archon_models/``; every path is confined inside it."""

    def __init__(self, root: str | os.PathLike | None = None, marker: str = "archon_models"):
        """``marker`` is the directory the root must hold: ``archon_models`` for this
        project, ``areal/experimental/models/archon`` for an AReaL tree an export writes to."""
        self.root = Path(root if root is not None else find_project_root()).resolve()
        if not (self.root / marker).is_dir():
            raise WorkspaceError(
                f"{self.root} holds no {marker}/ directory; run from the archon-port "
                "project root or pass workspace=<that root>."
            )

    def resolve(self, rel: str | os.PathLike) -> Path:
        """The absolute path of ``rel``; raises ``WorkspaceError`` if it leaves the root."""
        rel_path = PurePosixPath(str(rel).replace(os.sep, "/"))
        if rel_path.is_absolute():
            raise WorkspaceError(f"{rel} is absolute; engine paths are relative to the workspace.")
        target = (self.root / rel_path).resolve()
        if target != self.root and self.root not in target.parents:
            raise WorkspaceError(f"{rel} resolves outside the workspace {self.root}; refused.")
        return target

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"


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
        # to overwrite a file that changed since (a concurrent edit would be lost).
        self._base: dict[str, bytes | None] = {}

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

    def delete(self, rel: str | os.PathLike) -> None:
        key = self._key(rel)
        self._snapshot(key)
        self._staged[key] = _DELETED

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

        Each file is written to a temporary sibling and moved into place with
        ``os.replace``. On any exception (KeyboardInterrupt included) the originals
        are restored, new files and directories are removed, and the error re-raised.
        """
        changes = self.changes()
        moved = [
            key
            for key in changes
            if key in self._base and _read_bytes(self.workspace.resolve(key)) != self._base[key]
        ]
        if moved:
            raise ConcurrentEditError(
                f"{', '.join(sorted(moved))} changed on disk while the edit was being prepared; "
                "nothing was written. Run the step again to apply it on top of the new content."
            )
        originals: dict[Path, bytes | None] = {}
        created_dirs: list[Path] = []
        temps: list[Path] = []
        try:
            prepared: list[tuple[Path, Path | None]] = []
            for key, text in sorted(changes.items()):
                path = self.workspace.resolve(key)
                originals[path] = path.read_bytes() if path.is_file() else None
                if text is None:
                    prepared.append((path, None))
                    continue
                missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
                for directory in reversed(missing):
                    directory.mkdir()
                    created_dirs.append(directory)
                fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".archon-port", dir=path.parent)
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(text)
                os.chmod(tmp_name, 0o644)
                temps.append(Path(tmp_name))
                prepared.append((path, Path(tmp_name)))
            for path, tmp in prepared:
                if tmp is None:
                    path.unlink()
                else:
                    os.replace(tmp, path)
                    temps.remove(tmp)
        except BaseException:
            logger.warning("Rolling back %d staged file(s)", len(changes))
            _rollback(originals, created_dirs, temps)
            raise
        self._staged.clear()
        return sorted(changes)


def _rollback(originals: dict[Path, bytes | None], created_dirs: list[Path], temps: list[Path]) -> None:
    for tmp in temps:
        with contextlib.suppress(OSError):
            tmp.unlink()
    for path, data in originals.items():
        with contextlib.suppress(OSError):
            if data is None:
                if path.exists():
                    path.unlink()
            else:
                path.write_bytes(data)
    for directory in reversed(created_dirs):
        with contextlib.suppress(OSError):
            for cache in directory.rglob("__pycache__"):
                for item in cache.iterdir():
                    item.unlink()
                cache.rmdir()
            directory.rmdir()


@contextlib.contextmanager
def transaction(workspace: Workspace, *, dry_run: bool = False) -> Iterator[StagedTree]:
    """Stage writes; apply them all when the block exits cleanly, none otherwise."""
    staged = StagedTree(workspace)
    yield staged
    if not dry_run:
        staged.commit()
