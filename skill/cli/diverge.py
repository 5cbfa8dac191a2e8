"""``archon-port diverge <model>``: the first module where Archon and HF part ways (the ``locate_divergence`` tool)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from skill.cli.stage import OVERRIDE
from skill.cli.tool_command import add_tool_command, print_result, run_tool
from skill.cli.tool_options import FieldOption
from skill.console import reports_bad_input

if TYPE_CHECKING:  # the step module imports torch: only when the command runs
    from skill.porting.locate_divergence import LocateDivergenceResult

TOOL = "locate_divergence"


def register(subparsers: argparse._SubParsersAction) -> None:
    add_tool_command(
        subparsers,
        "diverge",
        TOOL,
        run,
        styles={"model_name": FieldOption(positional=True, metavar="model"), "config_overrides": OVERRIDE},
        help="name the first module whose output differs from HF",
        description="Run a tiny HF model and its Archon port on the same tokens with hooks on every "
        "module, match modules through the adapter map, and name the first one whose output differs "
        "beyond fp32 tolerance; modules without parameters are matched by where they run. --override "
        "sets config attributes on the tiny config of both sides. Exits 1 when the logits diverge.",
    )


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.locate_divergence import LocateDivergenceResult

    result = run_tool(args, LocateDivergenceResult)
    print_result(args, result, lambda _: format_divergence(result))
    return 1 if result.diverged else 0


def format_divergence(result: LocateDivergenceResult) -> str:
    lines = []
    for diff in result.compared:
        mark = "ok  " if diff.within_tolerance else "DIFF"
        lines.append(f"{mark} {diff.archon_module:<32} {diff.hf_module:<40} {diff.max_abs_diff:.2e}")
    if result.first_divergence is not None:
        d = result.first_divergence
        lines.append(f"first divergence: {d.archon_module} (HF {d.hf_module}), max abs diff {d.max_abs_diff:.3e}")
    lines.append(f"logits max abs diff {result.logits_max_abs_diff:.3e}: {'DIVERGED' if result.diverged else 'match'}")
    return "\n".join(lines)
