"""A stand-in AReaL tree and a toy package for the tests of export's mechanics (no torch, no AReaL).

The fake ``areal/experimental/models/archon/`` holds a registry (``__init__.py``) and a
``model_spec.py`` with a ``SPECS`` dict; the toy package ``toyfam`` registers itself there
from its ``spec.py``, which refuses to import when its two model files disagree, so a
half-written package shows as a failing ``import areal.experimental.models.archon``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ARCHON = "areal/experimental/models/archon"
TOY = "toyfam"
TOY_LINE = f"from areal.experimental.models.archon.{TOY} import spec as {TOY}_spec  # noqa: F401"

_TOY_SPEC = f'''"""The {TOY} spec: registers itself; refuses to import when its files disagree."""

from archon_models.model_spec import SPECS
from archon_models.{TOY}.model.layers import LAYERS_VERSION
from archon_models.{TOY}.model.model import VERSION

assert VERSION == LAYERS_VERSION, "half-written package"
SPECS["{TOY}"] = dict(name="{TOY}", supported_model_types=frozenset({{"{TOY}"}}))
'''


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def make_fake_areal(root: Path) -> Path:
    """An AReaL-shaped tree at ``root`` (the directory holding ``areal/``); returns ``root``."""
    _write(
        root,
        {
            "areal/__init__.py": "",
            "areal/experimental/__init__.py": "",
            "areal/experimental/models/__init__.py": "",
            f"{ARCHON}/__init__.py": (
                '"""The fake AReaL registry."""\n\n'
                "from areal.experimental.models.archon.model_spec import SPECS  # noqa: F401\n"
            ),
            f"{ARCHON}/model_spec.py": "SPECS: dict = {}\n",
        },
    )
    return root


def make_toy_project(root: Path, version: int = 1) -> Path:
    """A project root whose ``archon_models/{TOY}/`` is at ``version`` (1: with legacy.py, 2: with extra.py)."""
    package = f"archon_models/{TOY}"
    files = {
        "archon_models/__init__.py": "",
        f"{package}/__init__.py": "",
        f"{package}/spec.py": _TOY_SPEC,
        f"{package}/model/__init__.py": "",
        f"{package}/model/model.py": f"VERSION = {version}\n",
        f"{package}/model/layers.py": f"LAYERS_VERSION = {version}\n",
    }
    files[f"{package}/model/{'legacy' if version == 1 else 'extra'}.py"] = f"KIND = {version}\n"
    for stale in ("legacy", "extra"):
        (root / package / "model" / f"{stale}.py").unlink(missing_ok=True)
    _write(root, files)
    return root


def imports(areal_root: Path) -> subprocess.CompletedProcess[str]:
    """``import areal.experimental.models.archon`` in a fresh interpreter over ``areal_root``."""
    return subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(areal_root)!r}); {_IMPORT_CHECK}"],
        cwd=areal_root,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )


_IMPORT_CHECK = "import areal.experimental.models.archon as a; print(sorted(a.SPECS))"
