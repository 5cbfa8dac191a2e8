"""The architecture fuzzer: random remote-code families, each ported with `add --trust-remote-code`.

For every seed, a worker process running from its own scratch clone of the repository's
HEAD (``git clone --shared``: the real repository is only read) draws the seed's family
(``tests/fuzz``: a point of the engine's feature vocabulary), writes it as a checkpoint
folder the way a model author publishes remote code (``config.json`` with ``auto_map``,
``configuration_<name>.py``, ``modeling_<name>.py``, safetensors weights of realistic
magnitude), proves the generated model itself right (``tests.fuzz.check_family``), then
runs ``port_model`` on the folder with ``trust_remote_code`` in the clone (what
``archon-port add <folder> --trust-remote-code`` runs). Each seed is one row:

    seed  outcome  reached  features  detail

``outcome`` is ``ported``; ``refused`` (the analysis named the features no edit
supports, nothing written); ``failed`` (a step or stage failed, with its reason);
``tolerance`` (stage 4 failed only on the folder's own, realistic weights, by no more than
``TOLERANCE_FACTOR`` times HF's own fp32 error against float64 on the same folder: the
fixed 1e-5 tolerance, not the port); ``crashed`` (an exception out of the engine, a step
that died of a programming error, a worker that died or ran out of time); or
``generator`` (the generated family failed its own self-check: a bug of the fuzzer).

    nice -n 10 python bench/fuzz_families.py --seeds 0-9 [--stages 1,2,3,4,5,6] [--jsonl OUT.jsonl] [--resume]

One seed at a time by default (``--jobs``): a port takes 30-120 s on two cores.
Uncommitted changes are not fuzzed: commit them first.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Literal

# The catalogue sweep's clone, refusal and crash rules: a fuzzed family is judged as a catalogue family is.
from port_all import ALL_STAGES, BUG_EXCEPTIONS, _refused_features, head_commit, scratch_clone
from pydantic import BaseModel, Field

logger = logging.getLogger("bench.fuzz_families")

REPO = Path(__file__).resolve().parents[1]
# Stage 4 on the folder's own weights fails by "tolerance" when Archon's error is within
# this factor of HF's own fp32 error against its float64 forward on the same folder.
TOLERANCE_FACTOR = 10.0
OWN_WEIGHTS = "source folder's own weights"
Outcome = Literal["ported", "refused", "failed", "tolerance", "crashed", "generator"]
OUTCOMES: tuple[Outcome, ...] = ("ported", "refused", "failed", "tolerance", "crashed", "generator")


class SeedRow(BaseModel):
    """One seed's result."""

    seed: int
    name: str = ""
    features: dict[str, str] = Field(default_factory=dict)
    outcome: Outcome
    reached: str = Field(default="", description="the last step or stage that ran")
    reference: str | None = None
    detail: str = Field(default="", description="refused features, the failed step's reason, or the exception")
    max_abs_logit_diff: float | None = None
    divergence: str = Field(default="", description="a failed stage: the first module whose output differs")
    hf_fp32_error: float | None = Field(default=None, description="HF fp32 vs float64 logits on the folder")
    seconds: float = 0.0

    def feature_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.features.items())


# --- the worker: one seed, in the clone it runs from ------------------------------------------


def hf_fp32_error(folder: Path, vocab_size: int, seed: int) -> float:
    """Max |logits| difference of the folder's HF model in fp32 against float64, on random tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(3, vocab_size, (1, 24), generator=torch.Generator().manual_seed(seed))
    logits = []
    for dtype in (torch.float32, torch.float64):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), trust_remote_code=True, dtype=dtype, attn_implementation="eager", local_files_only=True
        ).eval()
        with torch.no_grad():
            logits.append(model(input_ids=tokens).logits.double())
    return float((logits[0] - logits[1]).abs().max())


def first_divergence(workspace: Path, model_name: str) -> str:
    """``archon-port diverge``: the first Archon module whose output differs from HF's, in words."""
    try:
        from skill.porting.locate_divergence import LocateDivergenceRequest, locate_divergence

        found = locate_divergence(LocateDivergenceRequest(model_name=model_name, workspace=workspace))
    except Exception as exc:
        return f"diverge raised {type(exc).__name__}: {exc}"[:300]
    first = found.first_divergence
    if first is None:
        return f"no module diverges (logits {found.logits_max_abs_diff:.2e})"
    return f"{first.archon_module} (HF {first.hf_module}) by {first.max_abs_diff:.2e}"


def _own_weight_failures(result) -> list[float] | None:  # type: ignore[no-untyped-def]
    """The max abs diffs of stage 4's failing checks when the port failed there first and
    every failing check is on the folder's own weights."""
    if result.failed_step != "stage 4":
        return None
    stage4 = next((r for r in result.stage_results if r.stage == 4), None)
    if stage4 is None:
        return None
    failing = [c for t in stage4.tests for c in t.checks if not c.passed]
    if not failing or not all(OWN_WEIGHTS in c.name for c in failing):
        return None
    return [c.max_abs_diff if c.max_abs_diff is not None else float("inf") for c in failing]


def port_seed(seed: int, stages: list[int], workspace: Path, scratch: Path) -> SeedRow:
    """Generate, self-check and port one seed in ``workspace``; every exception becomes a row."""
    from tests.fuzz import FamilyCheckError, check_family, sample_family, write_family

    start = time.perf_counter()
    spec = sample_family(seed)
    row = SeedRow(seed=seed, name=spec.name, features=spec.features(), outcome="crashed")
    folder = scratch / spec.name
    try:
        write_family(spec, folder)
        check_family(spec, folder)
    except (FamilyCheckError, Exception) as exc:  # any failure here is the generator's
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return row.model_copy(
            update={
                "outcome": "generator",
                "reached": "generate",
                "detail": f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})",
                "seconds": time.perf_counter() - start,
            }
        )
    try:
        from skill.porting.port_model import PortModelRequest, run_port

        result = run_port(
            PortModelRequest(source=str(folder), trust_remote_code=True, stages=stages, workspace=workspace)
        )
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return row.model_copy(
            update={
                "outcome": "crashed",
                "detail": f"{type(exc).__name__}: {exc} ({Path(where.filename).name}:{where.lineno})",
                "seconds": time.perf_counter() - start,
            }
        )
    reached = result.steps[-1].step if result.steps else ""
    update: dict = {
        "reference": result.reference,
        "reached": result.failed_step or reached,
        "max_abs_logit_diff": result.max_abs_logit_diff,
    }
    if result.passed:
        update["outcome"] = "ported"
    elif (refused := _refused_features(result)) is not None:
        update.update(outcome="refused", detail=", ".join(refused))
    else:
        error = result.error or ""
        update.update(outcome="crashed" if error.split(":", 1)[0] in BUG_EXCEPTIONS else "failed", detail=error)
        own = _own_weight_failures(result)
        if own is not None and update["outcome"] == "failed":
            update["hf_fp32_error"] = hf_fp32_error(folder, spec.vocab_size, seed)
            if max(own) <= TOLERANCE_FACTOR * update["hf_fp32_error"]:
                update["outcome"] = "tolerance"
        if update["outcome"] == "failed" and (result.failed_step or "").startswith("stage"):
            update["divergence"] = first_divergence(workspace, result.model_name)
    update["seconds"] = time.perf_counter() - start
    return row.model_copy(update=update)


def worker_main(seed: int, stages: list[int], out: Path) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{seed}-") as scratch:
        row = port_seed(seed, stages, Path.cwd(), Path(scratch))
    out.write_text(row.model_dump_json(), encoding="utf-8")
    return 0


# --- the driver: clones, processes, table --------------------------------------------------------


def run_seed(repo: Path, commit: str, seed: int, stages: list[int], timeout_s: float) -> SeedRow:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"fuzz-seed-{seed}-") as tmp:
        clone = Path(tmp) / "repo"
        try:
            scratch_clone(repo, commit, clone)
        except subprocess.CalledProcessError as exc:
            return SeedRow(seed=seed, outcome="crashed", detail=f"git clone failed: {exc.stderr!r}")
        out = Path(tmp) / "row.json"
        command = [sys.executable, str(clone / "bench" / "fuzz_families.py"), "--worker", str(seed), "--out", str(out)]
        command += ["--stages", ",".join(map(str, stages))]
        env = {
            **os.environ,
            # The clone first: the engine, the fuzzer, archon_models and the stage tests all come from it.
            "PYTHONPATH": os.pathsep.join(p for p in (str(clone), os.environ.get("PYTHONPATH")) if p),
            # The family's remote code is imported through a modules cache of this seed alone.
            "HF_MODULES_CACHE": str(Path(tmp) / "hf_modules"),
        }
        try:
            proc = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return SeedRow(
                seed=seed, outcome="crashed", detail=f"ran past {timeout_s:.0f}s", seconds=time.perf_counter() - start
            )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return SeedRow(
                seed=seed,
                outcome="crashed",
                detail=f"worker exited {proc.returncode}: {tail}",
                seconds=time.perf_counter() - start,
            )
        return SeedRow.model_validate_json(out.read_text(encoding="utf-8"))


def format_table(rows: list[SeedRow]) -> str:
    header = ("seed", "outcome", "reached", "features", "detail", "seconds")
    cells = [
        (
            str(r.seed),
            r.outcome,
            r.reached or "-",
            r.feature_line(),
            ((f"diverges at {r.divergence}; " if r.divergence else "") + r.detail)[:200] or "-",
            f"{r.seconds:.0f}",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def format_summary(rows: list[SeedRow]) -> str:
    counts = Counter(r.outcome for r in rows)
    total = len(rows) or 1
    lines = [
        f"{len(rows)} seeds: "
        + ", ".join(f"{counts.get(o, 0)} {o} ({100 * counts.get(o, 0) / total:.0f}%)" for o in OUTCOMES)
    ]
    for outcome in OUTCOMES[1:]:
        seeds = [str(r.seed) for r in rows if r.outcome == outcome]
        if seeds:
            lines.append(f"  {outcome}: seeds {', '.join(seeds)}")
    reasons = Counter(part.strip() for r in rows if r.outcome == "refused" for part in r.detail.split(", unsupported:"))
    if reasons:
        lines.append("refusals, by named feature:")
        lines += [f"  {n:3d}  {reason.removeprefix('unsupported: ')}" for reason, n in reasons.most_common()]
    return "\n".join(lines)


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            low, high = part.split("-", 1)
            seeds += range(int(low), int(high) + 1)
        elif part:
            seeds.append(int(part))
    return seeds


def _stages(text: str) -> list[int]:
    stages = sorted({int(s) for s in text.split(",") if s.strip()})
    bad = [s for s in stages if s not in ALL_STAGES]
    if bad:
        raise argparse.ArgumentTypeError(f"stages {bad} do not exist; stages are 1 to 6")
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=_seeds, default=_seeds("0-9"), help="seeds: 0-99 or 3,7,11 (default 0-9)")
    parser.add_argument("--jobs", type=int, default=1, help="seeds ported at once, each in its own process")
    parser.add_argument("--stages", type=_stages, default=ALL_STAGES, help="stages to run after writing (default 1-6)")
    parser.add_argument("--jsonl", type=Path, help="append each row as a JSON line as it finishes")
    parser.add_argument("--resume", action="store_true", help="skip the seeds the --jsonl file already holds")
    parser.add_argument("--repo", type=Path, default=REPO, help="repository whose HEAD is fuzzed (default: this one)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one seed may take")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.worker is None else logging.WARNING, format="%(message)s")
    if args.worker is not None:
        return worker_main(args.worker, args.stages, args.out)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    done: dict[int, SeedRow] = {}
    if args.resume and args.jsonl and args.jsonl.is_file():
        for line in args.jsonl.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = SeedRow.model_validate_json(line)
                done[row.seed] = row
    todo = [s for s in args.seeds if s not in done]
    commit = head_commit(args.repo)
    logger.info("fuzzing %d seeds from %s at %s, %d at a time", len(todo), args.repo, commit[:10], args.jobs)
    rows: dict[int, SeedRow] = {s: done[s] for s in args.seeds if s in done}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_seed, args.repo, commit, seed, args.stages, args.timeout): seed for seed in todo}
        for future in as_completed(futures):
            row = future.result()
            rows[row.seed] = row
            logger.info(
                "seed %-5d %-9s %s%s (%.0fs) %s",
                row.seed,
                row.outcome,
                row.detail[:140],
                f" [diverges at {row.divergence}]" if row.divergence else "",
                row.seconds,
                row.feature_line(),
            )
            if args.jsonl:
                with args.jsonl.open("a", encoding="utf-8") as handle:
                    handle.write(row.model_dump_json() + "\n")
    ordered = [rows[s] for s in args.seeds if s in rows]
    sys.stdout.write(format_table(ordered) + "\n\n" + format_summary(ordered) + "\n")
    return 1 if any(r.outcome in ("crashed", "generator") for r in ordered) else 0


if __name__ == "__main__":
    sys.exit(main())
