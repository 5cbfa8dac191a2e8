"""Stage 5 fails on the parallel-plan bugs that leave the forward exact.

Each test breaks one piece of a reference plan (the forked workers inherit the
patch) and requires the TP=2 logits to still match while the gradient check fails
and names the affected parameters. A stage-5 harness that compared only logits
would pass both.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

import archon_models.qwen2.infra.parallelize as qwen2_parallelize
import archon_models.qwen3.infra.parallelize as qwen3_parallelize
from skill.harness import ModelCase
from skill.harness.distributed import PARALLELISMS, run_stage5


class _LeaveAlone(ParallelStyle):
    """A plan entry that does nothing: the module keeps plain parameters."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return module


def _checks(result):
    return {check.name: check for check in result.checks}


@pytest.mark.stage5
def test_missing_sequence_parallel_on_norms_is_caught(monkeypatch, tmp_path):
    # Norms run on each rank's sequence shard either way; without SequenceParallel
    # their weight gradient is only this rank's share.
    monkeypatch.setattr(qwen2_parallelize, "SequenceParallel", lambda *args, **kwargs: _LeaveAlone())
    result = run_stage5(ModelCase(model_type="qwen2"), workdir=tmp_path, raise_on_failure=False, parallelisms=["tp"])
    checks = _checks(result)
    assert checks["logits (tp=2)"].passed
    assert not checks["gradients (tp=2)"].passed
    assert "ffn_norm.weight" in checks["gradients (tp=2)"].detail
    assert "norm.weight" in checks["gradients (tp=2)"].detail


@pytest.mark.stage5
def test_router_gate_gradient_taken_whole_is_caught(monkeypatch, tmp_path):
    # AReaL 1.0.4's bug: the router output taken local without declaring its
    # gradient partial over the TP ranks.
    original = qwen3_parallelize.ReplicateParallel
    monkeypatch.setattr(qwen3_parallelize, "ReplicateParallel", lambda local_output_grad_placements=None: original())
    result = run_stage5(
        ModelCase(model_type="qwen3_moe"), workdir=tmp_path, raise_on_failure=False, parallelisms=["tp"]
    )
    checks = _checks(result)
    assert checks["logits (tp=2)"].passed
    assert not checks["gradients (tp=2)"].passed
    assert "moe.router.gate.weight" in checks["gradients (tp=2)"].detail


def test_stage5_refuses_parallelisms_that_do_not_apply(tmp_path):
    result = run_stage5(ModelCase(model_type="qwen2"), workdir=tmp_path, raise_on_failure=False, parallelisms=["ep"])
    assert not result.passed
    assert "ep" in result.checks[0].detail and "no MoE layer" in result.checks[0].detail
    with pytest.raises(ValueError, match="choose a non-empty subset of"):
        run_stage5(ModelCase(model_type="qwen2"), parallelisms=["dp"])
    assert set(PARALLELISMS) == {"tp", "fsdp", "ep", "pp", "cp"}
