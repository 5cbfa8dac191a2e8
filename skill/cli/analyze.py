"""``archon-port analyze <source> [--json]``: the porting guide's step-1 checklist."""

from __future__ import annotations

import argparse
import logging
import sys

from skill.cli._errors import reports_bad_input

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="analyse a HF decoder-only family: checklist, checkpoint keys, nearest reference, unsupported features",
        description="Analyse a model_type of the installed transformers, a checkpoint folder with config.json, "
        "or a config.json path. No network; remote code runs only with --trust-remote-code. "
        "Exits 2 on bad input (the message says what to do).",
    )
    parser.add_argument("source", nargs="?", help="model_type (e.g. mistral), checkpoint folder, or config.json")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="execute the folder's modeling_*.py (read it first)"
    )
    parser.add_argument("--list", action="store_true", help="list the candidate decoder-only model types and exit")
    parser.set_defaults(func=run)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.analysis import AnalysisError, AnalyzeInput, decoder_only_candidates
    from skill.tools import invoke

    if args.list:
        sys.stdout.write("\n".join(decoder_only_candidates()) + "\n")
        return 0
    if not args.source:
        sys.stderr.write("archon-port analyze: give a model_type, a folder or a config.json (or --list)\n")
        return 2
    request = AnalyzeInput(source=args.source, trust_remote_code=args.trust_remote_code)
    try:
        report = invoke("analyze_hf_model", request, confine_sources=False)
    except AnalysisError as exc:
        sys.stderr.write(f"archon-port analyze: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
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
    mapped = sum(1 for f in report.config_fields if f.archon_field != "unmapped")
    lines.append("")
    lines.append(
        f"config fields: {len(report.config_fields)} ({mapped} mapped to Archon args); checkpoint keys: "
        f"{len(report.checkpoint.top_level)} top-level, {len(report.checkpoint.layer0)} in layer 0 "
        f"({report.checkpoint.layer_prefix}); --json for all of them"
    )
    return "\n".join(lines)
