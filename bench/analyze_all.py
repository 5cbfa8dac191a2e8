"""Analyse every decoder-only family of the installed transformers and print a table.

Families are enumerated from transformers itself (the causal-LM mapping, minus types
that are also masked-LM encoders); the analyser refuses encoder-decoder, multimodal,
hybrid and recurrent ones with an error, which the table lists separately.

    python bench/analyze_all.py [--json OUT.json] [model_type ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from transformers.utils import logging as hf_logging

from skill.analysis import AnalysisError, AnalyzeInput, analyze_hf_model, decoder_only_candidates

logger = logging.getLogger("bench.analyze_all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="default: every candidate family")
    parser.add_argument("--json", dest="json_path", help="also write the per-family results as JSON")
    args = parser.parse_args(argv)
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING)
    # Warm-up: imports and the references' own analyses are not counted per family.
    analyze_hf_model(AnalyzeInput(source="qwen2"))
    types = args.model_types or decoder_only_candidates()
    rows, refused, failed = [], [], []
    for model_type in types:
        started = time.perf_counter()
        try:
            report = analyze_hf_model(AnalyzeInput(source=model_type))
        except AnalysisError as exc:
            refused.append((model_type, str(exc)))
            continue
        except Exception as exc:
            failed.append((model_type, f"{type(exc).__name__}: {exc}"))
            continue
        seconds = time.perf_counter() - started
        rows.append(
            (model_type, report.reference, len(report.deltas), len(report.unsupported), seconds, report.unsupported)
        )
    out = sys.stdout
    out.write(f"{'model_type':28} {'ref':6} {'deltas':>6} {'unsup':>5} {'sec':>6}\n")
    for model_type, reference, n_deltas, n_unsupported, seconds, _ in rows:
        out.write(f"{model_type:28} {reference:6} {n_deltas:6d} {n_unsupported:5d} {seconds:6.2f}\n")
    out.write("\nrefused (not decoder-only attention LMs, or not buildable):\n")
    for model_type, message in refused:
        out.write(f"  {model_type}: {message[:160]}\n")
    if failed:
        out.write("\nFAILED:\n")
        for model_type, message in failed:
            out.write(f"  {model_type}: {message[:300]}\n")
    slowest = max(rows, key=lambda r: r[4]) if rows else None
    clean = sum(1 for r in rows if r[3] == 0)
    out.write(
        f"\nanalysed {len(rows)} families, {clean} with no unsupported feature, refused {len(refused)}, "
        f"failed {len(failed)}; slowest {slowest[0]} {slowest[4]:.2f}s\n"
        if slowest
        else "\nnothing analysed\n"
    )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "analysed": [
                        {
                            "model_type": r[0],
                            "reference": r[1],
                            "deltas": r[2],
                            "unsupported": r[5],
                            "seconds": round(r[4], 3),
                        }
                        for r in rows
                    ],
                    "refused": dict(refused),
                    "failed": dict(failed),
                },
                handle,
                indent=1,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
