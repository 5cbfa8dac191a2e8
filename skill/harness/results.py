"""Structured stage results: pass/fail per check, numbers, time.

The porting engine (``run_test_stage``, ``locate_divergence``) reads these objects, so
a failing stage is both a result and an ``AssertionError`` carrying that result.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable

from pydantic import BaseModel, Field, computed_field

from skill.harness.case import ModelCase

logger = logging.getLogger(__name__)

STAGE_NAMES = {
    1: "args",
    2: "adapter",
    3: "completeness",
    4: "parity",
    5: "distributed",
    6: "checkpoint",
}


class CheckResult(BaseModel):
    """One named check inside a stage.

    A check judged against a float64 truth (``skill.harness.truth``) also carries the
    result's error against that truth, the reference's own (HF fp32's, or one process's in
    stage 5) and their ratio, and the dtype the judged side ran in.
    """

    name: str
    passed: bool
    detail: str = ""
    max_abs_diff: float | None = None
    error_vs_truth: float | None = Field(default=None, description="max |result - float64 truth|")
    reference_error_vs_truth: float | None = Field(
        default=None, description="max |reference fp32 - float64 truth|: the reference's own rounding error"
    )
    allowed_error: float | None = Field(default=None, description="the largest error_vs_truth the rule allows")
    run_dtype: str | None = Field(default=None, description="the judged side's dtype: float32, or float64")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def error_ratio(self) -> float | None:
        """``error_vs_truth / reference_error_vs_truth`` (inf when only the reference is exact)."""
        if self.error_vs_truth is None or self.reference_error_vs_truth is None:
            return None
        if self.reference_error_vs_truth == 0:
            return 0.0 if self.error_vs_truth == 0 else math.inf
        return self.error_vs_truth / self.reference_error_vs_truth

    def share_of_bound(self) -> float | None:
        """``error_vs_truth / allowed_error``: above 1 fails; how near a passing check came."""
        if self.error_vs_truth is None or self.allowed_error is None:
            return None
        if self.allowed_error == 0:
            return 0.0 if self.error_vs_truth == 0 else math.inf
        return self.error_vs_truth / self.allowed_error

    def line(self) -> str:
        mark = "ok  " if self.passed else "FAIL"
        diff = "" if self.max_abs_diff is None else f" (max abs diff {self.max_abs_diff:.3e})"
        truth = ""
        if self.error_vs_truth is not None and self.reference_error_vs_truth is not None:
            side = "float64 run" if self.run_dtype == "float64" else "error"
            truth = (
                f" [{side} vs float64 truth {self.error_vs_truth:.3e}, reference's {self.reference_error_vs_truth:.3e},"
                f" ratio {self.error_ratio:.3g}, {self.share_of_bound():.2f} of the bound]"
            )
        detail = f": {self.detail}" if self.detail else ""
        return f"[{mark}] {self.name}{diff}{truth}{detail}"


class StageResult(BaseModel):
    """The outcome of one stage for one case. A stage with no checks did not pass."""

    stage: int
    stage_name: str
    case_id: str
    model_type: str
    checks: list[CheckResult] = Field(default_factory=list)
    seconds: float = 0.0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def max_abs_diff(self) -> float | None:
        diffs = [c.max_abs_diff for c in self.checks if c.max_abs_diff is not None]
        return max(diffs) if diffs else None

    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.passed]

    def max_abs_diff_of(self, prefix: str) -> float | None:
        """The largest diff among checks whose name starts with ``prefix`` (e.g. ``"logits"``)."""
        diffs = [c.max_abs_diff for c in self.checks if c.name.startswith(prefix) and c.max_abs_diff is not None]
        return max(diffs) if diffs else None

    def worst_truth_check(self, run_dtype: str = "float32") -> CheckResult | None:
        """Of the checks judged against a float64 truth whose result ran in ``run_dtype``, the
        one nearest its bound (``None`` when no check was judged so)."""
        judged = [c for c in self.checks if c.run_dtype == run_dtype and c.share_of_bound() is not None]
        return max(judged, key=lambda c: c.share_of_bound() or 0.0, default=None)

    def report(self) -> str:
        head = (
            f"stage {self.stage} ({self.stage_name}) for {self.case_id}: "
            f"{'passed' if self.passed else 'FAILED'} in {self.seconds:.2f}s"
        )
        if not self.checks:
            return head + "\n  no checks ran; a stage that checks nothing fails"
        return "\n".join([head, *("  " + c.line() for c in self.checks)])


class StageFailure(AssertionError):
    """Raised by a stage that did not pass; ``.result`` holds the full result."""

    def __init__(self, result: StageResult):
        self.result = result
        failed = result.failures() or result.checks
        lines = [
            f"stage {result.stage} ({result.stage_name}) failed for {result.case_id}:",
            *("  " + c.line() for c in failed),
        ]
        if not result.checks:
            lines.append("  no checks ran; a stage that checks nothing fails")
        super().__init__("\n".join(lines))


class StageRecorder:
    """Collects the checks of one running stage."""

    def __init__(self, case: ModelCase, stage: int):
        self.case = case
        self.stage = stage
        self.checks: list[CheckResult] = []
        self._start = time.perf_counter()

    def add(self, check: CheckResult) -> CheckResult:
        self.checks.append(check)
        return check

    def check(self, name: str, passed: bool, detail: str = "", max_abs_diff: float | None = None) -> CheckResult:
        if max_abs_diff is not None and math.isnan(max_abs_diff):
            passed = False
        return self.add(CheckResult(name=name, passed=passed, detail=detail, max_abs_diff=max_abs_diff))

    def finish(self) -> StageResult:
        return StageResult(
            stage=self.stage,
            stage_name=STAGE_NAMES.get(self.stage, f"stage{self.stage}"),
            case_id=self.case.id,
            model_type=self.case.model_type,
            checks=list(self.checks),
            seconds=time.perf_counter() - self._start,
        )


def run_stage(
    case: ModelCase,
    stage: int,
    body: Callable[[StageRecorder], None],
    raise_on_failure: bool = True,
) -> StageResult:
    """Run ``body`` and turn whatever it found, or the exception it raised, into a result.

    An exception inside the stage (an adapter raising on a key, a shape error in the
    forward) becomes a failed check naming it, so the engine still gets a result; with
    ``raise_on_failure`` the failure is raised with the original exception chained.
    """
    recorder = StageRecorder(case, stage)
    error: BaseException | None = None
    try:
        body(recorder)
    except Exception as exc:
        error = exc
        where = traceback.extract_tb(exc.__traceback__)[-1]
        recorder.check(
            "stage raised",
            False,
            f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})",
        )
    result = recorder.finish()
    logger.info("%s", result.report())
    if raise_on_failure and not result.passed:
        raise StageFailure(result) from error
    return result
