"""The stages catch a router that is wrong only where the routing features live.

On the generated glm4_moe package (sigmoid router with a score-correction bias, routed
scaling, grouped top-k, a leading dense layer, shared experts): a router gate whose
gradient is taken whole under TP leaves the TP=2 logits exact and must fail stage 5's
gradient check, under TP=2 and under EP=2 x TP=2 in both expert layouts (etp=1 and
etp=tp); a router that ignores the score-correction bias must fail stage 4.
"""

from __future__ import annotations

import pytest

import archon_models.glm4_moe.infra.parallelize as glm4_moe_parallelize
from archon_models.moe.router import TokenChoiceTopKRouter
from skill.harness import ModelCase, run_parity_stage
from skill.harness.distributed import run_stage5


def _case() -> ModelCase:
    # The generated test's case: groups, scaling and a dense layer all exercised.
    from tests.archon.test_glm4_moe import CASES

    return CASES[0]


def _checks(result):
    return {check.name: check for check in result.checks}


@pytest.mark.stage5
def test_router_gate_gradient_taken_whole_is_caught_on_glm4_moe(monkeypatch, tmp_path):
    original = glm4_moe_parallelize.ReplicateParallel
    monkeypatch.setattr(glm4_moe_parallelize, "ReplicateParallel", lambda local_output_grad_placements=None: original())
    result = run_stage5(_case(), workdir=tmp_path, raise_on_failure=False, parallelisms=["tp"])
    checks = _checks(result)
    assert checks["logits (tp=2)"].passed
    assert not checks["gradients (tp=2)"].passed
    assert "moe.router.gate.weight" in checks["gradients (tp=2)"].detail


@pytest.mark.stage5
def test_router_gate_gradient_taken_whole_is_caught_under_ep_x_tp(monkeypatch, tmp_path):
    original = glm4_moe_parallelize.ReplicateParallel
    monkeypatch.setattr(glm4_moe_parallelize, "ReplicateParallel", lambda local_output_grad_placements=None: original())
    result = run_stage5(_case(), workdir=tmp_path, raise_on_failure=False, parallelisms=["ep_tp"])
    checks = _checks(result)
    for etp in (1, 2):
        label = f"ep=2 x tp=2, etp={etp}"
        assert checks[f"logits ({label})"].passed
        assert not checks[f"gradients ({label})"].passed
        assert "moe.router.gate.weight" in checks[f"gradients ({label})"].detail


@pytest.mark.stage4
def test_router_ignoring_the_correction_bias_is_caught(monkeypatch, tmp_path):
    forward = TokenChoiceTopKRouter.forward
    monkeypatch.setattr(TokenChoiceTopKRouter, "forward", lambda self, x, expert_bias=None: forward(self, x, None))
    result = run_parity_stage(_case(), workdir=tmp_path, raise_on_failure=False)
    assert not result.passed
    failed = [c.name for c in result.checks if not c.passed]
    assert any("logits" in name for name in failed), failed
