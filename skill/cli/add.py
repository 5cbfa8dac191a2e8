"""``archon-port add <model_type|path>``: port a family end to end and prove it."""

from __future__ import annotations

import argparse
import logging
import sys

from skill.cli._errors import reports_bad_input

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "add",
        help="port a HF family into archon_models/ and run stages 1-6",
        description="Measure the family's features, copy the nearest reference, edit args, model, "
        "RoPE, adapter and TP plan, register the spec, write tests/archon/test_<name>.py, then run "
        "every stage. Nothing is written when a feature has no edit or a different package exists "
        "without --overwrite. Exits 1 on failure.",
    )
    parser.add_argument("source", help="model_type known to transformers, or a checkpoint folder / config.json")
    parser.add_argument("--name", help="package name under archon_models/ (default: the model_type)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, different package")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="the source folder's config.json has auto_map: run its configuration_*.py / modeling_*.py "
        "(read them first) for the analysis and every stage",
    )
    parser.add_argument(
        "--stages",
        default="1,2,3,4,5,6",
        help="comma-separated stages to run after writing (default: all; '' for none)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.port_model import PortModelRequest, PortModelResult
    from skill.tools import invoke_as

    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    request = PortModelRequest(
        source=args.source,
        model_name=args.name,
        overwrite=args.overwrite,
        stages=stages,
        trust_remote_code=args.trust_remote_code,
    )
    result = invoke_as(PortModelResult, "port_model", request, confine_sources=False)
    if not args.json and result.failed_step == "analyze":
        # Refused before anything was written: the reason is the whole story.
        sys.stderr.write(f"archon-port: error: {result.error}\n")
        return 2
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        sys.stdout.write(format_table(result) + "\n")
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
