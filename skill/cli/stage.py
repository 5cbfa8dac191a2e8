"""``archon-port stage <model> <n>``: run one test stage of a package (the ``run_test_stage`` tool)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from skill.cli.tool_command import add_tool_command, print_result, run_tool
from skill.cli.tool_options import FieldOption
from skill.console import reports_bad_input

if TYPE_CHECKING:  # the step module imports torch: only when the command runs
    from skill.porting.run_test_stage import RunTestStageResult

OVERRIDE_HELP = (
    "set a config attribute on the tiny HF config of both sides, to prove a feature a default hides "
    "(e.g. clip_qkv=8.0, rope_parameters='{\"factor\": 2.0}', hidden_act=gelu)"
)
OVERRIDE = FieldOption(flag="--override", metavar="KEY=VALUE", help=OVERRIDE_HELP)


TOOL = "run_test_stage"


def register(subparsers: argparse._SubParsersAction) -> None:
    add_tool_command(
        subparsers,
        "stage",
        TOOL,
        run,
        styles={
            "model_name": FieldOption(positional=True, metavar="model"),
            "stage": FieldOption(positional=True),
            "config_overrides": OVERRIDE,
        },
        help="run one test stage (1-6) of a package",
        description="Run stage N (1 args, 2 adapter, 3 completeness, 4 parity, 5 distributed, "
        "6 checkpoint) of tests/archon/test_<model>.py in a pytest subprocess, writing the test "
        "file first if it is missing. With --override, adds a case with those config attributes to the "
        "test file (once) and runs only it. Exits 1 when the stage fails.",
    )


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.run_test_stage import RunTestStageResult

    result = run_tool(args, RunTestStageResult)
    print_result(args, result, lambda _: format_stage(result, args.model_name))
    return 0 if result.passed else 1


# The name of a passing check that stands for a run the model cannot do (its detail says why).
NOT_RUN = "not run ("


def format_stage(result: RunTestStageResult, model_name: str) -> str:
    """Each test, each check with its numbers, then the verdict."""
    lines = []
    for test in result.tests:
        lines.append(f"{test.test}: {test.outcome} ({test.seconds:.2f}s)")
        for check in test.checks:
            diff = f" max abs diff {check.max_abs_diff:.2e}" if check.max_abs_diff is not None else ""
            if check.error_vs_truth is not None and check.reference_error_vs_truth is not None:
                ratio = "inf" if check.error_ratio is None else f"{check.error_ratio:.3g}"
                diff += (
                    f" (vs float64 truth {check.error_vs_truth:.2e}, reference's {check.reference_error_vs_truth:.2e},"
                    f" ratio {ratio})"
                )
            # A failure says what differs; a check that did not run says why it could not.
            shown = not check.passed or check.name.startswith(NOT_RUN)
            verdict, detail = ("ok" if check.passed else "FAILED"), (check.detail if shown else "")
            lines.append(f"  {verdict}  {check.name}{diff}  {detail}")
    if not result.passed and result.output_tail:
        lines.append(result.output_tail)
    case = f" (case {result.case_id})" if result.case_id else ""
    verdict = "passed" if result.passed else "FAILED" + (f" ({result.reason})" if result.reason else "")
    lines.append(f"stage {result.stage} of {model_name}{case}: {verdict} in {result.seconds:.1f}s")
    return "\n".join(lines)
