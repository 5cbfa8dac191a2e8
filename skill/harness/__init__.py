"""The six-stage proof harness: each stage a plain function of a :class:`ModelCase`.

Stages 1-4 and 6 live here; stage 5 (distributed) is ``skill.harness.distributed``.
Each returns a :class:`StageResult` and, unless ``raise_on_failure=False``, raises
:class:`StageFailure` (an ``AssertionError`` holding the result) when a check fails.
"""

from __future__ import annotations

from collections.abc import Callable

from skill.harness.adapter import run_adapter_stage
from skill.harness.args import run_args_stage
from skill.harness.case import ModelCase
from skill.harness.checkpoint import run_checkpoint_stage
from skill.harness.completeness import run_completeness_stage
from skill.harness.parity import run_parity_stage
from skill.harness.results import CheckResult, StageFailure, StageResult

StageFn = Callable[..., StageResult]

STAGES: dict[int, StageFn] = {
    1: run_args_stage,
    2: run_adapter_stage,
    3: run_completeness_stage,
    4: run_parity_stage,
    6: run_checkpoint_stage,
}


def get_stage(stage: int) -> StageFn:
    """The function of a stage number; stage 5 is imported lazily (it forks workers)."""
    if stage == 5:
        from skill.harness import distributed

        return distributed.run_stage5
    try:
        return STAGES[stage]
    except KeyError:
        raise ValueError(f"stage {stage} does not exist; stages are 1 to 6") from None


__all__ = [
    "STAGES",
    "CheckResult",
    "ModelCase",
    "StageFailure",
    "StageResult",
    "get_stage",
    "run_adapter_stage",
    "run_args_stage",
    "run_checkpoint_stage",
    "run_completeness_stage",
    "run_parity_stage",
]
