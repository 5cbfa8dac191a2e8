"""``archon-port check <model>``: the porting guide's common mistakes, checked (the ``check_package`` tool)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from skill.cli.tool_command import add_tool_command, print_result, run_tool
from skill.cli.tool_options import FieldOption
from skill.console import reports_bad_input

if TYPE_CHECKING:  # the step module imports torch: only when the command runs
    from skill.porting.check_package import CheckPackageResult

TOOL = "check_package"


def register(subparsers: argparse._SubParsersAction) -> None:
    add_tool_command(
        subparsers,
        "check",
        TOOL,
        run,
        styles={
            "model_name": FieldOption(positional=True, metavar="model"),
            "model_types": FieldOption(flag="--model-type", metavar="MODEL_TYPE"),
        },
        help="check a package for the porting guide's common mistakes",
        description="Static checks of archon_models/<model>/: files, HF keys mapped, config attributes, "
        "runtime buffers dropped, MoE conversion, TP plan vs QK norm, import line, model_type variants, "
        "print(). Exits 1 when any check fails.",
    )


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.check_package import CheckPackageResult

    result = run_tool(args, CheckPackageResult)
    print_result(args, result, lambda _: format_checks(result))
    return 0 if result.passed else 1


def format_checks(result: CheckPackageResult) -> str:
    width = max((len(c.name) for c in result.checks), default=0)
    lines = [f"{c.name:<{width}}  {'ok' if c.passed else 'FAILED'}  {c.detail}" for c in result.checks]
    lines.append(f"{result.package_dir}: {'all checks passed' if result.passed else 'FAILED'}")
    return "\n".join(lines)
