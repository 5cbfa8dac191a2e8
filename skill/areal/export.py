"""Step 11: export a package into an AReaL tree and prove it there.

``<areal>`` is an AReaL source checkout (holding ``areal/experimental/models/archon/``) or
an installed ``areal`` package directory. The package's files are copied into
``areal/experimental/models/archon/<model>/`` with the import prefix rewritten by libcst,
and its import line is added to that directory's ``__init__.py``. Refused: a model_type
an AReaL package already serves (qwen2, qwen3, qwen3_moe, the qwen3_5 family, or one
exported earlier under another name), and an existing different package of the same name
unless ``overwrite``. The write goes through a :class:`StagedTree` (all files or none).
Then the AReaL tier's checks run for every model_type of the package, in a Python that
imports that AReaL.
"""

from __future__ import annotations

import ast
import difflib
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from skill.areal.checks import AReaLCheckResult
from skill.areal.rename import ARCHON_PREFIX, AREAL_PREFIX, rename_in_text, rewrite_prefix
from skill.codemod import StagedTree, Workspace, journal, validate_model_name
from skill.codemod.workspace import find_project_root

logger = logging.getLogger(__name__)

ARCHON_DIR = "areal/experimental/models/archon"
# Packages AReaL 1.0.4 ships; an export never replaces them.
AREAL_BUILTIN_PACKAGES = frozenset({"qwen2", "qwen3", "qwen3_5"})
PROJECT_ROOT = Path(__file__).resolve().parents[2]
_ISOLATED_LAUNCHER = Path(__file__).with_name("isolated.py")


class ExportError(ValueError):
    """Bad input to export: one line saying what and how to fix it."""


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(description="package under archon_models/ to export, e.g. 'llama'")
    areal: Path = Field(description="an AReaL source checkout, or an installed `areal` package directory")
    overwrite: bool = Field(default=False, description="replace an existing, different package of that name")
    dry_run: bool = Field(default=False, description="return the diff, write nothing, run no checks")
    run_checks: bool = Field(default=True, description="run the AReaL-tier checks inside that AReaL afterwards")
    distributed: bool = Field(default=True, description="include TP=2 and FSDP=2 on 2 gloo processes in the checks")
    python: Path | None = Field(
        default=None,
        description="the Python that imports that AReaL (default: the venv holding an installed "
        "`areal`, else this interpreter)",
    )
    workspace: Path | None = Field(default=None, description="project root holding archon_models/")

    @field_validator("model_name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        return validate_model_name(value)


class ExportResult(BaseModel):
    areal_root: str = Field(description="the directory holding areal/ (a checkout, or site-packages)")
    package_dir: str = Field(description="where the package lives inside AReaL")
    model_types: list[str]
    changed_files: list[str] = Field(default_factory=list, description="paths under areal_root written")
    diff: str = Field(default="", description="unified diff of what the export writes (or would write)")
    checks: list[AReaLCheckResult] = Field(default_factory=list, description="one entry per model_type")
    checks_error: str | None = Field(
        default=None, description="why the checks could not run (the package was written all the same)"
    )
    passed: bool | None = Field(
        default=None, description="every AReaL check of every model_type passed; None when none ran (dry run)"
    )


def areal_root_of(path: Path) -> Path:
    """The directory holding ``areal/`` for a checkout or an installed package path."""
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise ExportError(f"--areal {path}: no such directory; pass an AReaL checkout or the installed areal package")
    if (path / ARCHON_DIR).is_dir():
        return path
    if path.name == "areal" and (path.parent / ARCHON_DIR).is_dir():
        return path.parent
    raise ExportError(
        f"--areal {path}: neither an AReaL checkout (no {ARCHON_DIR}/) nor an installed areal package; "
        "pass the checkout root or the directory `python -c 'import areal; print(areal.__path__[0])'` prints"
    )


def _served_types(spec_source: str) -> set[str]:
    """String literals inside ``supported_model_types=...`` of a spec.py."""
    types: set[str] = set()
    for node in ast.walk(ast.parse(spec_source)):
        if isinstance(node, ast.keyword) and node.arg == "supported_model_types":
            types |= {n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return types


def _import_line(model_name: str, prefix: str) -> str:
    return f"from {prefix}.{model_name} import spec as {model_name}_spec  # noqa: F401"


def _add_import_line(init_text: str, line: str) -> str:
    """``init_text`` with ``line`` after the last per-model spec import (idempotent)."""
    if line in init_text.splitlines():
        return init_text
    lines = init_text.splitlines(keepends=True)
    anchor = max((i for i, text in enumerate(lines) if " import spec as " in text), default=None)
    if anchor is None:
        anchor = max((i for i, text in enumerate(lines) if text.startswith(("from ", "import "))), default=-1)
    lines.insert(anchor + 1, line + "\n")
    return "".join(lines)


def _unified(rel: str, old: str | None, new: str | None) -> str:
    fromfile = f"a/{rel}" if old is not None else "/dev/null"
    tofile = f"b/{rel}" if new is not None else "/dev/null"
    diff = "".join(
        difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True), fromfile, tofile
        )
    )
    # An empty file created or deleted (a package's infra/__init__.py) has no hunk, only its header.
    if not diff and old != new:
        diff = f"--- {fromfile}\n+++ {tofile}\n"
    return diff


def package_files(project: Path, model_name: str) -> list[Path]:
    """The regular files of ``archon_models/<model_name>/`` (no caches), sorted.

    A symbolic link anywhere in the package (the folder itself included) is refused: an
    export copies what the package holds, never a file it points to elsewhere on disk.
    """
    source_dir = project / ARCHON_PREFIX / model_name
    if source_dir.is_symlink():
        raise ExportError(
            f"{model_name}: {ARCHON_PREFIX}/{model_name} is a symbolic link (to {os.readlink(source_dir)}); "
            "an export copies a package folder of this project only"
        )
    found: list[Path] = []
    for directory, dirnames, filenames in os.walk(source_dir):
        here = Path(directory)
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in [*dirnames, *filenames]:
            path = here / name
            if path.is_symlink():
                rel = path.relative_to(project).as_posix()
                raise ExportError(
                    f"{model_name}: {rel} is a symbolic link (to {os.readlink(path)}); an export copies regular "
                    "files only. Replace the link by the file it points to, or remove it"
                )
        found += [here / name for name in filenames if not name.endswith(".pyc")]
    return sorted(found)


def stage_export(
    tree: StagedTree, project: Path, model_name: str, overwrite: bool, replace_builtin: bool = False
) -> list[str]:
    """Stage the package's files and import line in ``tree`` (an AReaL root); its model types.

    ``replace_builtin`` lets the AReaL tier put this project's references in place of
    AReaL's own qwen2/qwen3 in a scratch copy; export itself never sets it.
    """
    source_dir = project / ARCHON_PREFIX / model_name
    if not (source_dir / "spec.py").is_file():
        raise ExportError(
            f"{model_name}: no package archon_models/{model_name}/ with a spec.py in {project}; "
            f"run `archon-port add {model_name}` first"
        )
    if model_name in AREAL_BUILTIN_PACKAGES and not replace_builtin:
        raise ExportError(f"{model_name}: AReaL ships its own {model_name} package; an export never replaces it")
    files = package_files(project, model_name)
    types = sorted(_served_types((source_dir / "spec.py").read_text()))
    archon_root = tree.workspace.root / ARCHON_DIR
    for other in sorted(p for p in archon_root.iterdir() if (p / "spec.py").is_file() and p.name != model_name):
        if replace_builtin and other.name in AREAL_BUILTIN_PACKAGES:
            continue
        taken = sorted(set(types) & _served_types((other / "spec.py").read_text()))
        if taken:
            raise ExportError(
                f"{model_name}: model_type {', '.join(taken)} is already served by AReaL's package {other.name}; "
                "a model_type belongs to one package"
            )
    target = f"{ARCHON_DIR}/{model_name}"
    new_files: dict[str, str] = {}
    for path in files:
        rel = f"{target}/{path.relative_to(source_dir).as_posix()}"
        text = path.read_text(encoding="utf-8")
        new_files[rel] = rewrite_prefix(text, filename=str(path)) if path.suffix == ".py" else rename_in_text(text)
    existing = tree.list_files(target)
    if existing and not overwrite and {k: tree.read_text(k) for k in existing} != new_files:
        raise ExportError(
            f"{model_name}: {target}/ exists in that AReaL and differs from this package; "
            "pass --overwrite to replace it"
        )
    for rel in existing:
        if rel not in new_files:
            tree.delete(rel)
    for rel, text in new_files.items():
        tree.write_text(rel, text)
    init = f"{ARCHON_DIR}/__init__.py"
    tree.write_text(init, _add_import_line(tree.read_text(init) or "", _import_line(model_name, AREAL_PREFIX)))
    return types


def default_python(areal_root: Path) -> Path:
    """The venv's python when ``areal_root`` is its site-packages, else this interpreter."""
    for parent in areal_root.parents:
        candidate = parent / "bin" / "python"
        if (parent / "pyvenv.cfg").is_file() and candidate.exists():
            return candidate
    return Path(sys.executable)


class AReaLChecksDidNotRun(RuntimeError):
    """The check process ended without a result for every model type (e.g. that Python lacks AReaL)."""


def checks_command(python: Path, areal_root: Path, *arguments: str) -> list[str]:
    """``python`` running ``skill.areal.checks *arguments`` isolated (:mod:`skill.areal.isolated`):
    this engine first on the path, only the package ``areal`` taken from ``areal_root``."""
    return [str(python), "-I", str(_ISOLATED_LAUNCHER), str(PROJECT_ROOT), str(areal_root), *arguments]


def run_checks_in(
    python: Path, areal_root: Path, model_types: list[str], distributed: bool = True
) -> list[AReaLCheckResult]:
    """The AReaL tier for ``model_types``, in ``python`` importing ``areal`` from ``areal_root``."""
    cmd = checks_command(python, areal_root, "run", *model_types)
    if not distributed:
        cmd.append("--no-distributed")
    logger.info("running the AReaL checks: %s", " ".join(cmd))
    proc = subprocess.run(
        cmd, check=False, env=dict(os.environ), capture_output=True, text=True, cwd=tempfile.gettempdir()
    )
    results = [
        AReaLCheckResult.model_validate(json.loads(line)) for line in proc.stdout.splitlines() if line.startswith("{")
    ]
    if len(results) != len(model_types):
        raise AReaLChecksDidNotRun(
            f"the AReaL checks in {python} ended (exit {proc.returncode}) without a result for every "
            f"model type:\n{proc.stderr[-4000:]}"
        )
    return results


def export_to_areal(request: ExportRequest) -> ExportResult:
    """Step 11, after the stages pass: copy archon_models/<model_name>/ into an AReaL checkout
    or installed areal package (areal/experimental/models/archon/<model_name>/) with the import
    prefix rewritten, add its import line there, and run the AReaL-tier checks for it inside that
    AReaL (built as ArchonEngine builds it: parity, to_hf, critic, TP/FSDP). Refuses a model_type
    AReaL already serves and, without overwrite, a different package of that name; dry_run
    returns the diff only.

    Every file is written or none. Read ``passed``, ``checks`` (per model_type: each check,
    ``max_logit_diff``, ``max_grad_diff``) and ``checks_error``.
    """
    project = Path(request.workspace).resolve() if request.workspace else find_project_root()
    root = areal_root_of(request.areal)
    areal = Workspace(root, marker=ARCHON_DIR)
    # An export killed mid-write left its journal in that AReaL: roll it back before comparing
    # (a dry run too), so the tree is as it was before that export, never half of it.
    if journal.recover(areal):
        logger.warning("rolled back the unfinished write of an export that was interrupted in %s", root)
    tree = StagedTree(areal)
    types = stage_export(tree, project, request.model_name, request.overwrite)
    changes = tree.changes()
    diff = "".join(
        _unified(rel, tree.workspace.resolve(rel).read_text() if tree.workspace.resolve(rel).is_file() else None, new)
        for rel, new in sorted(changes.items())
    )
    result = ExportResult(
        areal_root=str(root),
        package_dir=str(root / ARCHON_DIR / request.model_name),
        model_types=types,
        diff=diff,
    )
    if request.dry_run:
        return result
    result.changed_files = tree.commit()
    if request.run_checks:
        python = request.python or default_python(root)
        try:
            result.checks = run_checks_in(python, root, types, distributed=request.distributed)
        except AReaLChecksDidNotRun as exc:
            result.checks_error = str(exc)
            result.passed = False
        else:
            result.passed = all(r.passed for r in result.checks)
    return result


class AReaLChecker:
    """A long-lived ``skill.areal.checks serve`` process in an AReaL Python: AReaL and
    torch are imported once, then each :meth:`check` costs only the checks themselves."""

    def __init__(self, python: Path, areal_root: Path, log_path: Path | None = None):
        self._log = open(log_path, "w") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            checks_command(python, areal_root, "serve"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=dict(os.environ),
            cwd=tempfile.gettempdir(),
        )

    def check(self, model_type: str, distributed: bool = True) -> AReaLCheckResult:
        from skill.areal.checks import AReaLCheckRequest

        assert self._proc.stdin is not None and self._proc.stdout is not None
        request = AReaLCheckRequest(model_type=model_type, distributed=distributed)
        self._proc.stdin.write(request.model_dump_json() + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the AReaL check process exited ({self._proc.wait()}) while checking {model_type}")
        return AReaLCheckResult.model_validate_json(line)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if not isinstance(self._log, int):  # a log file, not subprocess.DEVNULL
            self._log.close()
