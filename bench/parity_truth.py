"""Measures what stage 4's judgement against a float64 truth rests on, over committed families.

For every case of every ``tests/archon/test_<family>.py`` (or ``--families``), the stage-4
setup (a seeded tiny HF model saved with ``save_pretrained``, the Archon package loaded from
those files, the case's packed documents) runs four ways: HF fp32, HF float64 (the truth),
Archon fp32 (``varlen`` and ``sdpa``) and Archon float64. For every compared tensor (the
logits of one sequence, of the packed documents, the loss, and the gradient of every
checkpoint key) it records

- ``archon``: max |Archon fp32 - truth| (the worse of the two attention backends),
- ``hf``: max |HF fp32 - truth|, HF's own fp32 error,
- ``archon64``: max |Archon float64 - truth|, or why the float64 run could not run,
- ``scale``: max |truth|,

and prints, per kind of tensor, the min / median / max of ``archon / hf`` and of
``archon64 / hf`` and of the share of its bound each run used under the rule of
``skill.harness.truth`` (``--ratio`` and ``--floor-ulps`` try other constants), the tensors
nearest their bounds, and how many fall outside.

    python bench/parity_truth.py --json /tmp/parity_truth.json
    python bench/parity_truth.py --families llama,qwen2 --override initializer_range=1.0
    python bench/parity_truth.py --summarise /tmp/parity_truth.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skill.harness.case import ModelCase
from skill.harness.compare import max_abs_diff
from skill.harness.models import build_hf_config, build_hf_model, load_archon_model, save_hf_checkpoint
from skill.harness.parity import (
    Reference,
    archon_outputs,
    hf_reference,
    load_archon_float64,
    parity_inputs,
    truth_reference,
)
from skill.harness.truth import (
    ERROR_RATIO,
    FLOAT64_ERROR_RATIO,
    FLOAT64_FLOOR_ULPS,
    FLOOR_ULPS,
    FP32_EPS,
    float64_default,
)

logger = logging.getLogger("bench.parity_truth")
ROOT = Path(__file__).resolve().parents[1]


def committed_cases(families: list[str] | None) -> list[ModelCase]:
    """The CASES of every generated stage-test file (those that call run_parity_stage)."""
    cases: list[ModelCase] = []
    for path in sorted((ROOT / "tests" / "archon").glob("test_*.py")):
        family = path.stem.removeprefix("test_")
        if families is not None and family not in families:
            continue
        if "run_parity_stage" not in path.read_text():
            continue
        module = importlib.import_module(f"tests.archon.{path.stem}")
        cases.extend(getattr(module, "CASES", []))
    return cases


def _tensors(ref: Reference) -> dict[str, torch.Tensor]:
    named = {"logits/single": ref.single_logits, "logits/packed": ref.packed_logits, "loss": ref.loss}
    named.update((f"grad/{key}", grad) for key, grad in ref.grads.items())
    return named


def measure_case(case: ModelCase) -> dict[str, Any]:
    """Every compared tensor's errors for one case (see the module docstring)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="parity-truth-") as tmp:
        folder = Path(tmp)
        hf_config = build_hf_config(case)
        hf_model = build_hf_model(case, hf_config)
        checkpoint = save_hf_checkpoint(hf_model, folder / "hf")
        inputs = parity_inputs(case, hf_config)
        hf = _tensors(hf_reference(hf_model, inputs, folder / "g32"))
        with float64_default():
            truth = _tensors(truth_reference(hf_model, inputs, folder / "g64"))
        archon = [
            _tensors(archon_outputs(load_archon_model(hf_config, checkpoint, attn_type=attn), inputs))
            for attn in ("varlen", "sdpa")
        ]
        archon64: dict[str, torch.Tensor] | None
        float64_error = None
        try:
            with float64_default():
                archon64 = _tensors(archon_outputs(load_archon_float64(hf_config, checkpoint), inputs))
        except Exception as exc:  # a package that cannot run in float64: recorded, not fatal
            archon64, float64_error = None, f"{type(exc).__name__}: {exc}"
    rows = []
    for name, true in truth.items():
        rows.append(
            {
                "tensor": name,
                "numel": true.numel(),
                "scale": float(true.abs().max()) if true.numel() else 0.0,
                "hf": max_abs_diff(hf[name], true),
                "archon": max(max_abs_diff(side[name], true) for side in archon),
                "archon64": None if archon64 is None else max_abs_diff(archon64[name], true),
            }
        )
    return {
        "case": case.id,
        "model_type": case.model_type,
        "overrides": case.config_overrides,
        "float64_error": float64_error,
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }


def _kind(tensor: str) -> str:
    return tensor.split("/", 1)[0]


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"min {min(values):.3g}  median {statistics.median(values):.3g}  max {max(values):.3g}  (n={len(values)})"


def _bounded(results: list[dict[str, Any]], ratio: float, floor_ulps: float, ratio64: float, floor64: float):
    """Every row with its fp32 and float64 bounds under the rule of ``skill.harness.truth``
    (with these constants): the floor's scale is the tensor's own for logits and the loss, the
    largest gradient's for a gradient."""
    for result in results:
        grads = [row["scale"] for row in result["rows"] if _kind(row["tensor"]) == "grad"]
        largest_grad = max(grads, default=0.0)
        for row in result["rows"]:
            scale = largest_grad if _kind(row["tensor"]) == "grad" else row["scale"]
            bound = ratio * row["hf"] + floor_ulps * FP32_EPS * scale
            bound64 = ratio64 * row["hf"] + floor64 * FP32_EPS * scale
            yield result["case"], row, bound, bound64


def _share(error: float, bound: float) -> float:
    return error / bound if bound > 0 else (0.0 if error == 0 else float("inf"))


def summarise(
    results: list[dict[str, Any]],
    ratio: float = ERROR_RATIO,
    floor_ulps: float = FLOOR_ULPS,
    ratio64: float = FLOAT64_ERROR_RATIO,
    floor64: float = FLOAT64_FLOOR_ULPS,
) -> str:
    """Ratios per kind of tensor, the share of its bound each run used, and what fails."""
    rows = list(_bounded(results, ratio, floor_ulps, ratio64, floor64))
    rule = f"fp32: error <= {ratio:g} x HF's + {floor_ulps:g} fp32 ulps of the scale"
    lines = [f"{len(results)} cases; {rule}; float64 run: <= {ratio64:g} x HF's + {floor64:g} ulps"]
    for kind in ("logits", "loss", "grad"):
        mine = [(case, row, b, b64) for case, row, b, b64 in rows if _kind(row["tensor"]) == kind]
        with_error = [row for _, row, _, _ in mine if row["hf"] > 0]
        lines.append(f"{kind}: archon/hf {_stats([row['archon'] / row['hf'] for row in with_error])}")
        ran64 = [row for row in with_error if row["archon64"] is not None]
        lines.append(f"{kind}: archon64/hf {_stats([row['archon64'] / row['hf'] for row in ran64])}")
        lines.append(f"{kind}: share of the fp32 bound {_stats([_share(row['archon'], b) for _, row, b, _ in mine])}")
        lines.append(
            f"{kind}: share of the float64 bound "
            + _stats([_share(row["archon64"], b64) for _, row, _, b64 in mine if row["archon64"] is not None])
        )
    nearest = sorted(rows, key=lambda item: -_share(item[1]["archon"], item[2]))[:8]
    lines.append("fp32 nearest the bound:")
    lines.extend(
        f"  {case} {row['tensor']}: archon {row['archon']:.3e} hf {row['hf']:.3e} bound {b:.3e}"
        for case, row, b, _ in nearest
    )
    ran = [item for item in rows if item[1]["archon64"] is not None]
    nearest64 = sorted(ran, key=lambda item: -_share(item[1]["archon64"], item[3]))[:8]
    lines.append("float64 run nearest the bound:")
    lines.extend(
        f"  {case} {row['tensor']}: archon64 {row['archon64']:.3e} hf {row['hf']:.3e} bound {b64:.3e}"
        for case, row, _, b64 in nearest64
    )
    outside = sum(row["archon"] > b for _, row, b, _ in rows)
    outside64 = sum(row["archon64"] is not None and row["archon64"] > b64 for _, row, _, b64 in rows)
    lines.append(f"outside the bound: {outside} fp32 tensors, {outside64} float64 tensors of {len(rows)}")
    unrun = [f"  {r['case']}: {r['float64_error']}" for r in results if r["float64_error"]]
    lines.append(f"{len(unrun)} cases whose Archon package could not run in float64")
    lines.extend(unrun)
    return "\n".join(lines)


def _override(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    return key, json.loads(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated families (default: every committed one)")
    parser.add_argument("--override", action="append", default=[], help="key=json set on every case's config")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--summarise", type=Path, nargs="+", help="only summarise these JSON files")
    parser.add_argument("--ratio", type=float, default=ERROR_RATIO, help="try another fp32 ratio")
    parser.add_argument("--floor-ulps", type=float, default=FLOOR_ULPS, help="try another fp32 floor")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    if args.summarise:
        results = [r for path in args.summarise for r in json.loads(path.read_text())]
        sys.stdout.write(summarise(results, args.ratio, args.floor_ulps) + "\n")
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    families = args.families.split(",") if args.families else None
    overrides = dict(_override(o) for o in args.override)
    results = []
    for case in committed_cases(families):
        if overrides:
            case = case.model_copy(update={"config_overrides": {**case.config_overrides, **overrides}})
        try:
            results.append(measure_case(case))
            logger.info("%s: %.1fs", case.id, results[-1]["seconds"])
        except Exception as exc:
            logger.warning("%s: %s: %s", case.id, type(exc).__name__, exc)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    sys.stdout.write(summarise(results, args.ratio, args.floor_ulps) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
