"""Step 10: run one stage of a package's tests in a pytest subprocess, with structured results."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel, Field, JsonValue, field_validator

import skill
from skill.codemod import StagedTree
from skill.porting.applied_edits import recorded_edits
from skill.porting.child_process import run_python_module, scratch_dir
from skill.porting.common import PackageLayout, PackageRequest, StepResult, require_package, staged, write_if_changed
from skill.porting.edit_args import nullable_cases
from skill.porting.hf_source import load_config
from skill.porting.model_edits import describe
from skill.porting.overrides import ConfigOverrides, ModelTypeName
from skill.porting.plan import plan_for
from skill.porting.test_file import add_override_case, carry_extra_cases, shown_layer_types, test_file_source

logger = logging.getLogger(__name__)

_ENGINE_ROOT = Path(skill.__file__).resolve().parents[1]

# Set by the stage tests' conftest on each test (skill.harness results as JSON).
RESULT_PROPERTY = "archon_stage_result"


# A max abs diff between fp32 results is rounding noise that differs between CPUs and
# thread counts, so a session replays a stage's checks (each passed against its tolerance),
# not these numbers: they are left out of the recorded result (volatile).
_DIFF_IS_VOLATILE: dict[str, JsonValue] = {"volatile": True}


class StageCheck(BaseModel):
    name: str
    passed: bool
    detail: str = ""
    max_abs_diff: float | None = Field(default=None, json_schema_extra=_DIFF_IS_VOLATILE)
    # A check judged against a float64 truth (skill.harness.truth): its error against that
    # truth, the reference's own (HF fp32's; one process's in stage 5), their ratio, the
    # largest error the rule allows, and the dtype the judged side ran in.
    error_vs_truth: float | None = Field(default=None, json_schema_extra=_DIFF_IS_VOLATILE)
    reference_error_vs_truth: float | None = Field(default=None, json_schema_extra=_DIFF_IS_VOLATILE)
    error_ratio: float | None = Field(default=None, json_schema_extra=_DIFF_IS_VOLATILE)
    allowed_error: float | None = Field(default=None, json_schema_extra=_DIFF_IS_VOLATILE)
    run_dtype: str | None = None


class StageTest(BaseModel):
    test: str
    outcome: str
    seconds: float = Field(json_schema_extra={"volatile": True})
    checks: list[StageCheck] = Field(default_factory=list)
    message: str = ""


class RunTestStageRequest(PackageRequest):
    stage: int = Field(description="stage number 1-6: args, adapter, completeness, parity, distributed, checkpoint")
    model_type: ModelTypeName | None = Field(
        default=None, description="HF model_type of the test case (default: model_name); a name, never a path"
    )
    config_overrides: ConfigOverrides = Field(
        default_factory=dict,
        description="config attributes set on the tiny HF config of both sides, to prove a feature a default "
        'hides (e.g. {"clip_qkv": 8.0}); added to the test file as an extra case (once) and only that case runs. '
        "Values are plain data (finite numbers, printable strings); sizes are bounded (widths 1024, counts 64, "
        "lengths 65536) so the test model stays tiny",
    )
    timeout_s: float = Field(default=600.0, gt=0)

    @field_validator("stage")
    @classmethod
    def _stage_range(cls, value: int) -> int:
        if value not in range(1, 7):
            raise ValueError(f"stage {value} does not exist; stages are 1 to 6.")
        return value


class RunTestStageResult(StepResult):
    stage: int
    test_file: str
    case_id: str | None = Field(
        default=None, description="the one case that ran (the overrides' case), else every case ran"
    )
    passed: bool = Field(
        description="every test of the stage passed: the field to read (a stage that ran and failed is still "
        "a result, not a tool error; the failing checks are in tests[].checks)"
    )
    tests: list[StageTest]
    max_abs_diff: float | None = Field(
        default=None, description="largest max abs diff of any check", json_schema_extra=_DIFF_IS_VOLATILE
    )
    seconds: float = Field(json_schema_extra={"volatile": True})
    output_tail: str = Field(default="", json_schema_extra={"volatile": True})
    # Volatile: it is worded from ``passed`` and the tests' outcomes and messages, which are compared.
    reason: str = Field(
        default="", description="why the stage did not pass (empty when it passed)", json_schema_extra=_DIFF_IS_VOLATILE
    )


def stage_verdict(tests: list[StageTest], returncode: int = 0) -> tuple[bool, str]:
    """Whether a stage passed, and why not.

    A stage passes when pytest succeeded and at least one of its tests ran and passed, and
    none failed: a stage whose every test was skipped proved nothing (a CUDA-only test on
    CPU, a case the installed transformers cannot build), and pytest's exit 5 (nothing
    collected) is no pass either.
    """
    if not tests:
        return False, f"no test of the stage ran (pytest exit {returncode})"
    bad = [t for t in tests if t.outcome not in ("passed", "skipped")]
    if bad:
        return False, f"{len(bad)} of {len(tests)} test(s) {bad[0].outcome}: {bad[0].test}"
    if not any(t.outcome == "passed" for t in tests):
        why = next((t.message for t in tests if t.message), "no reason given")
        return False, f"every test of the stage was skipped ({why}); a skipped stage proves nothing"
    if returncode != 0:
        return False, f"pytest exited {returncode}"
    return True, ""


def ensure_test_file(
    tree: StagedTree,
    model_name: str,
    model_type: str,
    source: str | None = None,
    trust_remote_code: bool = False,
    keep_cases_of: str | None = None,
) -> list[str]:
    """Stage ``tests/archon/test_<model>.py`` unless it exists; returns the paths written.
    ``keep_cases_of``: the text of a test file this one replaces, whose named extra cases
    are carried over."""
    layout = PackageLayout.for_name(model_name)
    require_package(tree, layout)
    if tree.exists(layout.test_file):
        return []
    if source is None:
        _require_known_model_type(model_type)
    profile = plan_for(source or model_type, trust_remote_code)
    config = load_config(source or model_type, trust_remote_code)
    rope_parameters = None
    if profile.rope_type != "default" or profile.layer_rotary_dims:
        # The checkpoint's scaling, or its layer types' rotated widths: what the tests prove.
        rope_parameters = dict(getattr(config, "rope_parameters", None) or {})
    # The config leaves the row HF never trains unset: the tests set one (see test_file_source).
    unset_pad = profile.padding_idx_field is not None and getattr(config, profile.padding_idx_field, None) is None
    applied = recorded_edits(tree.read_text(layout.model) or "")
    summary = " ".join(describe(profile, layout.names.camel, applied or ()).split()).split(": ", 1)[-1].rstrip(".")
    remote_source = str(Path(source).resolve()) if trust_remote_code and source else None
    text = test_file_source(
        layout.names.camel,
        model_type,
        profile,
        summary,
        rope_parameters,
        remote_source,
        unset_pad=unset_pad,
        nullable=nullable_cases(profile, config),
        # The tests' tiny model starts from the folder's own code's config, or the class default.
        layer_types=shown_layer_types(profile, config, config if remote_source else load_config(model_type)),
    )
    from skill.porting.provenance import header_lines, stamp

    pristine = tree.read_text(PackageLayout.for_name(profile.reference).model) or ""
    text = stamp(text, header_lines(profile, model_name, pristine, applied))
    if keep_cases_of:
        text = carry_extra_cases(keep_cases_of, text)
    changed: list[str] = []
    write_if_changed(tree, layout.test_file, text, changed)
    return changed


def _require_known_model_type(model_type: str) -> None:
    """A test file written from a model_type alone reads that family's config from transformers:
    ``model_type`` must be one it knows, never a name that could resolve to a folder on disk."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(
            f"model_type {model_type!r} is not a model_type of the installed transformers, and the package has no "
            "test file to take its case from; pass one transformers knows (or port the family with port_model)"
        )


def run_test_stage(request: RunTestStageRequest) -> RunTestStageResult:
    """Run stage N (1 args, 2 adapter, 3 completeness, 4 parity, 5 distributed, 6 checkpoint)
    of archon_models/<model_name>/'s tests with pytest in a subprocess, writing the package's
    test file under tests/archon/ first if it is missing. With config_overrides, adds a case
    with them to that file (once) and runs only it. Returns pass/fail per check, the max abs
    diffs and the time. A stage that ran is a result whether it passed or not (isError false):
    read `passed`, then `tests[].checks[]` (name, passed, detail) for what failed; isError is
    true only when the stage could not run (bad arguments, no package, a timeout)."""
    model_type = request.model_type or request.model_name
    layout = PackageLayout.for_name(request.model_name)
    case = None
    with staged(request.workspace) as tree:
        written = ensure_test_file(tree, request.model_name, model_type)
        root = tree.workspace.root
        if request.config_overrides:
            text = tree.read_text(layout.test_file) or ""
            new_text, case = add_override_case(text, request.model_type, request.config_overrides)
            write_if_changed(tree, layout.test_file, new_text, written)
    result = run_stage_subprocess(root, request.model_name, request.stage, request.timeout_s, case_id=case)
    return result.model_copy(update={"changed_files": written})


def run_stage_subprocess(
    root: Path, model_name: str, stage: int | list[int], timeout_s: float = 600.0, case_id: str | None = None
) -> RunTestStageResult:
    """Run the stage(s) of a package's test file in one pytest subprocess (every case, or ``case_id``'s)."""
    stages = [stage] if isinstance(stage, int) else list(stage)
    marker = " or ".join(f"stage{s}" for s in stages)
    layout = PackageLayout.for_name(model_name)
    test_path = root / layout.test_file
    if not test_path.is_file():
        raise FileNotFoundError(f"{layout.test_file} does not exist; run_test_stage writes it, or run port_model.")
    with scratch_dir("archon-port-stage") as tmp:
        report = tmp / "report.xml"
        argv = [
            str(test_path),
            "-m",
            marker,
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--junitxml={report}",
            "-o",
            "junit_family=xunit2",
        ]
        if case_id is not None:
            argv += ["-k", f"[{case_id}]"]
        # The workspace's archon_models and tests first, then this engine (for a workspace without skill/).
        paths = [str(root), str(_ENGINE_ROOT), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(p for p in paths if p))}
        start = time.perf_counter()
        logger.info("running %s of %s", marker, model_name)
        try:
            proc = run_python_module("pytest", argv, cwd=root, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"stage {stage} of {model_name} ran past {timeout_s:.0f}s") from e
        seconds = time.perf_counter() - start
        tests = _parse_junit(report) if report.is_file() else []
    output = (proc.stdout + proc.stderr)[-4000:]
    passed, reason = stage_verdict(tests, proc.returncode)
    diffs = [c.max_abs_diff for t in tests for c in t.checks if c.max_abs_diff is not None]
    logger.info("stage(s) %s of %s: %s in %.1fs", marker, model_name, "passed" if passed else "FAILED", seconds)
    return RunTestStageResult(
        stage=stages[0],
        test_file=layout.test_file,
        case_id=case_id,
        passed=passed,
        tests=tests,
        max_abs_diff=max(diffs) if diffs else None,
        seconds=seconds,
        output_tail="" if passed else output,
        reason=reason,
    )


def _parse_junit(report: Path) -> list[StageTest]:
    import xml.etree.ElementTree as ET

    tests: list[StageTest] = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        message = ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "")[:500]
        checks: list[StageCheck] = []
        for prop in case.iter("property"):
            if prop.get("name") == RESULT_PROPERTY:
                data = json.loads(prop.get("value") or "{}")
                checks = [StageCheck.model_validate(c) for c in data.get("checks", [])]
        tests.append(
            StageTest(
                test=case.get("name", ""),
                outcome=outcome,
                seconds=float(case.get("time", 0.0)),
                checks=checks,
                message=message,
            )
        )
    return tests
