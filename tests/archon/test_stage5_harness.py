"""Stage 5 fails on the parallel-plan bugs that leave the forward exact.

Each test breaks one piece of a reference plan (the forked workers inherit the
patch) and requires the TP=2 logits to still match while the gradient check fails
and names the affected parameters. A stage-5 harness that compared only logits
would pass both.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

import archon_models.qwen2.infra.parallelize as qwen2_parallelize
import archon_models.qwen3.infra.parallelize as qwen3_parallelize
from skill.harness import ModelCase, distributed
from skill.harness.distributed import (
    PARALLELISMS,
    WORLD_SIZES,
    applicable_parallelisms,
    not_run_checks,
    run_stage5,
)


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
    # Judged against one process's float64 run: the errors come with the result.
    assert checks["logits (tp=2)"].error_vs_truth is not None
    assert checks["logits (tp=2)"].reference_error_vs_truth is not None


@pytest.mark.stage5
def test_a_model_that_cannot_run_in_float64_is_compared_with_the_fixed_tolerance(monkeypatch, tmp_path):
    original = distributed._one_process

    def fp32_only(model, batches, mean):
        if next(model.parameters()).dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        return original(model, batches, mean)

    monkeypatch.setattr(distributed, "_one_process", fp32_only)
    result = run_stage5(ModelCase(model_type="qwen2"), workdir=tmp_path, parallelisms=["tp"])
    checks = _checks(result)
    note = checks["not run (float64 one-process reference)"]
    assert note.passed and "got Double" in note.detail and "assert_close" in note.detail
    assert checks["logits (tp=2)"].passed and checks["logits (tp=2)"].error_vs_truth is None


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
    assert set(PARALLELISMS) == {"tp", "fsdp", "ep", "pp", "cp", "ep_tp"}
    assert WORLD_SIZES == {"tp": 2, "fsdp": 2, "ep": 2, "pp": 2, "cp": 2, "ep_tp": 4}


def _qwen3_on_meta(**overrides):
    import torch

    from archon_models.moe import MoEArgs
    from archon_models.qwen3.model.args import Qwen3ModelArgs
    from archon_models.qwen3.model.model import Qwen3Model

    moe = overrides.pop("num_experts", None)
    small = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "vocab_size": 256}
    small.update(overrides)
    moe_args = None if moe is None else MoEArgs(num_experts=moe, top_k=2, use_grouped_mm=False)
    with torch.device("meta"):
        return Qwen3Model(Qwen3ModelArgs(hidden_dim=128, moe_inter_dim=32, moe_args=moe_args, **small))


def test_ep_x_tp_applies_exactly_where_both_ep_and_tp_do():
    # MoE with two KV heads and four experts: EP x TP runs.
    assert applicable_parallelisms(_qwen3_on_meta(num_experts=4))["ep_tp"] is None
    # Dense: no MoE layer, for EP and EP x TP alike.
    assert applicable_parallelisms(_qwen3_on_meta())["ep_tp"] == "the model has no MoE layer"
    # One KV head: TP refused, so EP x TP is refused naming TP (plain EP still runs).
    mqa = applicable_parallelisms(_qwen3_on_meta(num_experts=4, n_kv_heads=1))
    assert mqa["ep"] is None
    assert "TP=2 does not apply" in (mqa["ep_tp"] or "") and "n_kv_heads (1)" in (mqa["ep_tp"] or "")
    # Three experts cannot be split over two EP ranks.
    odd = applicable_parallelisms(_qwen3_on_meta(num_experts=3))
    assert "EP=2 does not apply" in (odd["ep_tp"] or "") and "num_experts (3)" in (odd["ep_tp"] or "")


def test_a_parallelism_that_does_not_apply_is_one_passing_line():
    # The stage records these checks: a left-out parallelism is said, never silent.
    mqa = {c.name: c for c in not_run_checks(applicable_parallelisms(_qwen3_on_meta(num_experts=4, n_kv_heads=1)))}
    assert set(mqa) == {"not run (tp=2)", "not run (pp=2)", "not run (ep=2 x tp=2)"}
    assert all(c.passed for c in mqa.values())
    assert "TP=2 does not apply" in mqa["not run (ep=2 x tp=2)"].detail
    # A dense model gets no line for the MoE-only parallelisms.
    dense = {c.name for c in not_run_checks(applicable_parallelisms(_qwen3_on_meta(n_kv_heads=1)))}
    assert dense == {"not run (tp=2)", "not run (pp=2)"}


def test_a_tied_model_s_pp_reason_names_the_spec_s_own_pipelining_function():
    """Agent20d's friction 11: ctrl's stage 5 said pipeline_llm cannot split its tied embedding and
    head, though its spec pipelines with pipeline_ctrl (pos_embeddings kept on the first stage)."""
    from archon_models.model_spec import get_model_spec

    tied = _qwen3_on_meta(enable_weight_tying=True)
    own = get_model_spec("ctrl")
    assert own.pipelining_fn is not None and own.pipelining_fn.__name__ == "pipeline_ctrl"
    assert applicable_parallelisms(tied, own)["pp"] == (
        "the embedding and LM head are tied, which pipeline_ctrl cannot split over stages"
    )
    shared = get_model_spec("qwen3")
    assert "which pipeline_llm cannot split" in (applicable_parallelisms(tied, shared)["pp"] or "")
    assert applicable_parallelisms(_qwen3_on_meta(enable_weight_tying=False), own)["pp"] is None


class _BrokenBlock(nn.Module):
    """Stands in for a block whose forward fails (a module the split left None, say)."""

    def forward(self, *args, **kwargs):
        raise TypeError("'NoneType' object is not callable")


@pytest.mark.stage5
def test_a_rank_that_fails_stops_its_peers_and_no_other_parallelism(monkeypatch, tmp_path):
    """Issue 20: the first pipeline stage fails on rank 0 while rank 1 waits for its
    activations. Rank 1 is stopped without the collective timeout, its wait is not reported
    as a failure of its own, and the next parallelism runs on fresh workers and passes."""
    import time

    import archon_models.pipeline_parallel as pipeline_parallel
    from skill.harness.distributed import COLLECTIVE_TIMEOUT_S

    split = pipeline_parallel.pipeline_module_split

    def break_first_stage(*args, **kwargs):
        stages, parts = split(*args, **kwargs)
        for stage, part in zip(stages, parts, strict=True):
            if stage.is_first:
                part.layers["0"] = _BrokenBlock()
        return stages, parts

    monkeypatch.setattr(pipeline_parallel, "pipeline_module_split", break_first_stage)
    start = time.monotonic()
    result = run_stage5(
        ModelCase(model_type="qwen2"), workdir=tmp_path, raise_on_failure=False, parallelisms=["pp", "cp"]
    )
    elapsed = time.monotonic() - start
    checks = _checks(result)
    raised = checks["raised (pp=2)"]
    assert not raised.passed
    assert raised.detail.startswith("rank 0: TypeError: 'NoneType' object is not callable"), raised.detail
    assert raised.detail.endswith("; rank 1 stopped when rank 0 failed"), raised.detail
    assert "gloo" not in raised.detail and "Timed out" not in raised.detail
    assert "raised (cp=2)" not in checks
    assert all(checks[name].passed for name in ("logits (cp=2, gathered)", "loss (cp=2)", "gradients (cp=2)"))
    assert elapsed < COLLECTIVE_TIMEOUT_S, f"stage 5 took {elapsed:.0f}s: a rank waited for the collective timeout"
