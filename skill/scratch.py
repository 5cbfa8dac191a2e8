"""Temporary folders that do not outlive the process that made them, even a killed one.

Every scratch folder of the engine is ``<tmp>/archon-port-<kind>-<pid>-<random>``: the
process that made it removes it when the block ends (an exception and Ctrl-C included);
a SIGKILL runs no cleanup, so making any scratch folder first removes every engine scratch
folder whose process is gone (:func:`sweep_stale_scratch`). A killed ``add`` (its TP-plan
trace), replay (its copy of the repository) or divergence worker thus leaves its folder
only until the next engine call that needs one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "archon-port"
# <PREFIX>-<kind>-<pid>-<random>: the kind is one lowercase word, the pid the maker's.
_SCRATCH_NAME = re.compile(rf"{PREFIX}-(?P<kind>[a-z]+)-(?P<pid>\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kind_prefix(kind: str) -> str:
    """``kind`` as a folder prefix: ``plan`` and ``archon-port-plan`` both give ``archon-port-plan``."""
    name = kind if kind.startswith(f"{PREFIX}-") else f"{PREFIX}-{kind}"
    if not re.fullmatch(rf"{PREFIX}-[a-z]+", name):
        raise ValueError(f"scratch kind {kind!r}: one lowercase word, such as 'plan'")
    return name


def sweep_stale_scratch(prefix: str | None = None, root: Path | None = None) -> list[Path]:
    """Remove the scratch folders (of ``prefix``'s kind, or of every kind) whose process is gone."""
    base = Path(root or tempfile.gettempdir())
    wanted = None if prefix is None else _kind_prefix(prefix)
    removed: list[Path] = []
    for folder in base.glob(f"{PREFIX}-*-*-*"):
        match = _SCRATCH_NAME.match(folder.name)
        if match is None or (wanted is not None and not folder.name.startswith(f"{wanted}-")):
            continue
        if folder.is_dir() and not folder.is_symlink() and not _pid_alive(int(match["pid"])):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        logger.info("removed %d scratch folder(s) left by killed processes", len(removed))
    return removed


def make_scratch_dir(kind: str) -> Path:
    """A new folder ``archon-port-<kind>-<pid>-*`` the caller removes; stale ones of dead processes go first."""
    sweep_stale_scratch()
    return Path(tempfile.mkdtemp(prefix=f"{_kind_prefix(kind)}-{os.getpid()}-"))


@contextlib.contextmanager
def scratch_dir(kind: str) -> Iterator[Path]:
    """:func:`make_scratch_dir`, removed when the block ends."""
    folder = make_scratch_dir(kind)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
