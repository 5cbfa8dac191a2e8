"""Start ``skill.areal.checks`` in an AReaL Python that imports this engine, and only ``areal`` from the tree.

``python -I isolated.py <engine root> <areal root> <arguments of skill.areal.checks>``.
``-I`` keeps ``PYTHONPATH``, the user site-packages and the working directory off
``sys.path``; this script then puts the engine's checkout first and makes the package
``areal`` importable from the AReaL tree, and nothing else from it: a module planted next
to ``areal/`` there (a ``skill/areal/checks.py``, a ``torch/``) is never imported, and the
caller runs it from a neutral working directory. Forked workers of the checks inherit
both. Only the standard library is imported here (it runs before ``sys.path`` is set).
"""

from __future__ import annotations

import importlib.machinery
import runpy
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

CHECKS_MODULE = "skill.areal.checks"


class AReaLOnlyFinder:
    """A meta path finder that finds the top-level package ``areal`` in one tree, and nothing else."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name != "areal":
            return None
        return importlib.machinery.PathFinder.find_spec(name, [self.root])


def main(argv: list[str]) -> None:
    engine_root, areal_root, *arguments = argv
    sys.path.insert(0, engine_root)
    sys.meta_path.insert(0, AReaLOnlyFinder(areal_root))
    sys.argv = [CHECKS_MODULE, *arguments]
    runpy.run_module(CHECKS_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
