"""``archon-port check <model>``: the porting guide's common mistakes, checked."""

from __future__ import annotations

import argparse
import sys

from skill.cli._errors import reports_bad_input


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check",
        help="check a package for the porting guide's common mistakes",
        description="Static checks of archon_models/<model>/: files, HF keys mapped, config attributes, "
        "runtime buffers dropped, MoE conversion, TP plan vs QK norm, import line, model_type variants, "
        "print(). Exits 1 when any check fails.",
    )
    parser.add_argument("model", help="package name under archon_models/")
    parser.add_argument("--source", help="model_type or config path of the family (default: the model name)")
    parser.add_argument("--model-type", action="append", dest="model_types", help="model_type the spec must register")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.check_package import CheckPackageRequest, CheckPackageResult
    from skill.tools import invoke_as

    request = CheckPackageRequest(model_name=args.model, source=args.source, model_types=args.model_types or [])
    result = invoke_as(CheckPackageResult, "check_package", request)
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        width = max(len(c.name) for c in result.checks)
        for c in result.checks:
            sys.stdout.write(f"{c.name:<{width}}  {'ok' if c.passed else 'FAILED'}  {c.detail}\n")
        sys.stdout.write(f"{result.package_dir}: {'all checks passed' if result.passed else 'FAILED'}\n")
    return 0 if result.passed else 1
