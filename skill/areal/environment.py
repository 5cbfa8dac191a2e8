"""Cached virtual environments next to this interpreter's packages: one holding a real
AReaL (``.venv-areal/``), one holding the oldest transformers this project accepts
(``.venv-tf53/``, no AReaL), in which CI runs stages 1-4 of every committed family, one
holding the newest transformers on the registry when this was last checked
(``.venv-tf-newest/``, no AReaL), and one holding AReaL with the torch and transformers its
own pins allow (``.venv-areal-torch210/``: torch 2.10.0, transformers 5.3.0), in which CI runs
stages 1-4 and the AReaL tier.

AReaL's wheel pins ``torch<2.11`` and ``transformers<=5.3.0``; installing it with its
dependencies would replace the CPU torch this project runs on. So the environment is
built as AReaL's own users on such a machine would build it: ``areal`` with
``--no-deps``, then the handful of packages its import chain actually needs, next to the
torch and transformers this interpreter already has. The venv sees this interpreter's
site-packages through a ``.pth`` file (its own packages come first), so torch is never
copied or re-resolved. A stamp file records what was installed; a venv whose stamp
matches is reused, any other is rebuilt. A file lock keeps two test workers from
building it at once. The transformers venv is built the same way, with no ``areal`` and
no AReaL requirements: only ``transformers==<version>`` (and what pip needs to satisfy its
pins) lands in the venv, everything else comes from this interpreter.

A venv pinned to another torch (``--torch``) gets that torch in the venv itself. PyPI's torch
2.10.0 for Linux is a CUDA build: it imports only with the ``nvidia-*`` libraries it names
(measured: installed with ``--no-deps`` it fails on ``libcudart.so.12``), and with them it runs
on a machine without a GPU. Measured here: ``.venv-areal-torch210/`` is 6.9 GB (torch, the
nvidia libraries, triton, transformers 5.3.0) and takes about 4 minutes to build from PyPI.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

AREAL_VERSION = "1.0.4"

# What AReaL 1.0.4 imports on the way to areal.experimental.models.archon and its engine,
# measured by installing it with --no-deps and importing until nothing was missing.
AREAL_RUNTIME_REQUIREMENTS: tuple[str, ...] = (
    "aiohttp",
    "httpx",
    "colorlog",
    "tenacity",
    "flask",
    "torchdata",
    "lark",
    "uvloop",
    "hydra-core==1.4.0.dev1",
    "ray",
    "numba",
    "pillow",
    "orjson",
    "einops",
    "aiofiles",
    "openai",
    "triton",
)

DEFAULT_VENV_DIR = ".venv-areal"
# The newest torch AReaL 1.0.4 allows (its pins: torch>=2.9.1,<2.11), and the venv holding it.
AREAL_TORCH = "2.10.0"
DEFAULT_AREAL_TORCH_VENV_DIR = ".venv-areal-torch210"
# The oldest transformers pyproject.toml accepts (AReaL 1.0.4's newest allowed), and its venv.
OLDEST_TRANSFORMERS = "5.3.0"
DEFAULT_TF_VENV_DIR = ".venv-tf53"
# The newest transformers on the registry (`pip index versions transformers`, 2026-12-04),
# and its venv. Families only it knows are analysed and ported there (bench/analyze_all.py,
# bench/port_all.py); move the pin when a newer one appears.
NEWEST_TRANSFORMERS = "5.25.0"
NEWEST_TF_VENV_DIR = ".venv-tf-newest"
_STAMP = "archon-port-env.json"
_BRIDGE_PTH = "_archon_port_parent_site.pth"


class AReaLEnvSpec(BaseModel):
    """Everything that decides the content of the environment; its stamp."""

    model_config = ConfigDict(frozen=True)

    # None: a venv without AReaL (only the pinned torch and transformers).
    areal_version: str | None = AREAL_VERSION
    requirements: tuple[str, ...] = AREAL_RUNTIME_REQUIREMENTS
    # Pinned exactly, always: a range would let pip pick a CUDA build.
    torch: str
    transformers: str
    parent_site: tuple[str, ...]
    python: str


def installed_version(dist: str) -> str:
    return metadata.version(dist)


def _torch_pin(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: the local label is not part of a requirement pin."""
    return version.split("+", 1)[0]


def default_spec(transformers_version: str | None = None, torch_version: str | None = None) -> AReaLEnvSpec:
    """The spec for this interpreter: its torch and its transformers, unless told others."""
    parent = [*site.getsitepackages()]
    for extra in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]):
        if extra not in parent:
            parent.append(extra)
    return AReaLEnvSpec(
        torch=_torch_pin(torch_version or installed_version("torch")),
        transformers=transformers_version or installed_version("transformers"),
        parent_site=tuple(p for p in parent if Path(p).is_dir()),
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
    )


def transformers_spec(transformers_version: str = OLDEST_TRANSFORMERS) -> AReaLEnvSpec:
    """A venv with no AReaL: this interpreter's packages with ``transformers`` pinned."""
    return default_spec(transformers_version).model_copy(update={"areal_version": None, "requirements": ()})


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def _read_stamp(venv: Path) -> AReaLEnvSpec | None:
    stamp = venv / _STAMP
    if not stamp.is_file() or not venv_python(venv).is_file():
        return None
    try:
        return AReaLEnvSpec.model_validate_json(stamp.read_text())
    except ValueError:
        return None


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args]
    logger.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True)


def _build(venv: Path, spec: AReaLEnvSpec) -> None:
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv_python(venv)
    # This interpreter's packages (torch above all) become visible to the venv, after the
    # venv's own; addsitedir also processes their .pth files.
    bridge = "".join(f"import site; site.addsitedir({p!r})\n" for p in spec.parent_site)
    (_site_packages(python) / _BRIDGE_PTH).write_text(bridge)
    if spec.areal_version is not None:
        _pip(python, "--no-deps", f"areal=={spec.areal_version}")
    _pip(python, f"torch=={spec.torch}", f"transformers=={spec.transformers}", *spec.requirements)
    (venv / _STAMP).write_text(spec.model_dump_json(indent=2) + "\n")


def ensure_areal_env(venv: str | os.PathLike, spec: AReaLEnvSpec | None = None) -> Path:
    """The python of a venv at ``venv`` built to ``spec`` (default: AReaL next to this
    interpreter's torch and transformers); built (or rebuilt) when its stamp differs."""
    venv = Path(venv).resolve()
    spec = spec or default_spec()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_stamp(venv) != spec:
            what = f"AReaL {spec.areal_version}" if spec.areal_version else f"transformers {spec.transformers}"
            logger.info("building the %s environment in %s", what, venv)
            _build(venv, spec)
        else:
            logger.debug("reusing the AReaL environment in %s", venv)
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Create or reuse a cached venv: AReaL (default), or with --no-areal only a pinned "
        f"transformers (e.g. `{DEFAULT_TF_VENV_DIR} --no-areal --transformers {OLDEST_TRANSFORMERS}`, "
        f"`{NEWEST_TF_VENV_DIR} --no-areal --transformers {NEWEST_TRANSFORMERS}`), "
        f"or AReaL on its own pins (`{DEFAULT_AREAL_TORCH_VENV_DIR} --torch {AREAL_TORCH} "
        f"--transformers {OLDEST_TRANSFORMERS}`); prints its python."
    )
    parser.add_argument("venv", nargs="?", default=DEFAULT_VENV_DIR)
    parser.add_argument("--transformers", help="pin this transformers version in the venv")
    parser.add_argument("--torch", help="pin this torch version in the venv (default: this interpreter's)")
    parser.add_argument("--no-areal", action="store_true", help="no AReaL, no AReaL requirements")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.no_areal:
        spec = transformers_spec(args.transformers or OLDEST_TRANSFORMERS)
        if args.torch:
            spec = spec.model_copy(update={"torch": _torch_pin(args.torch)})
    else:
        spec = default_spec(args.transformers, args.torch)
    python = ensure_areal_env(args.venv, spec)
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
