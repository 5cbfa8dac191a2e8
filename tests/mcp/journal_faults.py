"""Child process of the kill-mid-write test: the engine imported once, then one fork per kill point.

``python -m tests.mcp.journal_faults WORKDIR`` makes, for each K, a workspace ``WORKDIR/k<K>``
(:func:`make_workspace`) and in a forked child stages a new package ``newpkg`` with its
registry import line and rewrites two files of the registered package ``oldpkg`` (whose spec
refuses to import when they disagree), then commits. Every file operation the commit makes
(open, write, replace, rename, unlink, mkdir, rmdir, fsync) is counted; the K-th sends SIGKILL
to the child instead of running. ``k0`` never kills and is committed to the end first, which
counts the operations N; then K = 1..N. A fresh interpreter per kill point took 0.4 s to import
the workspace module (pydantic), 19 s over the 48 points; a fork takes milliseconds, and each
child is still a process killed in the middle of its commit. Prints one JSON line:
``{"operations": N, "killed": [K, ...]}`` (the K whose child died of SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from skill.codemod.workspace import StagedTree, Workspace

OPERATIONS = ("open", "write", "replace", "rename", "unlink", "mkdir", "rmdir", "fsync")

REGISTRY_LINE = "from archon_models.newpkg import spec as newpkg_spec  # noqa: F401"


def make_workspace(root: str) -> None:
    """A minimal project: a registry importing ``oldpkg`` at version 1."""
    files = {
        "archon_models/__init__.py": (
            '"""registry"""\n\nfrom archon_models.oldpkg import spec as oldpkg_spec  # noqa: F401\n'
        ),
        "archon_models/oldpkg/__init__.py": "",
        "archon_models/oldpkg/spec.py": (
            "from archon_models.oldpkg.layers import LAYERS_VERSION\n"
            "from archon_models.oldpkg.model import VERSION\n\n"
            "assert VERSION == LAYERS_VERSION, 'half-written package'\n"
        ),
        "archon_models/oldpkg/model.py": "VERSION = 1\n",
        "archon_models/oldpkg/layers.py": "LAYERS_VERSION = 1\n",
        "archon_models/oldpkg/legacy.py": "OLD = True\n",
    }
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def stage(tree: StagedTree) -> None:
    tree.write_text("archon_models/newpkg/__init__.py", "")
    tree.write_text("archon_models/newpkg/model/__init__.py", "")
    tree.write_text("archon_models/newpkg/model/model.py", "NAME = 'newpkg'\n")
    tree.write_text("archon_models/newpkg/spec.py", "from archon_models.newpkg.model.model import NAME  # noqa: F401\n")
    tree.write_text("archon_models/oldpkg/model.py", "VERSION = 2\n")
    tree.write_text("archon_models/oldpkg/layers.py", "LAYERS_VERSION = 2\n")
    tree.delete("archon_models/oldpkg/legacy.py")
    tree.update_text("archon_models/__init__.py", lambda text: text + REGISTRY_LINE + "\n")


def _commit_counting(root: str, kill_at: int, count_file: Path | None) -> None:
    """In a forked child: the commit with every file operation counted; never returns."""
    tree = StagedTree(Workspace(root))
    stage(tree)
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
        tree.commit()
    except BaseException as e:  # reported through the exit status
        sys.stderr.write(f"commit failed: {e!r}\n")
        code = 1
    if count_file is not None:
        fd = real_open(count_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        real_write(fd, str(count).encode())
    os._exit(code)


def _run(root: Path, kill_at: int, count_file: Path | None = None) -> int:
    make_workspace(str(root))
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _commit_counting(str(root), kill_at, count_file)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(workdir: Path) -> int:
    count_file = workdir / "operations"
    if _run(workdir / "k0", 0, count_file) != 0:
        return 1
    operations = int(count_file.read_text())
    killed = [k for k in range(1, operations + 1) if _run(workdir / f"k{k}", k) == -signal.SIGKILL]
    sys.stdout.write(json.dumps({"operations": operations, "killed": killed}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
