"""``archon-port export <model> --areal <path>``: drop a package into AReaL and prove it there (the
``export_to_areal`` tool).

The person at the keyboard may name any AReaL tree and any Python (``--python``); over MCP the
tree must lie in the workspace and no Python may be named (``skill.tools.prepare_request``).
"""

from __future__ import annotations

import argparse
import sys

from skill.cli.tool_command import add_tool_command, print_result, run_tool
from skill.cli.tool_options import FieldOption
from skill.console import reports_bad_input

TOOL = "export_to_areal"


def register(subparsers: argparse._SubParsersAction) -> None:
    add_tool_command(
        subparsers,
        "export",
        TOOL,
        run,
        styles={
            "model_name": FieldOption(positional=True, metavar="model"),
            "areal": FieldOption(
                help="an AReaL source checkout, or an installed areal package "
                "(python -c 'import areal; print(areal.__path__[0])')"
            ),
            "run_checks": FieldOption(flag="--no-checks", help="write the package, skip the AReaL checks"),
            "distributed": FieldOption(flag="--no-distributed", help="skip the TP=2 / FSDP=2 checks"),
            "python": FieldOption(
                help="the Python that imports that AReaL and its dependencies (default: the venv holding an "
                "installed areal, else this interpreter)"
            ),
        },
        help="copy a package into an AReaL tree (import prefix rewritten, registered) and run the AReaL checks there",
        description="Copy archon_models/<model>/ into <areal>/areal/experimental/models/archon/<model>/ with "
        "the import prefix archon_models rewritten to areal.experimental.models.archon, add its import line "
        "to that __init__.py (all files or none), then run the AReaL tier's checks for every model_type of "
        "the package inside that AReaL and print a table. Refused: a model_type an AReaL package already "
        "serves (qwen2, qwen3, qwen3_moe, the qwen3_5 family, or an earlier export), and an existing, "
        "different package of that name unless --overwrite. Exits 2 on bad input, 1 when a check fails.",
    )


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.areal.export import ExportResult

    result = run_tool(args, ExportResult)
    if getattr(args, "dry_run", False) and not args.json:
        sys.stdout.write(result.diff or f"{result.package_dir}: already up to date; nothing would change\n")
    else:
        print_result(args, result, lambda _: format_result(result))
    return 1 if result.passed is False else 0


def format_result(result) -> str:
    """The files written, then one row per check, then one line per model_type."""
    lines = [f"{result.package_dir}: {len(result.changed_files)} file(s) written under {result.areal_root}"]
    lines += [f"  {rel}" for rel in result.changed_files]
    if result.checks_error:
        lines += ["", f"the AReaL checks could not run: {result.checks_error}"]
        return "\n".join(lines)
    if not result.checks:
        return "\n".join(lines)
    rows = [
        (r.model_type, c.name, "ok" if c.passed else "FAILED", _diff(c.max_abs_diff))
        for r in result.checks
        for c in r.checks
    ]
    header = ("model_type", "check", "result", "max abs diff")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    lines += ["", "  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=False)) + "  " + header[3]]
    lines.append("-" * (sum(widths) + 6 + len(header[3])))
    for row in rows:
        lines.append("  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=False)) + "  " + row[3])
    lines.append("")
    for r in result.checks:
        logit, grad = _diff(r.max_logit_diff), _diff(r.max_grad_diff)
        status = "PASSED" if r.passed else f"FAILED ({sum(not c.passed for c in r.checks)} check(s))"
        lines.append(
            f"{r.model_type} inside AReaL ({r.package}): {status} in {r.seconds:.1f}s; "
            f"max abs logit diff {logit}, gradient diff {grad}"
        )
    return "\n".join(lines)


def _diff(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"
