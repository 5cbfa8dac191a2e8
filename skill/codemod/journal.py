"""Crash-safe application of staged file changes: an undo journal any later call rolls back.

A commit runs under the workspace's commit lock (an ``flock``, so it serialises threads
and processes alike) and goes through three phases, each safe to be killed in:

1. *prepare*: under ``.archon-port/txn/<id>/`` write the new content of every file and a
   backup of its current content, then the journal (``journal.json``, moved into place
   with one ``os.replace``). Nothing in the workspace has changed yet.
2. *apply*: create the missing directories, then move each new file into place with
   ``os.replace``. The registry (the workspace's ``archon_models/__init__.py``, or an AReaL
   tree's ``areal/experimental/models/archon/__init__.py`` for an export) is written last,
   so its import line for a new package appears only once that package is complete; a
   package it already imports and whose files change together is first taken out of it
   (an interim registry), so importing the registry works at every instant.
3. *commit point*: ``journal.json`` is unlinked, then the transaction folder removed.

Recovery (:func:`recover`, run by every tool call and every commit) takes the commit
lock, so no commit is in flight, and rolls back each transaction folder that still holds
a journal: the backups are put back in the same import-safe order and the directories
the transaction created are removed. A folder without a journal never touched the
workspace and is deleted. The workspace thus ends in the state before or after a commit,
whatever instant the process died at.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from skill.codemod.workspace import Workspace

logger = logging.getLogger(__name__)

JOURNAL = "journal.json"


def _registry_import(prefix: str) -> re.Pattern[str]:
    """A one-line import of a model package in the registry (``from <prefix>.x import spec as x_spec``)."""
    return re.compile(rf"from {re.escape(prefix)}\.(?P<package>\w+)[\w.]* import [^(\n]*")


class JournalEntry(BaseModel):
    """One file a transaction may change, with where its backup lies."""

    path: str
    existed: bool


class Journal(BaseModel):
    """The undo record of one transaction, written before the workspace is touched."""

    txid: str
    pid: int
    entries: list[JournalEntry]
    created_dirs: list[str]


@contextlib.contextmanager
def commit_lock(workspace: Workspace) -> Iterator[None]:
    """Hold the workspace's commit lock (exclusive; blocks while another commit runs)."""
    path = workspace.state_dir("locks") / "_commit.lock"
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _package_of(workspace: Workspace, rel: str) -> str | None:
    """The model package ``rel`` lies in (``<models dir>/<package>/...``), if any."""
    parts = PurePosixPath(rel).parts
    base = PurePosixPath(workspace.models_dir).parts
    inside = len(parts) > len(base) + 1 and parts[: len(base)] == base
    return parts[len(base)] if inside else None


def _imported_by(pattern: re.Pattern[str], line: str) -> str | None:
    match = pattern.fullmatch(line.rstrip("\r\n"))
    return match["package"] if match else None


def _without_imports(pattern: re.Pattern[str], registry: str, packages: set[str]) -> str:
    """``registry`` less the one-line imports of ``packages``."""
    lines = registry.splitlines(keepends=True)
    return "".join(line for line in lines if _imported_by(pattern, line) not in packages)


def plan(workspace: Workspace, changes: Mapping[str, bytes | None]) -> list[tuple[str, bytes | None]]:
    """The order to apply ``changes`` in so that importing the registry works throughout.

    Package files first, deletions after writes, the registry last; when two or more
    files of a package the registry imports now change together, an interim registry
    without that import goes first.
    """
    registry = workspace.registry
    pattern = _registry_import(workspace.models_dir.replace("/", "."))
    registry_path = workspace.root / registry
    current = registry_path.read_bytes() if registry_path.is_file() else None
    steps: list[tuple[str, bytes | None]] = []
    if current is not None:
        lines = current.decode("utf-8").splitlines()
        imported = {p for line in lines if (p := _imported_by(pattern, line)) is not None}
        counts: dict[str, int] = {}
        for rel in changes:
            package = _package_of(workspace, rel)
            if package is not None and package in imported:
                counts[package] = counts.get(package, 0) + 1
        unsafe = {package for package, count in counts.items() if count > 1}
        interim = _without_imports(pattern, current.decode("utf-8"), unsafe).encode("utf-8")
        if interim != current:
            steps.append((registry, interim))
    others = sorted(rel for rel in changes if rel != registry)
    steps += [(rel, changes[rel]) for rel in others if changes[rel] is not None]
    steps += [(rel, None) for rel in others if changes[rel] is None]
    if registry in changes:
        steps.append((registry, changes[registry]))
    elif steps and steps[0][0] == registry:
        steps.append((registry, current))
    return steps


def _apply_steps(workspace: Workspace, txdir: Path, steps: list[tuple[str, bytes | None]]) -> None:
    for number, (rel, data) in enumerate(steps):
        target = workspace.resolve(rel)
        if data is None:
            if target.is_file() or target.is_symlink():
                os.unlink(target)
            continue
        staged = txdir / f"{number}.apply"
        _write_file(staged, data)
        os.replace(staged, target)


def _remove_created_dirs(workspace: Workspace, created: list[str]) -> None:
    for rel in reversed(created):
        directory = workspace.root / rel
        with contextlib.suppress(OSError):
            cache = directory / "__pycache__"
            if cache.is_dir():
                shutil.rmtree(cache)
            os.rmdir(directory)


def apply(workspace: Workspace, changes: Mapping[str, bytes | None]) -> None:
    """Apply ``changes`` (path -> new bytes, ``None`` to delete) as one journaled transaction.

    The caller holds :func:`commit_lock`. An exception (KeyboardInterrupt included) rolls
    back what was applied and re-raises; a killed process is rolled back by :func:`recover`.
    """
    txid = uuid.uuid4().hex
    txdir = workspace.state_dir("txn", txid)
    registry = workspace.registry
    paths = sorted(set(changes) | ({registry} if (workspace.root / registry).is_file() else set()))
    entries: list[JournalEntry] = []
    for number, rel in enumerate(paths):
        target = workspace.resolve(rel)
        existed = target.is_file()
        if existed:
            _write_file(txdir / f"{number}.old", target.read_bytes())
        entries.append(JournalEntry(path=rel, existed=existed))
    created: list[str] = []
    for rel, data in changes.items():
        if data is None:
            continue
        parent = workspace.resolve(rel).parent
        for directory in reversed([p for p in (parent, *parent.parents) if not p.exists()]):
            relative = directory.relative_to(workspace.root).as_posix()
            if relative not in created:
                created.append(relative)
    created.sort(key=lambda rel: (rel.count("/"), rel))
    journal = Journal(txid=txid, pid=os.getpid(), entries=entries, created_dirs=created)
    _write_file(txdir / f"{JOURNAL}.tmp", journal.model_dump_json().encode("utf-8"))
    os.replace(txdir / f"{JOURNAL}.tmp", txdir / JOURNAL)
    try:
        for rel in created:
            os.mkdir(workspace.root / rel)
        _apply_steps(workspace, txdir, plan(workspace, changes))
    except BaseException:
        logger.warning("rolling back transaction %s (%d file(s))", txid, len(changes))
        _roll_back(workspace, txdir)
        raise
    os.unlink(txdir / JOURNAL)
    shutil.rmtree(txdir, ignore_errors=True)


def _roll_back(workspace: Workspace, txdir: Path) -> None:
    journal = Journal.model_validate_json((txdir / JOURNAL).read_bytes())
    originals: dict[str, bytes | None] = {}
    for number, entry in enumerate(journal.entries):
        originals[entry.path] = (txdir / f"{number}.old").read_bytes() if entry.existed else None
    _apply_steps(workspace, txdir, plan(workspace, originals))
    _remove_created_dirs(workspace, journal.created_dirs)
    os.unlink(txdir / JOURNAL)
    shutil.rmtree(txdir, ignore_errors=True)


def _txn_root(workspace: Workspace) -> Path:
    return workspace.state_root / "txn"


def recover_locked(workspace: Workspace) -> list[str]:
    """Roll back every unfinished transaction; the caller holds :func:`commit_lock`."""
    txn_root = _txn_root(workspace)
    if not txn_root.is_dir():
        return []
    rolled_back: list[str] = []
    for txdir in sorted(txn_root.iterdir()):
        if (txdir / JOURNAL).is_file():
            logger.warning("rolling back the unfinished transaction %s of a call that was interrupted", txdir.name)
            _roll_back(workspace, txdir)
            rolled_back.append(txdir.name)
        else:
            shutil.rmtree(txdir, ignore_errors=True)
    return rolled_back


def recover(workspace: Workspace) -> list[str]:
    """Roll back the transactions of calls that died mid-commit; returns their ids."""
    if not _txn_root(workspace).is_dir():
        return []
    with commit_lock(workspace):
        return recover_locked(workspace)
