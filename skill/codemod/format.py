"""The formatter every generated Python file goes through: ``ruff format``.

A ported package must read as code written by hand for its family, and pass the same
gates as the hand-written code (``.ci/lint``: ``ruff check`` and ``ruff format --check``).
The engine therefore formats what it writes, with this project's ruff settings, so the
committed packages are exactly what the engine produces.

The settings are passed on the command line with ``--isolated``, so the result does not
depend on the working directory or on a configuration file of the workspace being written
to; ``tests/skill/test_format.py`` keeps them equal to ``[tool.ruff]`` in pyproject.toml.
The edits (libcst) match statements by their code, not their layout, and re-read files
between steps, so they apply to formatted text as they do to the reference's.
"""

from __future__ import annotations

import ast
import functools
import importlib
import subprocess
import sys
import textwrap

# Equal to [tool.ruff] in pyproject.toml (checked by tests/skill/test_format.py).
LINE_LENGTH = 120
TARGET_VERSION = "py311"
KNOWN_FIRST_PARTY = ("archon_models", "skill", "mcp_server")


class FormatError(RuntimeError):
    """ruff is missing or refused the text (which then is not valid Python)."""


@functools.cache
def _ruff_command() -> tuple[str, ...]:
    """The ruff binary of this interpreter's ruff package, run directly: ``python -m ruff``
    starts an interpreter only to exec that binary (0.38 s against 0.10 s per call, measured
    on the loaded 2-core machine, and a port formats dozens of files). ``python -m ruff``
    when the package is missing or cannot name its binary, so the error stays the same."""
    try:
        return (str(importlib.import_module("ruff").find_ruff_bin()),)
    except (ImportError, AttributeError, FileNotFoundError):
        return (sys.executable, "-m", "ruff")


def _ruff(args: list[str], text: str, filename: str) -> str:
    command = [
        *_ruff_command(),
        *args,
        "--isolated",
        "--line-length",
        str(LINE_LENGTH),
        "--target-version",
        TARGET_VERSION,
        "--stdin-filename",
        filename,
        "-",
    ]
    try:
        proc = subprocess.run(command, input=text, capture_output=True, text=True, check=False, timeout=60)
    except FileNotFoundError as exc:  # no interpreter (or binary) there: nothing else to try
        raise FormatError(f"cannot run {' '.join(_ruff_command())}: {exc}") from exc
    if proc.returncode != 0:
        if "No module named ruff" in proc.stderr:
            raise FormatError(
                "ruff is not installed in this interpreter; the engine formats every file it generates "
                "with it. Install it: pip install 'archon-port[test]' (or pip install ruff==0.17.6)."
            )
        detail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise FormatError(f"ruff {args[0]} failed on {filename}: {' '.join(detail[:3]) or f'exit {proc.returncode}'}")
    return proc.stdout


# format_python is a pure function of its arguments (one pinned ruff, fixed settings):
# the same reference files are formatted again by every port, replay and export in a
# process, so results are kept (failures are not: an exception is never cached).
@functools.lru_cache(maxsize=1024)
def format_python(text: str, filename: str = "generated.py") -> str:
    """``text`` as ``ruff check --select I,F401,RUF022 --fix`` then ``ruff format`` would leave it
    with this project's settings. Deterministic; raises :class:`FormatError` when ruff is
    missing or the text is not valid Python.

    Only import hygiene and ``__all__`` order are fixed automatically: imports sorted,
    imports an edit left unused (a reference's ``F`` once its MLP is replaced) removed, and
    ``__all__`` sorted (a renamed model class can move past ``RMSNorm``), and docstring lines that
    renaming made longer than the line length wrapped (:func:`wrap_docstrings`). Every other lint
    finding in generated code is a bug in a reference, a snippet or an edit, fixed there."""
    known = ["--config", "lint.isort.known-first-party = [" + ", ".join(f'"{n}"' for n in KNOWN_FIRST_PARTY) + "]"]
    fixes = ["check", "--select", "I,F401,RUF022", "--fix", "--exit-zero", "--quiet", *known]
    sorted_text = _ruff(fixes, text, filename)
    formatted = _ruff(["format"], sorted_text, filename)
    wrapped = wrap_docstrings(formatted)
    return formatted if wrapped == formatted else _ruff(["format"], wrapped, filename)


def wrap_docstrings(text: str, line_length: int = LINE_LENGTH) -> str:
    """``text`` with every docstring line longer than ``line_length`` wrapped at spaces.

    ``ruff format`` never reflows a docstring, so a line that renaming lengthened (a copied
    reference's ``Qwen3`` becoming a long family name, three times on one line) would fail
    E501. Continuation lines take the docstring's own indentation; lines that fit, code and
    other strings are left as they are. A line with no space to break at stays long.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    spans: list[tuple[int, int, int]] = []
    for node in ast.walk(tree):
        if not isinstance(node, owners) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            spans.append((first.lineno - 1, (first.end_lineno or first.lineno) - 1, first.col_offset))
    for start, end, column in sorted(spans, reverse=True):
        for index in range(end, start - 1, -1):
            line = lines[index]
            body = line.rstrip("\r\n")
            if len(body) <= line_length:
                continue
            ending = line[len(body) :]
            lead = body[: len(body) - len(body.lstrip())]
            wrapper = textwrap.TextWrapper(
                width=line_length,
                initial_indent=lead,
                subsequent_indent=" " * column,
                break_long_words=False,
                break_on_hyphens=False,
            )
            pieces = wrapper.wrap(body.lstrip())
            lines[index : index + 1] = [piece + (ending or "\n") for piece in pieces[:-1]] + [pieces[-1] + ending]
    return "".join(lines)
