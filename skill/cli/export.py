"""``archon-port export <model> --areal <path>``: drop a package into AReaL and prove it there."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from skill.cli._errors import reports_bad_input

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="copy a package into an AReaL tree (import prefix rewritten, registered) and run the AReaL checks there",
        description="Copy archon_models/<model>/ into <areal>/areal/experimental/models/archon/<model>/ with "
        "the import prefix archon_models rewritten to areal.experimental.models.archon, add its import line "
        "to that __init__.py (all files or none), then run the AReaL tier's checks for every model_type of "
        "the package inside that AReaL and print a table. Refused: a model_type an AReaL package already "
        "serves (qwen2, qwen3, qwen3_moe, the qwen3_5 family, or an earlier export), and an existing, "
        "different package of that name unless --overwrite. Exits 2 on bad input, 1 when a check fails.",
    )
    parser.add_argument("model", help="package under archon_models/, e.g. llama")
    parser.add_argument(
        "--areal",
        required=True,
        type=Path,
        help="an AReaL source checkout, or an installed areal package "
        "(python -c 'import areal; print(areal.__path__[0])')",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, different package of that name")
    parser.add_argument("--dry-run", action="store_true", help="print the diff; write nothing, run no checks")
    parser.add_argument("--no-checks", action="store_true", help="write the package, skip the AReaL checks")
    parser.add_argument("--no-distributed", action="store_true", help="skip the TP=2 / FSDP=2 checks")
    parser.add_argument(
        "--python",
        type=Path,
        help="the Python that imports that AReaL and its dependencies (default: the venv holding an "
        "installed areal, else this interpreter)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.areal.export import ExportRequest, ExportResult
    from skill.tools import invoke_as

    request = ExportRequest(
        model_name=args.model,
        areal=args.areal,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        run_checks=not args.no_checks,
        distributed=not args.no_distributed,
        python=args.python,
    )
    # The person at the shell names the AReaL tree; it lies outside this project by design.
    result = invoke_as(ExportResult, "export_to_areal", request, allow_external=True)
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    elif args.dry_run:
        sys.stdout.write(result.diff or f"{result.package_dir}: already up to date; nothing would change\n")
    else:
        sys.stdout.write(format_result(result) + "\n")
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
