"""Child processes and scratch folders that do not outlive the call that made them.

A stage runs pytest in a child process (which may fork distributed workers) and keeps
its report in a temporary folder. :func:`run_child` starts the child in its own process
group, asks the kernel to kill it when this process dies (``PR_SET_PDEATHSIG``, Linux),
kills the whole group on any exception (Ctrl-C, SIGTERM turned into ``SystemExit`` by
the CLI, a timeout) and when the running call is cancelled. :func:`scratch_dir` names
its folders after the process that made them and removes, first, those of processes
that are gone (a SIGKILL runs no cleanup).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from skill.codemod.workspace import check_cancelled

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2


def _die_with_parent_hook():
    """A ``preexec_fn`` that makes the child receive SIGKILL when its parent dies, or None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        prctl = ctypes.CDLL(name, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_child(
    command: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to completion, capturing text output; it dies with this process and call.

    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds and
    :class:`~skill.codemod.workspace.CallCancelledError` when the call is cancelled, having
    killed the child's whole process group either way.
    """
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=dict(env),
            stdout=out,
            stderr=err,
            text=True,
            process_group=0,
            # Runs between fork and exec; it makes one prctl call and touches no lock, so the
            # usual hazard of preexec_fn in a threaded parent does not apply.
            preexec_fn=_die_with_parent_hook(),
        )
        try:
            while process.poll() is None:
                check_cancelled()
                if time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(list(command), timeout)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(_POLL_S)
        except BaseException as e:
            logger.info("stopping %s (%s)", command[2] if len(command) > 2 else command[0], type(e).__name__)
            _kill_group(process)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(command), process.returncode, out.read(), err.read())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_scratch(prefix: str, root: Path | None = None) -> list[Path]:
    """Remove the scratch folders ``<prefix>-<pid>-*`` whose process is gone; returns them."""
    base = Path(root or tempfile.gettempdir())
    removed: list[Path] = []
    for folder in base.glob(f"{prefix}-*-*"):
        pid_text = folder.name[len(prefix) + 1 :].split("-", 1)[0]
        if folder.is_dir() and pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        logger.info("removed %d scratch folder(s) left by killed processes", len(removed))
    return removed


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder ``<prefix>-<pid>-*``, removed on exit; stale ones of dead processes go first."""
    sweep_stale_scratch(prefix)
    with tempfile.TemporaryDirectory(prefix=f"{prefix}-{os.getpid()}-") as folder:
        yield Path(folder)


__all__ = ["run_child", "scratch_dir", "sweep_stale_scratch"]
