"""``archon-port analyze <source> [--json]``: the porting guide's step-1 checklist (the ``analyze_hf_model`` tool)."""

from __future__ import annotations

import argparse
import sys

from skill.cli.tool_command import add_tool_command, print_result, run_tool
from skill.cli.tool_options import FieldOption
from skill.console import EXIT_BAD_INPUT, reports_bad_input

TOOL = "analyze_hf_model"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_tool_command(
        subparsers,
        "analyze",
        TOOL,
        run,
        styles={
            "source": FieldOption(
                positional=True, optional=True, help="model_type (e.g. mistral), checkpoint folder, or config.json"
            )
        },
        help="analyse a HF decoder-only family: checklist, checkpoint keys, nearest reference, unsupported features",
        description="Analyse a model_type of the installed transformers, a checkpoint folder with config.json, "
        "or a config.json path. No network; remote code runs only with --trust-remote-code. "
        "Exits 2 on bad input (the message says what to do).",
    )
    parser.add_argument("--list", action="store_true", help="list the candidate decoder-only model types and exit")


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.analysis import AnalysisError, ArchitectureReport, decoder_only_candidates

    if args.list:
        sys.stdout.write("\n".join(decoder_only_candidates()) + "\n")
        return 0
    if not getattr(args, "source", None):
        sys.stderr.write("archon-port analyze: give a model_type, a folder or a config.json (or --list)\n")
        return EXIT_BAD_INPUT
    try:
        report = run_tool(args, ArchitectureReport)
    except AnalysisError as exc:
        sys.stderr.write(f"archon-port analyze: {exc}\n")
        return EXIT_BAD_INPUT
    print_result(args, report, lambda _: format_report(report))
    return 0


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=False)) + "  " + header[-1]]
    lines.append("-" * (sum(widths) + 2 * len(widths) + len(header[-1])))
    for row in rows:
        lines.append("  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return lines


def format_report(report) -> str:
    """The checklist, deltas and unsupported features as readable text."""
    lines = [
        f"{report.model_type} ({report.config_class}); variants: {', '.join(report.variant_types)}",
        "",
        *_table(report.checklist_rows(), ("section", "item", "value")),
        "",
        f"nearest reference: {report.reference}",
    ]
    if report.deltas:
        lines += _table(
            [(d.title, d.reference, d.target, "yes" if d.supported else "NO") for d in report.deltas],
            ("delta", "reference", "target", "supported"),
        )
    else:
        lines.append("no deltas")
    lines.append("")
    lines += report.unsupported or ["every feature is covered by a reference or an edit"]
    if report.hand_edit_places:
        # SKILL.md's hand port reads where each skipped feature's code goes from this field.
        lines += ["", "hand edit places (hand_edit_places):"]
        lines += [f"  {feature}: {place.where('<Model>')}" for feature, place in report.hand_edit_places.items()]
    mapped = sum(1 for f in report.config_fields if f.archon_field != "unmapped")
    lines.append("")
    lines.append(
        f"config fields: {len(report.config_fields)} ({mapped} mapped to Archon args); checkpoint keys: "
        f"{len(report.checkpoint.top_level)} top-level, {len(report.checkpoint.layer0)} in layer 0 "
        f"({report.checkpoint.layer_prefix}); --json for all of them"
    )
    return "\n".join(lines)
