"""``archon-port add <model_type|path>``: port a family end to end and prove it (the ``port_model`` tool)."""

from __future__ import annotations

import argparse
import sys

from skill.cli.tool_command import add_tool_command, print_result, run_tool
from skill.cli.tool_options import FieldOption
from skill.console import EXIT_BAD_INPUT, reports_bad_input


def parse_stages(text: str) -> list[int]:
    """``1,2,3`` -> ``[1, 2, 3]``; ``''`` -> ``[]`` (no stage)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write stage numbers separated by commas, e.g. 1,2,3") from None


TOOL = "port_model"


def register(subparsers: argparse._SubParsersAction) -> None:
    add_tool_command(
        subparsers,
        "add",
        TOOL,
        run,
        styles={
            "source": FieldOption(positional=True),
            "model_name": FieldOption(flag="--name", metavar="NAME"),
            "stages": FieldOption(
                parse=parse_stages,
                metavar="N,N,...",
                help="comma-separated stages to run after writing (default: all, 1,2,3,4,5,6; '' for none)",
            ),
        },
        help="port a HF family into archon_models/ and run stages 1-6",
        description="Measure the family's features, copy the nearest reference, edit args, model, "
        "RoPE, adapter and TP plan, register the spec, write tests/archon/test_<name>.py, then run "
        "every stage. Nothing is written when a feature has no edit or a different package exists "
        "without --overwrite. Exits 1 on failure.",
    )


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.port_model import PortModelResult

    result = run_tool(args, PortModelResult)
    if not args.json and result.failed_step == "analyze":
        # Refused before anything was written: the reason is the whole story.
        sys.stderr.write(f"archon-port: error: {result.error}\n")
        return EXIT_BAD_INPUT
    print_result(args, result, lambda _: format_table(result))
    return 0 if result.passed else 1


def format_table(result) -> str:
    rows = [(s.step, "ok" if s.ok else "FAILED", f"{s.seconds:.2f}s", s.detail) for s in result.steps]
    widths = [max(len(r[i]) for r in [("step", "result", "time", "detail"), *rows]) for i in range(3)]
    lines = [f"{'step':<{widths[0]}}  {'result':<{widths[1]}}  {'time':>{widths[2]}}  detail"]
    lines.append("-" * (sum(widths) + 12))
    for step, ok, seconds, detail in rows:
        lines.append(f"{step:<{widths[0]}}  {ok:<{widths[1]}}  {seconds:>{widths[2]}}  {detail[:200]}")
    lines.append("")
    status = "PASSED" if result.passed else f"FAILED at {result.failed_step}: {result.error}"
    logit = f"; max abs logit diff {result.max_abs_logit_diff:.2e}" if result.max_abs_logit_diff is not None else ""
    lines.append(f"{result.model_name}: {status} in {result.seconds:.1f}s{logit}")
    return "\n".join(lines)
