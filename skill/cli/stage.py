"""``archon-port stage <model> <n>``: run one test stage of a package."""

from __future__ import annotations

import argparse
import sys

from skill.cli._errors import reports_bad_input
from skill.cli._overrides import add_override_option, overrides_of


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stage",
        help="run one test stage (1-6) of a package",
        description="Run stage N (1 args, 2 adapter, 3 completeness, 4 parity, 5 distributed, "
        "6 checkpoint) of tests/archon/test_<model>.py in a pytest subprocess, writing the test "
        "file first if it is missing. With --override, adds a case with those config attributes to the "
        "test file (once) and runs only it. Exits 1 when the stage fails.",
    )
    parser.add_argument("model", help="package name under archon_models/")
    parser.add_argument("stage", type=int, help="stage number, 1-6")
    parser.add_argument("--model-type", help="HF model_type of the test case (default: the model name)")
    add_override_option(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.run_test_stage import RunTestStageRequest, RunTestStageResult
    from skill.tools import invoke_as

    result = invoke_as(
        RunTestStageResult,
        "run_test_stage",
        RunTestStageRequest(
            model_name=args.model, stage=args.stage, model_type=args.model_type, config_overrides=overrides_of(args)
        ),
    )
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
        return 0 if result.passed else 1
    for test in result.tests:
        sys.stdout.write(f"{test.test}: {test.outcome} ({test.seconds:.2f}s)\n")
        for check in test.checks:
            diff = f" max abs diff {check.max_abs_diff:.2e}" if check.max_abs_diff is not None else ""
            if check.error_vs_truth is not None and check.reference_error_vs_truth is not None:
                ratio = "inf" if check.error_ratio is None else f"{check.error_ratio:.3g}"
                diff += (
                    f" (vs float64 truth {check.error_vs_truth:.2e}, reference's {check.reference_error_vs_truth:.2e},"
                    f" ratio {ratio})"
                )
            verdict, detail = ("ok", "") if check.passed else ("FAILED", check.detail)
            sys.stdout.write(f"  {verdict}  {check.name}{diff}  {detail}\n")
    if not result.passed and result.output_tail:
        sys.stdout.write(result.output_tail + "\n")
    case = f" (case {result.case_id})" if result.case_id else ""
    verdict = "passed" if result.passed else "FAILED" + (f" ({result.reason})" if result.reason else "")
    sys.stdout.write(f"stage {result.stage} of {args.model}{case}: {verdict} in {result.seconds:.1f}s\n")
    return 0 if result.passed else 1
