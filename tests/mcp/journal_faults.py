"""Child process of the kill-mid-write test: commit one transaction, SIGKILL itself at the k-th file operation.

``python -m tests.mcp.journal_faults WORKSPACE K`` stages a new package ``newpkg`` with
its registry import line and rewrites two files of the registered package ``oldpkg``
(whose spec refuses to import when they disagree), then commits. Every file operation
the commit makes (open, write, replace, rename, unlink, mkdir, rmdir, fsync) is counted;
the K-th sends SIGKILL to the process instead of running. K=0 never kills. The child
prints the number of operations it made when it finishes.
"""

from __future__ import annotations

import os
import signal
import sys

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


def main(root: str, kill_at: int) -> int:
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

    for name in OPERATIONS:
        setattr(os, name, counted(getattr(os, name)))
    tree.commit()
    sys.stdout.write(f"{count}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
