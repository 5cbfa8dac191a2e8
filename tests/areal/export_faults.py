"""Child process of the kill-mid-export test: the engine imported once, then one fork per kill point.

``python -m tests.areal.export_faults PROJECT TEMPLATE WORKDIR`` exports PROJECT's toy
package (``overwrite=True``, no checks) into copies of the AReaL tree TEMPLATE. The first
copy, ``WORKDIR/k0``, is exported to the end while every file operation the export makes
(open, write, replace, rename, unlink, mkdir, rmdir, fsync) is counted; then for each
K = 1..N a forked child exports into ``WORKDIR/k<K>`` and SIGKILLs itself at the K-th
operation instead of running it. Importing the engine takes seconds (it pulls in torch), a
fork milliseconds. Prints one JSON line: ``{"operations": N, "killed": [K, ...]}``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

from skill.areal.export import ExportRequest, export_to_areal

OPERATIONS = ("open", "write", "replace", "rename", "unlink", "mkdir", "rmdir", "fsync")


def _export_counting(project: Path, areal_root: Path, kill_at: int, count_file: Path | None) -> None:
    """In a forked child: the export with every file operation counted; never returns."""
    count = 0

    def counted(real):
        def operation(*args, **kwargs):
            nonlocal count
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return operation

    real_write, real_open = os.write, os.open
    for name in OPERATIONS:
        setattr(os, name, counted(getattr(os, name)))
    code = 0
    try:
        export_to_areal(
            ExportRequest(model_name="toyfam", areal=areal_root, workspace=project, overwrite=True, run_checks=False)
        )
    except BaseException as e:  # reported through the exit status
        sys.stderr.write(f"export failed: {e!r}\n")
        code = 1
    if count_file is not None:
        fd = real_open(count_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        real_write(fd, str(count).encode())
    os._exit(code)


def _run(project: Path, template: Path, target: Path, kill_at: int, count_file: Path | None = None) -> int:
    shutil.copytree(template, target)
    pid = os.fork()
    if pid == 0:
        _export_counting(project, target, kill_at, count_file)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(project: Path, template: Path, workdir: Path) -> int:
    count_file = workdir / "operations"
    if _run(project, template, workdir / "k0", 0, count_file) != 0:
        return 1
    operations = int(count_file.read_text())
    killed = [k for k in range(1, operations + 1) if _run(project, template, workdir / f"k{k}", k) == -signal.SIGKILL]
    sys.stdout.write(json.dumps({"operations": operations, "killed": killed}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
