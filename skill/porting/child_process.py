"""Child processes and scratch folders that do not outlive the call that made them.

A stage runs pytest in a child process (which may fork distributed workers) and keeps
its report in a temporary folder. :func:`run_child` starts the child in its own process
group, asks the kernel to kill it when this process dies (``PR_SET_PDEATHSIG``, Linux),
kills the whole group on any exception (Ctrl-C, SIGTERM turned into ``SystemExit`` by
the CLI, a timeout) and when the running call is cancelled. :func:`scratch_dir`
(:mod:`skill.scratch`) names its folders after the process that made them and removes,
first, those of processes that are gone (a SIGKILL runs no cleanup).

:func:`run_python_module` runs ``python -m <module>`` the same way, but forks the child
from a warm interpreter (:mod:`skill.porting.zygote`) that has torch, transformers and
pytest imported already and nothing of the engine or the models: a child still imports
the workspace's ``archon_models`` afresh, and starts in a fraction of a second instead of
six. ``ARCHON_PORT_WARM_CHILDREN=0`` turns it off (every run then execs a new interpreter).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from skill.codemod.workspace import check_cancelled
from skill.porting.zygote import die_with_parent_hook, kill_group, send_request
from skill.scratch import scratch_dir, sweep_stale_scratch

logger = logging.getLogger(__name__)

_POLL_S = 0.2
WARM_CHILDREN_ENV = "ARCHON_PORT_WARM_CHILDREN"
_ZYGOTE_FILE = Path(__file__).with_name("zygote.py")
# How long a killed child's exit may take to be reported before the call gives up on it.
_REAP_WAIT_S = 10.0


def _kill_group(process: subprocess.Popen) -> None:
    kill_group(process.pid)
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
            preexec_fn=die_with_parent_hook(),
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


def run_python_module(
    module: str, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m module *argv`` in ``cwd`` with ``env`` (its ``PYTHONPATH`` included), as
    :func:`run_child` runs it: own process group, killed on timeout, exception or cancel."""
    command = [sys.executable, "-m", module, *argv]
    if not _warm_children_on():
        return run_child(command, cwd=cwd, env=env, timeout=timeout)
    try:
        return _run_warm(module, argv, command, cwd=cwd, env=env, timeout=timeout)
    except WarmInterpreterError as e:
        # Nothing ran: the run is started afresh, as with warm children off.
        logger.warning("%s; running %s in a new interpreter instead", e, module)
        return run_child(command, cwd=cwd, env=env, timeout=timeout)


def _run_warm(
    module: str, argv: Sequence[str], command: list[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    request = {"module": module, "argv": list(argv), "cwd": str(Path(cwd).resolve()), "env": dict(env)}
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        status = _ZYGOTE.start(request, out.fileno(), err.fileno())
        with os.fdopen(status, "rb", buffering=0) as pipe:
            reader = _StatusReader(pipe)
            pid: int | None = None
            try:
                pid = reader.number("pid", deadline=deadline, command=command, timeout=timeout)
                returncode = reader.number("rc", deadline=deadline, command=command, timeout=timeout)
                if reader.server_lost:
                    # The warm interpreter died under the run: its child died with it
                    # (PR_SET_PDEATHSIG), what the child started did not; it is in the group.
                    logger.warning("the warm interpreter stopped during a run of %s; killing what it left", module)
                    kill_group(pid)
            except BaseException as e:
                logger.info("stopping %s (%s)", module, type(e).__name__)
                if pid is None:
                    # Told already, but not read yet? Otherwise the server is still starting:
                    # it finds this pipe closed when it starts the child, and kills it.
                    pid = reader.ready_number("pid")
                if pid is not None:
                    kill_group(pid)
                    with contextlib.suppress(Exception):
                        reader.number("rc", deadline=time.monotonic() + _REAP_WAIT_S)
                raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, returncode, out.read(), err.read())


class WarmInterpreterError(RuntimeError):
    """The warm interpreter ended before it started a run (the run itself never began)."""


def _warm_children_on() -> bool:
    return os.environ.get(WARM_CHILDREN_ENV, "1") != "0" and hasattr(socket, "send_fds")


def warm_up() -> None:
    """Start the warm interpreter now, so its imports overlap the caller's own work (the
    analysis that precedes a port's first child). Returns at once; a no-op when warm
    children are off or it runs already."""
    if _warm_children_on():
        _ZYGOTE.ensure_running()


class _StatusReader:
    """Reads the zygote's ``pid <n>`` / ``rc <n>`` lines for one child."""

    def __init__(self, pipe: Any):
        self.pipe = pipe
        self.buffer = b""
        self.server_lost = False  # the pipe ended before the run's ``rc``: the zygote died

    def number(self, key: str, *, deadline: float, command: Sequence[str] = (), timeout: float = 0.0) -> int:
        while b"\n" not in self.buffer:
            check_cancelled()
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(list(command), timeout)
            ready, _, _ = select.select([self.pipe], [], [], _POLL_S)
            if ready:
                chunk = self.pipe.read(4096)
                if not chunk:
                    if key == "rc":  # the zygote died with the child unreported
                        self.server_lost = True
                        return -signal.SIGKILL
                    raise WarmInterpreterError("the warm interpreter stopped before starting the child")
                self.buffer += chunk
        return self._take(key)

    def ready_number(self, key: str) -> int | None:
        """The ``key`` line if it has been written already (never waits), else None."""
        with contextlib.suppress(OSError, ValueError):
            while b"\n" not in self.buffer and select.select([self.pipe], [], [], 0)[0]:
                chunk = self.pipe.read(4096)
                if not chunk:
                    break
                self.buffer += chunk
        if b"\n" not in self.buffer:
            return None
        try:
            return self._take(key)
        except (RuntimeError, ValueError):
            return None

    def _take(self, key: str) -> int:
        line, self.buffer = self.buffer.split(b"\n", 1)
        name, _, value = line.decode().partition(" ")
        if name != key:
            raise RuntimeError(f"the warm interpreter said {line.decode()!r}, expected {key!r}")
        return int(value)


class _Zygote:
    """One warm interpreter per process, started on first use and again if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._pid = -1

    def start(self, request: dict[str, Any], out_fd: int, err_fd: int) -> int:
        """Send one run; returns the read end of its status pipe."""
        read_fd, write_fd = os.pipe()
        try:
            with self._lock:
                for attempt in (1, 2):
                    control = self._ensure_running()
                    try:
                        send_request(control, request, [write_fd, out_fd, err_fd])
                        break
                    except OSError:
                        self._stop()
                        if attempt == 2:
                            raise
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return read_fd

    def ensure_running(self) -> None:
        with self._lock:
            self._ensure_running()

    def _ensure_running(self) -> socket.socket:
        # A forked copy of this process (a stage-5 worker) must start its own.
        if self._process is not None and self._pid == os.getpid() and self._process.poll() is None:
            assert self._socket is not None
            return self._socket
        self._process = None
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        code = f"import runpy; runpy.run_path({str(_ZYGOTE_FILE)!r}, run_name='__main__')"
        self._process = subprocess.Popen(
            [sys.executable, "-c", code, str(child_end.fileno())],
            cwd=tempfile.gettempdir(),
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(child_end.fileno(),),
            process_group=0,
        )
        child_end.close()
        self._socket = parent_end
        self._pid = os.getpid()
        logger.debug("started the warm interpreter (pid %d)", self._process.pid)
        return parent_end

    def _stop(self) -> None:
        if self._socket is not None:
            self._socket.close()
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            self._process.wait()
        self._process = None
        self._socket = None


_ZYGOTE = _Zygote()


__all__ = ["run_child", "run_python_module", "scratch_dir", "sweep_stale_scratch", "warm_up"]
