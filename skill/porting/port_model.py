"""The whole playbook in one call: analyse, copy, edit, register, then prove stage by stage."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from skill.codemod import StagedTree, Workspace, validate_model_name
from skill.errors import step_error_message
from skill.porting.check_package import CheckPackageRequest, run_checks
from skill.porting.child_process import warm_up
from skill.porting.common import PackageLayout
from skill.porting.copy_reference import REFERENCES, CopyReferenceRequest, apply_copy_reference, refuse_reference
from skill.porting.edit_adapter_map import EditAdapterMapRequest, apply_edit_adapter_map
from skill.porting.edit_args import EditArgsRequest, apply_edit_args
from skill.porting.edit_model import EditModelRequest, apply_edit_model
from skill.porting.plan import PortPlan, plan_for, refuse_unsupported
from skill.porting.register_spec import RegisterSpecRequest, apply_register_spec, registered_types
from skill.porting.run_test_stage import RunTestStageResult, ensure_test_file, run_stage_subprocess, stage_verdict
from skill.porting.set_rope import SetRopeRequest, apply_set_rope
from skill.porting.write_parallelize import WriteParallelizeRequest, apply_write_parallelize

logger = logging.getLogger(__name__)

STAGE_NAMES = {1: "args", 2: "adapter", 3: "completeness", 4: "parity", 5: "distributed", 6: "checkpoint"}


class PortModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="a model_type transformers knows, or a folder/config.json of a checkpoint")
    model_name: str | None = Field(default=None, description="package name (default: the config's model_type)")
    overwrite: bool = Field(default=False, description="replace an existing, different package")
    trust_remote_code: bool = Field(
        default=False,
        description="the source is a folder with auto_map: run its configuration_*.py / modeling_*.py for the "
        "analysis and every stage (read them first); refused otherwise",
    )
    stages: list[int] = Field(
        default_factory=lambda: [1, 2, 3, 4, 5, 6], description="test stages to run after writing"
    )
    workspace: Path | None = Field(default=None, description="project root holding archon_models/")

    @field_validator("model_name")
    @classmethod
    def _valid_name(cls, value: str | None) -> str | None:
        return None if value is None else validate_model_name(value)

    @field_validator("stages")
    @classmethod
    def _valid_stages(cls, value: list[int]) -> list[int]:
        bad = [s for s in value if s not in STAGE_NAMES]
        if bad:
            raise ValueError(f"stages {bad} do not exist; stages are 1 to 6.")
        return sorted(set(value))


class StepReport(BaseModel):
    step: str
    ok: bool
    seconds: float = Field(json_schema_extra={"volatile": True})
    detail: str = ""


class PortModelResult(BaseModel):
    model_name: str
    model_types: list[str]
    reference: str | None = None
    passed: bool = Field(
        description="every step and stage passed: the field to read (a port that ran and failed is still a "
        "result, not a tool error; failed_step and error say where and why)"
    )
    failed_step: str | None = None
    error: str | None = None
    steps: list[StepReport]
    edits: list[str] = Field(default_factory=list)
    unsupported: list[str] = Field(
        default_factory=list, description="the analysis' unsupported features (a port is refused when any)"
    )
    changed_files: list[str] = Field(default_factory=list)
    max_abs_logit_diff: float | None = None
    stage_results: list[RunTestStageResult] = Field(default_factory=list)
    seconds: float = Field(json_schema_extra={"volatile": True})


class _Runner:
    def __init__(self, progress: Callable[[StepReport], None] | None):
        self.steps: list[StepReport] = []
        self.progress = progress

    def run(self, name: str, fn: Callable[[], Any], detail: Callable[[Any], str] = lambda r: "") -> Any:
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as e:
            self._record(
                StepReport(step=name, ok=False, seconds=time.perf_counter() - start, detail=f"{type(e).__name__}: {e}")
            )
            raise
        self._record(StepReport(step=name, ok=True, seconds=time.perf_counter() - start, detail=detail(value)))
        return value

    def _record(self, report: StepReport) -> None:
        self.steps.append(report)
        logger.info("%-20s %s %6.2fs %s", report.step, "ok  " if report.ok else "FAIL", report.seconds, report.detail)
        if self.progress is not None:
            self.progress(report)


class _StepFailed(Exception):
    pass


def port_model(request: PortModelRequest) -> PortModelResult:
    """Port a HF family end to end (the CLI's `add`): measure its features, copy the nearest
    reference, edit args/model/rope/adapter/parallelize, register the spec, write the test
    file, apply all of it atomically, then run stages 1-6. Stops at the first failing step
    with what failed and why; refuses before writing anything when a feature has no edit
    or a different package exists without overwrite. Re-running on a ported family changes
    nothing. A port that ran is a result whether it passed or not (isError false): read
    `passed`, then `failed_step` and `error`, and `stage_results` for a failed stage."""
    return run_port(request)


def run_port(request: PortModelRequest, progress: Callable[[StepReport], None] | None = None) -> PortModelResult:
    start = time.perf_counter()
    runner = _Runner(progress)
    workspace = Workspace(request.workspace)
    state: dict[str, Any] = {
        "model_name": request.model_name or "",
        "model_types": [],
        "edits": [],
        "reference": None,
        "unsupported": [],
    }

    def result(passed: bool, failed: str | None = None, error: str | None = None, **extra: Any) -> PortModelResult:
        return PortModelResult(
            model_name=state["model_name"],
            model_types=state["model_types"],
            reference=state["reference"],
            passed=passed,
            failed_step=failed,
            error=error,
            steps=runner.steps,
            edits=state["edits"],
            unsupported=state["unsupported"],
            seconds=time.perf_counter() - start,
            **extra,
        )

    # The TP-plan check and the stages run in children of the warm interpreter: let it
    # import torch and transformers while the analysis runs.
    warm_up()
    try:
        # The plan is read off the analysis: what the analyser refuses (encoders,
        # encoder-decoders, multimodal, hybrid and state-space models, ...) is refused here
        # too, with its message, before anything is written.
        profile = runner.run(
            "analyze",
            lambda: plan_for(request.source, request.trust_remote_code),
            lambda p: f"{p.model_type} ({p.config_class})",
        )
        model_type = profile.model_type
        state.update(model_types=[model_type], unsupported=list(profile.unsupported))
        served_by, alias = (
            _package_serving(workspace, model_type, request.source) if request.model_name is None else (None, False)
        )
        if served_by is not None:
            # A hand-written reference already serves this model_type, or the type asked for
            # is an alias of a type a package registers: nothing to write, its own stages prove it.
            state.update(model_name=served_by, reference=served_by)
            name = served_by
            served_detail = (
                f"{request.source} is transformers' {model_type}: by archon_models/{served_by}"
                if alias
                else f"by the {served_by} reference"
            )
            runner._record(StepReport(step="served", ok=True, seconds=0.0, detail=served_detail))
        else:
            # A model_type such as "gpt-sw3" names the package gpt_sw3.
            name = request.model_name or validate_model_name(model_type.replace("-", "_"))
            state.update(model_name=name)
            refuse_reference(name)
            refuse_unsupported(profile, "port_model")
            state["reference"] = profile.reference
    except Exception as e:
        return result(
            False,
            runner.steps[-1].step if runner.steps and not runner.steps[-1].ok else "analyze",
            f"{type(e).__name__}: {step_error_message(e)}",
        )

    changed: list[str] = []
    if served_by is None:
        layout = PackageLayout.for_name(name)
        tree = StagedTree(workspace)
        existed = tree.exists(layout.package_dir)
        steps = package_steps(tree, request, name, profile)
        source, trust = request.source, request.trust_remote_code
        common = {"model_name": name, "workspace": request.workspace}
        try:
            for step_name, fn, detail in steps:
                value = runner.run(step_name, fn, detail)
                if step_name == "edit_model":
                    state["edits"] = value.edits
            check = runner.run(
                "check_package",
                lambda: run_checks(
                    tree,
                    CheckPackageRequest(source=source, model_types=[model_type], trust_remote_code=trust, **common),
                ),
                lambda r: f"{sum(c.passed for c in r.checks)}/{len(r.checks)} checks",
            )
            if not check.passed:
                failures = "; ".join(f"{c.name}: {c.detail}" for c in check.failures)
                runner.steps[-1] = runner.steps[-1].model_copy(update={"ok": False, "detail": failures})
                raise _StepFailed(f"check_package: {failures}")
            changes = tree.changes()
            if existed and changes and not request.overwrite:
                raise FileExistsError(
                    f"{layout.package_dir}/ exists and differs from what the engine generates "
                    f"({', '.join(sorted(changes))}); pass overwrite=True (--overwrite) to replace it. "
                    "Nothing was written."
                )
            changed = runner.run(
                "write", tree.commit, lambda paths: f"{len(paths)} files changed" if paths else "unchanged"
            )
        except Exception as e:
            failed = next((s.step for s in reversed(runner.steps) if not s.ok), "write")
            return result(False, failed, f"{type(e).__name__}: {e}")

    stage_results: list[RunTestStageResult] = []
    max_logit: float | None = None
    if request.stages:
        try:
            stage_results = runner.run(
                "stages " + ",".join(map(str, request.stages)),
                lambda: run_all_stages(workspace.root, name, request.stages),
                lambda rs: ", ".join(f"{r.stage}:{'ok' if r.passed else 'FAIL'}" for r in rs),
            )
        except Exception as e:
            return result(False, runner.steps[-1].step, f"{type(e).__name__}: {e}", changed_files=changed)
        for stage_result in stage_results:
            runner._record(
                StepReport(
                    step=f"stage {stage_result.stage} {STAGE_NAMES[stage_result.stage]}",
                    ok=stage_result.passed,
                    seconds=sum(t.seconds for t in stage_result.tests),
                    detail=_stage_detail(stage_result),
                )
            )
        logit_diffs = [
            c.max_abs_diff
            for r in stage_results
            if r.stage == 4
            for t in r.tests
            for c in t.checks
            if "logits" in c.name and c.max_abs_diff is not None
        ]
        max_logit = max(logit_diffs) if logit_diffs else None
        first_failed = next((r for r in stage_results if not r.passed), None)
        if first_failed is not None:
            return result(
                False,
                f"stage {first_failed.stage}",
                _stage_detail(first_failed),
                changed_files=changed,
                stage_results=stage_results,
                max_abs_logit_diff=max_logit,
            )
    return result(True, changed_files=changed, stage_results=stage_results, max_abs_logit_diff=max_logit)


Step = tuple[str, Callable[[], Any], Callable[[Any], str]]


def package_steps(tree: StagedTree, request: PortModelRequest, name: str, profile: PortPlan) -> list[Step]:
    """The steps that write package ``name`` from scratch into ``tree``, in order: (step name,
    the call, a one-line summary of its result). The package and its stage test file are
    cleared in ``tree`` first (the test file's extra cases are kept for ``write_tests``)."""
    layout = PackageLayout.for_name(name)
    reference = profile.reference
    model_type = profile.model_type
    # Build the package from scratch in memory; compare with disk at the end.
    tree.delete_tree(layout.package_dir)
    # Its extra cases (config overrides proving what a default hides) outlive the rewrite.
    old_test_file = tree.read_text(layout.test_file)
    if old_test_file is not None:
        tree.delete(layout.test_file)
    common = {"model_name": name, "workspace": request.workspace}
    trust = request.trust_remote_code
    sourced = {**common, "source": request.source, "trust_remote_code": trust}
    source = request.source
    return [
        (
            "copy_reference",
            lambda: apply_copy_reference(tree, CopyReferenceRequest(reference=reference, overwrite=True, **common)),
            lambda r: f"{reference} -> {r.package_dir}",
        ),
        (
            "edit_args",
            lambda: apply_edit_args(tree, EditArgsRequest(**sourced), profile),
            lambda r: f"{len(r.fields)} fields, {len(r.checks)} checks",
        ),
        (
            "edit_model",
            lambda: apply_edit_model(tree, EditModelRequest(**sourced), profile),
            lambda r: ", ".join(r.edits),
        ),
        (
            "set_rope",
            lambda: apply_set_rope(tree, SetRopeRequest(**sourced), profile),
            lambda r: f"{r.rope_type}, re-exported" if r.reexported else r.rope_type,
        ),
        (
            "edit_adapter_map",
            lambda: apply_edit_adapter_map(tree, EditAdapterMapRequest(**sourced)),
            lambda r: f"{len(r.from_hf_map)} entries",
        ),
        (
            "write_parallelize",
            lambda: apply_write_parallelize(tree, WriteParallelizeRequest(**sourced), profile),
            lambda r: f"{len(r.layer_plan)} plan entries",
        ),
        (
            "write_tests",
            lambda: ensure_test_file(tree, name, model_type, source, trust, keep_cases_of=old_test_file),
            lambda r: layout.test_file,
        ),
        (
            "register_spec",
            lambda: apply_register_spec(tree, RegisterSpecRequest(model_types=[model_type], **sourced)),
            lambda r: ", ".join(r.model_types),
        ),
    ]


def _package_serving(workspace: Workspace, model_type: str, source: str) -> tuple[str | None, bool]:
    """The package that already serves ``model_type`` (or ``None``), and whether ``source`` is
    an alias of it.

    A reference serves the types it registers. Any package serves a ``source`` that is
    another model_type transformers maps to this one's config class (``gpt-sw3`` builds a
    ``GPT2Config``, model_type ``gpt2``): a checkpoint of it says ``gpt2``, which is what
    the registry is asked for.
    """
    owner = registered_types(StagedTree(workspace)).get(model_type)
    if owner in REFERENCES:
        return owner, False
    alias = source != model_type and source in CONFIG_MAPPING_NAMES
    return (owner, True) if owner is not None and alias else (None, False)


def _stage_detail(stage_result: RunTestStageResult) -> str:
    failed = [c for t in stage_result.tests for c in t.checks if not c.passed]
    if failed:
        return "; ".join(f"{c.name}: {c.detail}" for c in failed[:3])
    bad = [t for t in stage_result.tests if t.outcome not in ("passed", "skipped")]
    if bad:
        return "; ".join(f"{t.test}: {t.message}" for t in bad[:3]) or stage_result.output_tail[-300:]
    if stage_result.max_abs_diff is not None:
        return f"max abs diff {stage_result.max_abs_diff:.2e}"
    return ""


def run_all_stages(root: Path, model_name: str, stages: list[int]) -> list[RunTestStageResult]:
    """All requested stages in one pytest process (one interpreter start), split per stage."""
    combined = run_stage_subprocess(root, model_name, stages, timeout_s=600.0)
    per_stage: list[RunTestStageResult] = []
    for stage in stages:
        tests = [t for t in combined.tests if t.test.startswith(f"test_stage{stage}_")]
        diffs = [c.max_abs_diff for t in tests for c in t.checks if c.max_abs_diff is not None]
        # Per stage, the outcomes of its own tests decide (pytest's exit code covers every stage).
        passed, reason = stage_verdict(tests)
        per_stage.append(
            combined.model_copy(
                update={
                    "stage": stage,
                    "tests": tests,
                    "passed": passed,
                    "max_abs_diff": max(diffs) if diffs else None,
                    "seconds": sum(t.seconds for t in tests),
                    "output_tail": "" if passed else combined.output_tail,
                    "reason": reason,
                }
            )
        )
    return per_stage
