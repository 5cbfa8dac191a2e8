"""A cached virtual environment holding a real AReaL next to this interpreter's packages.

AReaL's wheel pins ``torch<2.11`` and ``transformers<=5.3.0``; installing it with its
dependencies would replace the CPU torch this project runs on. So the environment is
built as AReaL's own users on such a machine would build it: ``areal`` with
``--no-deps``, then the handful of packages its import chain actually needs, next to the
torch and transformers this interpreter already has. The venv sees this interpreter's
site-packages through a ``.pth`` file (its own packages come first), so torch is never
copied or re-resolved. A stamp file records what was installed; a venv whose stamp
matches is reused, any other is rebuilt. A file lock keeps two test workers from
building it at once.
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
_STAMP = "archon-port-env.json"
_BRIDGE_PTH = "_archon_port_parent_site.pth"


class AReaLEnvSpec(BaseModel):
    """Everything that decides the content of the environment; its stamp."""

    model_config = ConfigDict(frozen=True)

    areal_version: str = AREAL_VERSION
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


def default_spec(transformers_version: str | None = None) -> AReaLEnvSpec:
    """The spec for this interpreter: its torch, and its transformers unless told another."""
    parent = [*site.getsitepackages()]
    for extra in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]):
        if extra not in parent:
            parent.append(extra)
    return AReaLEnvSpec(
        torch=_torch_pin(installed_version("torch")),
        transformers=transformers_version or installed_version("transformers"),
        parent_site=tuple(p for p in parent if Path(p).is_dir()),
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
    )


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
    _pip(python, "--no-deps", f"areal=={spec.areal_version}")
    _pip(python, f"torch=={spec.torch}", f"transformers=={spec.transformers}", *spec.requirements)
    (venv / _STAMP).write_text(spec.model_dump_json(indent=2) + "\n")


def ensure_areal_env(venv: str | os.PathLike, spec: AReaLEnvSpec | None = None) -> Path:
    """The python of a venv at ``venv`` that holds AReaL; built (or rebuilt) when needed."""
    venv = Path(venv).resolve()
    spec = spec or default_spec()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_stamp(venv) != spec:
            logger.info("building the AReaL %s environment in %s", spec.areal_version, venv)
            _build(venv, spec)
        else:
            logger.debug("reusing the AReaL environment in %s", venv)
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Create or reuse the cached AReaL venv.")
    parser.add_argument("venv", nargs="?", default=DEFAULT_VENV_DIR)
    parser.add_argument("--transformers", help="pin this transformers version in the venv")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    python = ensure_areal_env(args.venv, default_spec(args.transformers))
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
