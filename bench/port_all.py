"""`archon-port add` for every family the analyser accepts, each in a scratch clone; a table of results.

Each family is ported in its own clone of the repository's HEAD (``git clone --shared``
into a temporary directory, so the real repository is only read) by its own Python
process running ``skill.porting.port_model.run_port`` from that clone. Whatever the port
does (passes, refuses, fails at a step, raises) is one row of the table:

    family  reference  reached  result  seconds

``result`` is ``ported``, ``refused: <features>``, ``failed at <step>: <reason>`` or
``crashed: <exception>`` (an exception out of ``run_port``, a step that died of a
programming error such as ``AttributeError``, or a worker that died or ran out of time).
Uncommitted changes are not swept: commit them first.

The clone is thrown away, so a family whose package is committed is ported with
``overwrite``: the row says whether the engine ported it, and ``committed`` whether what it
wrote is the committed package byte for byte (``same``), differs from it (``differs:
<files>``: under another transformers the engine measures another fact, and ``add`` without
``--overwrite`` refuses to replace the package), or is new (``new``; ``-`` where nothing
was written).

    python bench/port_all.py [--families llama,gpt2] [--jobs N] [--stages 1,2,3,4,5,6] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

logger = logging.getLogger("bench.port_all")

REPO = Path(__file__).resolve().parents[1]
ALL_STAGES = [1, 2, 3, 4, 5, 6]
# run_port reports a step's exception as "<Type>: <message>". These types are bugs in the
# engine, never a refusal or a reasoned failure, so the sweep counts them as crashes.
BUG_EXCEPTIONS = frozenset(
    {
        "AssertionError",
        "AttributeError",
        "ImportError",
        "IndexError",
        "KeyError",
        "ModuleNotFoundError",
        "NameError",
        "NotImplementedError",
        "RecursionError",
        "TypeError",
        "UnboundLocalError",
        "ZeroDivisionError",
    }
)
Outcome = Literal["ported", "refused", "failed", "crashed"]


class FamilyRow(BaseModel):
    """One family's sweep result."""

    family: str
    reference: str | None = None
    reached: str = Field(default="", description="the last step or stage that ran")
    outcome: Outcome
    detail: str = Field(default="", description="refused features, the failed step's reason, or the exception")
    seconds: float = 0.0
    committed: str = Field(
        default="-", description="what was written against the committed package: same, differs: <files>, new, or -"
    )

    @property
    def result(self) -> str:
        match self.outcome:
            case "ported":
                return "ported"
            case "refused":
                return f"refused: {self.detail}"
            case "failed":
                return f"failed at {self.reached}: {self.detail}"
            case _:
                return f"crashed: {self.detail}" + (f" (in {self.reached})" if self.reached else "")


# --- the worker: one family, in the clone it runs from --------------------------------------


def _refused_features(result: object) -> list[str] | None:
    """The features a refusal names, or ``None`` when the port was not refused."""
    features = getattr(result, "unsupported", None)
    if features:
        return list(features)
    error = getattr(result, "error", None) or ""
    marker = "no edit supports: "
    if marker not in error or getattr(result, "changed_files", None):
        return None
    named = error.split(marker, 1)[1].split(". Nothing was written", 1)[0]
    return [f.strip() for f in named.split(", ") if f.strip()]


def port_one(family: str, stages: list[int], workspace: Path) -> FamilyRow:
    """Run ``run_port`` on ``family`` in ``workspace``; every exception becomes a ``crashed`` row."""
    start = time.perf_counter()
    try:
        from skill.porting.port_model import PortModelRequest, run_port

        result = run_port(PortModelRequest(source=family, stages=stages, workspace=workspace, overwrite=True))
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({Path(frame.filename).name}:{frame.lineno})"
        return FamilyRow(
            family=family,
            outcome="crashed",
            reached="",
            detail=f"{type(exc).__name__}: {exc}{where}",
            seconds=time.perf_counter() - start,
        )
    reached = result.steps[-1].step if result.steps else ""
    seconds = time.perf_counter() - start
    if result.passed:
        return FamilyRow(
            family=family,
            reference=result.reference,
            reached=reached,
            outcome="ported",
            seconds=seconds,
            committed=against_committed(workspace, result.model_name, result.changed_files),
        )
    refused = _refused_features(result)
    if refused is not None:
        return FamilyRow(
            family=family,
            reference=result.reference,
            reached=result.failed_step or reached,
            outcome="refused",
            detail=", ".join(refused),
            seconds=seconds,
        )
    error = result.error or ""
    crashed = error.split(":", 1)[0] in BUG_EXCEPTIONS
    return FamilyRow(
        family=family,
        reference=result.reference,
        reached=result.failed_step or reached,
        outcome="crashed" if crashed else "failed",
        detail=error,
        seconds=seconds,
    )


def against_committed(workspace: Path, model_name: str, changed_files: list[str]) -> str:
    """``same``, ``differs: <files>`` or ``new``: the package just written against HEAD's (``-``: nothing written)."""
    package = f"archon_models/{model_name}"
    tracked = subprocess.run(
        ["git", "-C", str(workspace), "ls-files", "--", package], check=True, capture_output=True, text=True
    ).stdout.split()
    if not tracked:
        return "new" if changed_files else "-"
    differing = subprocess.run(
        ["git", "-C", str(workspace), "diff", "--name-only", "HEAD", "--", package],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not differing:
        return "same"
    return "differs: " + ", ".join(path.removeprefix(package + "/") for path in differing)


def worker_main(family: str, stages: list[int], out: Path) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    row = port_one(family, stages, Path.cwd())
    out.write_text(row.model_dump_json(), encoding="utf-8")
    return 0


# --- the driver: clones, processes, table ---------------------------------------------------


def head_commit(repo: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def scratch_clone(repo: Path, commit: str, target: Path) -> None:
    """A clone of ``commit`` at ``target`` that borrows ``repo``'s objects and writes nothing there."""
    subprocess.run(
        ["git", "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(target)],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["git", "-C", str(target), "checkout", "--quiet", "--detach", commit], check=True, capture_output=True
    )


def run_family(repo: Path, commit: str, family: str, stages: list[int], timeout_s: float) -> FamilyRow:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"port-all-{family}-") as tmp:
        clone = Path(tmp) / "repo"
        try:
            scratch_clone(repo, commit, clone)
        except subprocess.CalledProcessError as exc:
            return FamilyRow(family=family, outcome="crashed", detail=f"git clone failed: {exc.stderr!r}")
        out = Path(tmp) / "row.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", family, "--out", str(out)]
        command += ["--stages", ",".join(map(str, stages))]
        # The clone first: the engine, archon_models and the stage tests all come from it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(clone), os.environ.get("PYTHONPATH")) if p)}
        try:
            proc = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return FamilyRow(
                family=family,
                outcome="crashed",
                detail=f"ran past {timeout_s:.0f}s",
                seconds=time.perf_counter() - start,
            )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return FamilyRow(
                family=family,
                outcome="crashed",
                detail=f"worker exited {proc.returncode}: {tail}",
                seconds=time.perf_counter() - start,
            )
        return FamilyRow.model_validate_json(out.read_text(encoding="utf-8"))


def accepted_families() -> list[str]:
    """Every candidate family the analyser accepts (as ``bench/analyze_all.py`` enumerates them)."""
    from skill.analysis import AnalysisError, AnalyzeInput, analyze_hf_model, decoder_only_candidates

    accepted = []
    for model_type in decoder_only_candidates():
        try:
            analyze_hf_model(AnalyzeInput(source=model_type))
        except AnalysisError:
            continue
        except Exception:
            logger.warning("the analyser crashed on %s; sweeping it anyway", model_type, exc_info=True)
        accepted.append(model_type)
    return accepted


def format_table(rows: list[FamilyRow]) -> str:
    header = ("family", "reference", "reached", "result", "committed", "seconds")
    cells = [
        (r.family, r.reference or "-", r.reached or "-", r.result[:140], r.committed[:60], f"{r.seconds:.1f}")
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(cell, widths, strict=True)) for cell in cells]
    counts = {
        outcome: sum(r.outcome == outcome for r in rows) for outcome in ("ported", "refused", "failed", "crashed")
    }
    lines.append("")
    lines.append(f"{len(rows)} families: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items()))
    differing = [r.family for r in rows if r.committed.startswith("differs")]
    if differing:
        lines.append(f"written otherwise than committed: {', '.join(differing)}")
    return "\n".join(lines)


def _stages(text: str) -> list[int]:
    stages = sorted({int(s) for s in text.split(",") if s.strip()})
    bad = [s for s in stages if s not in ALL_STAGES]
    if bad:
        raise argparse.ArgumentTypeError(f"stages {bad} do not exist; stages are 1 to 6")
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--families", help="comma-separated model_types (default: every family the analyser accepts)")
    parser.add_argument("--jobs", type=int, default=1, help="families ported at once, each in its own process")
    parser.add_argument("--stages", type=_stages, default=ALL_STAGES, help="stages to run after writing (default 1-6)")
    parser.add_argument("--json", dest="json_path", type=Path, help="also write the rows as JSON")
    parser.add_argument("--repo", type=Path, default=REPO, help="repository whose HEAD is swept (default: this one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one family may take")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.worker is None else logging.WARNING, format="%(message)s")
    if args.worker is not None:
        return worker_main(args.worker, args.stages, args.out)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else accepted_families()
    commit = head_commit(args.repo)
    logger.info("porting %d families from %s at %s, %d at a time", len(families), args.repo, commit[:10], args.jobs)
    rows: dict[str, FamilyRow] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(run_family, args.repo, commit, family, args.stages, args.timeout): family for family in families
        }
        for future in as_completed(futures):
            row = future.result()
            rows[row.family] = row
            logger.info("%-24s %s (%.1fs)", row.family, row.result[:160], row.seconds)
    ordered = [rows[f] for f in families]
    sys.stdout.write(format_table(ordered) + "\n")
    if args.json_path:
        payload = {
            "commit": commit,
            "stages": args.stages,
            "rows": [r.model_dump() | {"result": r.result} for r in ordered],
        }
        args.json_path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 1 if any(r.outcome == "crashed" for r in ordered) else 0


if __name__ == "__main__":
    sys.exit(main())
