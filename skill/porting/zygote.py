"""A warm Python interpreter that forks fresh children for ``python -m <module>`` runs.

A stage run or a TP-plan trace starts a new interpreter so the workspace's
``archon_models`` is imported as it is on disk, never a copy this process imported
earlier. Most of such a child's time is spent importing torch, transformers and pytest
(about 6 s of a 7 s TP-plan trace). This server imports them once and forks a child per
run; the child then imports everything else (``archon_models``, ``skill``, the tests)
afresh from the paths the run names, as a new interpreter would.

It is started by :mod:`skill.porting.child_process` with ``runpy.run_path`` (not as a
module of ``skill``: it must never import the engine or the models) and speaks over one
Unix stream socket. Each request is a frame: an 8-byte big-endian length, sent with three
file descriptors (the status pipe's write end, and the files the child's stdout and stderr
go to), then that many bytes of JSON (:func:`send_request`, :func:`receive_request`); a
request has no size limit (a 40 KB environment variable travels like a small one). The
server forks; the child starts its own session (the caller kills its whole process group),
asks for SIGKILL when the server dies, and runs the module. The server writes ``pid <n>``
to the request's status pipe at once and ``rc <n>`` when it has reaped the child
(``-<signal>`` for a child killed by a signal), then closes it. A caller that gave up before
its child started has closed the pipe's read end: the ``pid`` write fails and the child is
killed. When the caller's end of the socket closes (the caller exited or was killed), the
server kills its children's process groups and exits; while it is still importing torch
and the rest, a watcher thread notices that at once and ends it. (It does not ask for
``PR_SET_PDEATHSIG`` itself: that signal follows the *thread* that started it, and a
tool call's worker thread may end while another call's child still runs.) A server
killed outright takes its children along (their ``PR_SET_PDEATHSIG``); what those started
is in their process group, which the caller kills when the status pipe ends without ``rc``.

Only the standard library is imported at module level.

Why not ``multiprocessing``'s forkserver with a preload list (measured 2026-12-04 on the 2-core
machine at load 13-21): it starts a warm child as fast as this server does (0.3-1.0 s against
0.3 s; a new interpreter took 26-32 s at that load), and one ``add llama`` run through a
prototype of it took 113 s (its server started at the first run, not during the analysis as
this one does) against 74 s here and 186 s with new interpreters. But it does not give a run
what a run needs: its child first runs spawn's preparation, which imports the caller's
``__main__`` (``skill.cli``: the engine, from the caller's path, before the workspace's) and
then runs a target pickled by reference, which must itself be importable there; the child
inherits the server's environment and working directory, not the run's; and nothing kills a
child, or what it forked, when the caller dies (no death signal, no process group). The status
pipe, the group kill and the death handling above would stay; only the fork-per-request loop
would go.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

# What a child would import first, in the order a stage run does. A module that fails to
# import is skipped: the child then imports it itself (and reports the error there).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "torch.distributed", "pytest")
_PR_SET_PDEATHSIG = 1
_REAP_INTERVAL_S = 0.05
_MAX_FDS = 3
_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 16


def send_request(control: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """Send one request frame: its length with ``fds``, then its JSON, whatever its size."""
    data = json.dumps(request).encode()
    socket.send_fds(control, [_HEADER.pack(len(data))], fds)
    control.sendall(data)


def _receive_exactly(control: socket.socket, size: int, start: bytes = b"") -> bytes | None:
    """``size`` bytes from ``control`` (``start`` already read); None when it closes first."""
    parts, have = [start], len(start)
    while have < size:
        chunk = control.recv(min(size - have, _CHUNK))
        if not chunk:
            return None
        parts.append(chunk)
        have += len(chunk)
    return b"".join(parts)


class Frame(NamedTuple):
    """What :func:`receive_request` read: the request (None: the caller closed the socket, or
    ``error`` says why it cannot be read) and the file descriptors that came with it."""

    request: dict[str, Any] | None
    fds: list[int]
    error: str | None = None


def receive_request(control: socket.socket) -> Frame:
    """One request frame and its file descriptors."""
    try:
        head, fds, _, _ = socket.recv_fds(control, _HEADER.size, _MAX_FDS)
    except OSError:
        return Frame(None, [])
    if not head:
        return Frame(None, fds)
    header = _receive_exactly(control, _HEADER.size, head)
    body = None if header is None else _receive_exactly(control, _HEADER.unpack(header)[0])
    if body is None:
        return Frame(None, fds)
    try:
        request = json.loads(body)
    except ValueError as e:  # a caller of another version, a corrupted frame
        return Frame(None, fds, f"unreadable request ({e})")
    if len(fds) != _MAX_FDS:
        return Frame(None, fds, f"{len(fds)} file descriptors came with the request, not {_MAX_FDS}")
    return Frame(request, fds)


def die_with_parent_hook() -> Callable[[], None] | None:
    """A function that makes the calling process receive SIGKILL when its parent dies
    (``PR_SET_PDEATHSIG``, Linux), or None where libc's ``prctl`` cannot be found. Here, in
    this standard-library-only module, for both the forked children below and the
    ``preexec_fn`` of :func:`skill.porting.child_process.run_child`."""
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


def _run_child(request: dict[str, Any], base_path: list[str]) -> int:
    """In the forked child: become the interpreter ``python -m module *argv`` would be."""
    os.setsid()
    die_with_parent = die_with_parent_hook()
    if die_with_parent is not None:
        die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    cwd = request["cwd"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(request["env"])
    # python -m puts the working directory first, then PYTHONPATH, then the site paths.
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *base_path]
    threads = request["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.argv = [request["module"], *request["argv"]]
    code: Any = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    return code


def _child_main(request: dict[str, Any], base_path: list[str], out_fd: int, err_fd: int) -> None:
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    code = 1
    try:
        code = _run_child(request, base_path)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting either way
                stream.flush()
        os._exit(code & 0xFF)


def _write(fd: int, text: str) -> bool:
    """Write ``text`` to a status pipe; False when the caller stopped listening."""
    try:
        os.write(fd, text.encode())
    except OSError:  # EPIPE: the caller closed its end (Python ignores SIGPIPE)
        return False
    return True


def kill_group(pid: int) -> None:
    """SIGKILL the child and its process group (the group exists once the child ran setsid)."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


def _exit_when_the_caller_goes(control: socket.socket, done: threading.Event) -> None:
    """Until ``done``: end this process the moment the caller's end of ``control`` closes.

    Watches for the hang-up without reading, so a request the caller sent meanwhile stays
    queued for the server loop. (Nothing to clean up yet: no child was forked.)
    """
    poller = select.poll()
    poller.register(control.fileno(), select.POLLRDHUP)
    while not done.is_set():
        for _, events in poller.poll(int(_REAP_INTERVAL_S * 1000)):
            if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                os._exit(0)


def _preload(control: socket.socket) -> None:
    """Import :data:`PRELOAD` (seconds), ending at once if the caller dies meanwhile."""
    done = threading.Event()
    watcher = None
    if hasattr(select, "POLLRDHUP"):
        watcher = threading.Thread(target=_exit_when_the_caller_goes, args=(control, done), daemon=True)
        watcher.start()
    try:
        for name in PRELOAD:
            with contextlib.suppress(Exception):  # the child imports it again and reports
                __import__(name)
    finally:
        done.set()
        if watcher is not None:
            watcher.join()  # no thread of ours may run across the forks to come


def _refuse(fds: list[int], why: str) -> None:
    """A request that cannot run: one line on stderr; closing its status pipe tells the caller."""
    sys.stderr.write(f"archon-port warm interpreter: {why}; the request is dropped\n")
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def serve(control: socket.socket) -> None:
    _preload(control)
    base_path = [p for p in sys.path if p and p != os.getcwd()]
    children: dict[int, int] = {}  # pid -> status fd
    open_ = True
    while open_ or children:
        if open_:
            ready, _, _ = select.select([control], [], [], _REAP_INTERVAL_S)
        else:
            ready = []
            select.select([], [], [], _REAP_INTERVAL_S)
        if ready:
            request, fds, error = receive_request(control)
            if error is not None:
                _refuse(fds, error)
                continue
            if request is None:
                open_ = False
                for fd in fds:
                    os.close(fd)
                # The caller is gone: its runs are of no use to anybody.
                for pid in children:
                    kill_group(pid)
                continue
            status_fd, out_fd, err_fd = fds
            pid = os.fork()
            if pid == 0:
                control.close()
                os.close(status_fd)
                for fd in children.values():
                    os.close(fd)
                _child_main(request, base_path, out_fd, err_fd)
            os.close(out_fd)
            os.close(err_fd)
            children[pid] = status_fd
            if not _write(status_fd, f"pid {pid}\n"):
                # The caller gave up (a timeout or a cancel) before this run started,
                # while this server was still importing: nobody would ever stop the child.
                kill_group(pid)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise
            if pid == 0:
                break
            if pid in children:
                fd = children.pop(pid)
                _write(fd, f"rc {os.waitstatus_to_exitcode(status)}\n")
                os.close(fd)


def main() -> None:
    fd = int(sys.argv[-1])
    serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main()
