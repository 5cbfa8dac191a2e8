"""``archon-port diverge <model>``: the first module where Archon and HF part ways."""

from __future__ import annotations

import argparse
import sys

from skill.cli._errors import reports_bad_input
from skill.cli._overrides import add_override_option, overrides_of


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diverge",
        help="name the first module whose output differs from HF",
        description="Run a tiny HF model and its Archon port on the same tokens with hooks on every "
        "module, match modules through the adapter map, and name the first one whose output differs "
        "beyond fp32 tolerance; modules without parameters are matched by where they run. --override "
        "sets config attributes on the tiny config of both sides. Exits 1 when the logits diverge.",
    )
    parser.add_argument("model", help="package name under archon_models/")
    parser.add_argument("--model-type", help="HF model_type (default: the package's test case)")
    add_override_option(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


@reports_bad_input
def run(args: argparse.Namespace) -> int:
    from skill.porting.locate_divergence import LocateDivergenceRequest, LocateDivergenceResult
    from skill.tools import invoke_as

    result = invoke_as(
        LocateDivergenceResult,
        "locate_divergence",
        LocateDivergenceRequest(model_name=args.model, model_type=args.model_type, config_overrides=overrides_of(args)),
    )
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
        return 1 if result.diverged else 0
    for diff in result.compared:
        mark = "ok  " if diff.within_tolerance else "DIFF"
        sys.stdout.write(f"{mark} {diff.archon_module:<32} {diff.hf_module:<40} {diff.max_abs_diff:.2e}\n")
    if result.first_divergence is not None:
        d = result.first_divergence
        sys.stdout.write(f"first divergence: {d.archon_module} (HF {d.hf_module}), max abs diff {d.max_abs_diff:.3e}\n")
    sys.stdout.write(
        f"logits max abs diff {result.logits_max_abs_diff:.3e}: {'DIVERGED' if result.diverged else 'match'}\n"
    )
    return 1 if result.diverged else 0
