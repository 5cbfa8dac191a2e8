"""Shared machinery of the per-model stage tests in this folder.

A per-model test file defines ``CASES`` (a list of :class:`skill.harness.ModelCase`)
and one test per stage taking the ``case`` fixture; this conftest parametrises
``case`` over ``CASES``, runs stages through the ``prove`` fixture, and prints every
stage's numbers (max abs logit and gradient diff; the error against the float64 truth, the
reference's own and their ratio; time) in the terminal summary, also under pytest-xdist
(the numbers travel in ``user_properties``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub.utils import disable_progress_bars
from transformers.utils import logging as hf_logging

import archon_models  # importing the package registers every model spec
from skill.harness import ModelCase, StageFailure, StageResult
from skill.harness.models import installed_model_refused, unhonoured_overrides, unknown_model_type

_PROPERTY = "archon_stage_result"

# The families the default run proves in full (but for the stage 5 of three variant cases,
# below): one per reference and per structure a TP/FSDP/EP/PP/CP plan or AReaL's engine treats
# differently (dense without and with QK norm, q/k/v bias, a hybrid of linear and full
# attention, MoE with shared experts and with a sigmoid router, MLA, sinks, ALiBi, a parallel
# block, fused q/k/v, soft-capped windowed attention). Stage 5 and the AReaL tier of every other
# family (and stage 5 of the cases in STAGE5_VARIANTS_BEYOND_DEFAULT_RUN) carry the
# ``every_family`` marker, which the default run leaves out and .ci/run runs as its own step.
DEFAULT_RUN_FAMILIES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_5",
        "mixtral",
        "qwen2_moe",
        "deepseek_v3",
        "gpt_oss",
        "bloom",
        "gptj",
        "phi3",
        "gemma2",
    }
)
# Cases of those families whose stage 5 runs under ``every_family`` too: variants whose structure
# another case's stage 5 in the default run covers (each MoE case's stage 5 costs 7-11
# worker-seconds). deepseek_v3-yarn: YaRN changes cos/sin and the softmax scale, not a module or
# a plan entry (stage 4 proves the numbers); mixtral-head_dim-None: head_dim derived from the
# widths, the modules of the first case; qwen3_moe-mixed: a dense layer among MoE layers, which
# deepseek_v3's leading dense layer puts under EP and PP already.
STAGE5_VARIANTS_BEYOND_DEFAULT_RUN = frozenset({"deepseek_v3-yarn", "mixtral-head_dim-None", "qwen3_moe-mixed"})
EVERY_FAMILY_MARKER = "every_family"
EVERY_FAMILY_HELP = (
    "stage 5 and the AReaL tier of the committed families, the composition and fuzzer-found families' ports, and "
    "the pairs of QK norm and block norm kinds, beyond the default run's representative few (.ci/run runs them)"
)


def pytest_configure(config: pytest.Config) -> None:
    # save_pretrained / from_pretrained draw progress bars on every tiny model.
    hf_logging.disable_progress_bar()
    disable_progress_bars()
    # Registered here too: a scratch workspace's stage run has this conftest but not pyproject.toml.
    config.addinivalue_line("markers", f"{EVERY_FAMILY_MARKER}: {EVERY_FAMILY_HELP}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        cases: list[ModelCase] = getattr(metafunc.module, "CASES", [])
        if not cases:
            raise pytest.UsageError(f"{metafunc.module.__name__} uses the 'case' fixture but defines no CASES")
        beyond_default = _stage5_beyond_default_run(metafunc)
        params = [_skip_if_inexpressible(c) for c in cases]
        if beyond_default:
            params = [_with_mark(p, pytest.mark.every_family) for p in params]
        elif metafunc.definition.get_closest_marker("stage5") is not None:
            params = [
                _with_mark(p, pytest.mark.every_family) if c.id in STAGE5_VARIANTS_BEYOND_DEFAULT_RUN else p
                for c, p in zip(cases, params, strict=True)
            ]
        metafunc.parametrize("case", params, ids=[c.id for c in cases])


def _stage5_beyond_default_run(metafunc: pytest.Metafunc) -> bool:
    """Whether this is the stage-5 test of a committed family outside :data:`DEFAULT_RUN_FAMILIES`."""
    if metafunc.definition.get_closest_marker("stage5") is None:
        return False
    family = metafunc.module.__name__.rpartition(".")[2].removeprefix("test_")
    return family in _committed_families() and family not in DEFAULT_RUN_FAMILIES


def _committed_families() -> set[str]:
    """The package folders of ``archon_models`` (the families a ``tests/archon/test_<family>.py`` proves)."""
    root = Path(archon_models.__file__).parent
    return {p.parent.name for p in root.glob("*/spec.py")}


def _with_mark(param: Any, mark: pytest.MarkDecorator) -> Any:
    """``param`` (a case or a ``pytest.param`` of one) with ``mark`` added."""
    if isinstance(param, ModelCase):
        return pytest.param(param, marks=mark)
    return pytest.param(*param.values, marks=(*param.marks, mark), id=param.id)


# The verdict of _skip_if_inexpressible per case object: a test file's six stage tests share one
# CASES list, and each verdict builds the case's tiny HF config (847 builds at collection in each
# xdist worker, 141 distinct: 4-6 s of every worker's collection on the 2-core machine).
_EXPRESSIBLE: dict[int, tuple[ModelCase, Any]] = {}


def _skip_if_inexpressible(case: ModelCase) -> Any:
    """:func:`_judge_expressible`'s verdict on ``case``, judged once per case."""
    seen = _EXPRESSIBLE.get(id(case))
    if seen is None or seen[0] is not case:
        seen = _EXPRESSIBLE[id(case)] = (case, _judge_expressible(case))
    return seen[1]


def _judge_expressible(case: ModelCase) -> Any:
    """The case, skipped (not failed) when the installed transformers cannot express it.

    pyproject.toml accepts transformers from 5.3.0 on; a family newer than the installed
    version cannot be built there, and an override an older config class rewrites (a
    feature its model lacks) builds a model the case was not written for. Neither says
    anything about the port.
    """
    import transformers

    unknown = unknown_model_type(case.model_type) if case.source is None else None
    if unknown is not None:
        return pytest.param(case, marks=pytest.mark.skip(reason=unknown))
    # A remote-code case brings its own config class, which keeps what it is given.
    changed = unhonoured_overrides(case) if case.source is None else []
    if changed:
        version = transformers.__version__
        reason = f"transformers {version}'s config does not keep this case's override: {'; '.join(changed)}"
        return pytest.param(case, marks=pytest.mark.skip(reason=reason))
    return case


@pytest.fixture
def prove(record_property: Callable[[str, Any], None]) -> Callable[..., StageResult]:
    """Run a stage function, record its result for the summary, fail with its report."""

    def run(stage_fn: Callable[..., StageResult], case: ModelCase, **kwargs: Any) -> StageResult:
        result = stage_fn(case, raise_on_failure=False, **kwargs)
        broken = None if result.passed else _hf_forward_error(case)
        if broken is not None:
            # transformers' own model cannot run the case: nothing about the port.
            pytest.skip(f"transformers {_version()}'s own model raises on this case: {broken}")
        refused = None if result.passed else installed_model_refused(case)
        if refused is not None:
            # transformers' own model is another model than the package's: nothing about the port.
            pytest.skip(refused)
        record_property(_PROPERTY, result.model_dump_json())
        if not result.passed:
            raise StageFailure(result)
        return result

    return run


def _version() -> str:
    import transformers

    return transformers.__version__


def _hf_forward_error(case: ModelCase) -> str | None:
    """The error transformers' own tiny model of ``case`` raises on a forward, if it does
    (transformers 5.3's DeepSeek-V2 group_limited_greedy reads an attribute it never sets)."""
    import torch

    from skill.harness.models import build_hf_model

    try:
        model = build_hf_model(case)
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
    except Exception as exc:  # whatever HF raises
        return f"{type(exc).__name__}: {exc}"
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    rows: list[StageResult] = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "call":
                continue
            for name, value in getattr(report, "user_properties", []) or []:
                if name == _PROPERTY:
                    rows.append(StageResult.model_validate(json.loads(value)))
    if not rows:
        return
    terminalreporter.section("archon stage results")
    # The float64-truth columns, of the fp32 check nearest its bound: its error against the
    # float64 truth, the reference's own (HF fp32's; one process's in stage 5), their ratio and
    # the share of the bound it used; then the share the package's float64 run used of its own.
    header = ("max|dlogits|", "max|dgrad|", "max|diff|", "err vs f64", "ref err", "ratio", "of bound", "f64 of bnd")
    terminalreporter.write_line(
        f"{'case':<16} {'stage':<16} {'result':<7} " + " ".join(f"{h:>12}" for h in header) + f" {'seconds':>8}"
    )
    for row in sorted(rows, key=lambda r: (r.case_id, r.stage)):
        worst = row.worst_truth_check("float32")
        float64 = row.worst_truth_check("float64")
        terminalreporter.write_line(
            f"{row.case_id:<16} {f'{row.stage} {row.stage_name}':<16} {'pass' if row.passed else 'FAIL':<7} "
            f"{_fmt(row.max_abs_diff_of('logits'))} {_fmt(row.max_abs_diff_of('gradients'))} "
            f"{_fmt(row.max_abs_diff)} {_fmt(worst and worst.error_vs_truth)} "
            f"{_fmt(worst and worst.reference_error_vs_truth)} {_ratio(worst and worst.error_ratio)} "
            f"{_ratio(worst and worst.share_of_bound())} {_ratio(float64 and float64.share_of_bound())} "
            f"{row.seconds:>8.2f}"
        )


def _fmt(value: float | None) -> str:
    return f"{value:>12.3e}" if value is not None else f"{'-':>12}"


def _ratio(value: float | None) -> str:
    return f"{value:>12.3g}" if value is not None else f"{'-':>12}"
