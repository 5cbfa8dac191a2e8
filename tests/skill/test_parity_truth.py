"""The judgement against a float64 truth (skill.harness.truth), on hand-made tensors.

The stages' use of it, on real ports (a correct one whose logits reach +-30 passes where the
fixed tolerance failed; a 1e-4 error on small logits fails), is in tests/archon/test_harness.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from skill.harness.results import CheckResult, StageResult
from skill.harness.truth import (
    ERROR_RATIO,
    FLOAT64_ERROR_RATIO,
    FLOOR_ULPS,
    FP32_EPS,
    float64_default,
    judge,
    judge_dicts,
    truth_bound,
)


def _truth(seed: int = 0, n: int = 64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _off(truth: torch.Tensor, by: float) -> torch.Tensor:
    """``truth`` in fp32 with its largest element moved by ``by``."""
    moved = truth.clone()
    moved[int(truth.abs().argmax())] += by
    return moved.float()


def test_within_the_ratio_of_the_reference_error_passes_and_beyond_it_fails():
    truth = _truth()
    reference = _off(truth, 1e-3)
    assert judge("x", _off(truth, 3.9e-3), reference, truth).passed
    failed = judge("x", _off(truth, 4.2e-3), reference, truth)
    assert not failed.passed
    assert "from the float64 truth" in failed.detail and "HF fp32" in failed.detail
    assert failed.error_ratio == pytest.approx(4.2, rel=1e-3)
    assert failed.reference_error_vs_truth == pytest.approx(1e-3, rel=1e-3)
    assert failed.run_dtype == "float32"
    # max_abs_diff stays the difference from the reference.
    assert failed.max_abs_diff == pytest.approx(3.2e-3, rel=1e-3)


def test_the_floor_lets_a_result_pass_where_the_reference_happens_to_be_exact():
    truth = torch.tensor([5.5], dtype=torch.float64)
    exact = truth.float()
    ulp = 5.5 * FP32_EPS
    assert judge("loss", exact + ulp, exact, truth).passed
    assert not judge("loss", exact + 2 * FLOOR_ULPS * ulp, exact, truth).passed


def test_the_bound_is_the_rule_the_module_states():
    assert truth_bound(1e-6, 2.0) == pytest.approx(ERROR_RATIO * 1e-6 + FLOOR_ULPS * FP32_EPS * 2.0)
    assert truth_bound(1e-6, 2.0, float64_run=True) < truth_bound(1e-6, 2.0)
    assert FLOAT64_ERROR_RATIO < ERROR_RATIO


def test_the_float64_run_is_held_tighter():
    truth = _truth()
    reference = _off(truth, 1e-3)
    assert judge("x", _off(truth, 3.5e-3), reference, truth).passed
    assert not judge("x", _off(truth, 3.5e-3).double(), reference, truth, float64_run=True).passed
    float64 = judge("x", _off(truth, 1e-3).double(), reference, truth, float64_run=True)
    assert float64.passed and float64.run_dtype == "float64"
    assert float64.max_abs_diff == float64.error_vs_truth


def test_without_a_truth_it_is_assert_close_with_fp32_defaults():
    reference = torch.ones(8)
    assert judge("x", reference + 5e-6, reference, None).passed
    fallback = judge("x", reference + 5e-5, reference, None)
    assert not fallback.passed and fallback.error_vs_truth is None and fallback.error_ratio is None


def test_nan_never_passes():
    truth = _truth()
    broken = truth.float().clone()
    broken[3] = math.nan
    assert not judge("x", broken, truth.float(), truth).passed
    fine = _truth(1)
    result = judge_dicts(
        "g", {"a": fine.float(), "b": broken}, {"a": fine.float(), "b": truth.float()}, {"a": fine, "b": truth}
    )
    assert not result.passed and result.detail.startswith("1 of 2 tensors outside: b:")


def test_gradients_take_the_floor_from_the_largest_gradient():
    """A gradient that is zero in exact arithmetic holds only the rounding noise of the large
    terms it sums: judged alone it has no scale; among the other gradients of its backward it
    is allowed a few ulps of the largest."""
    big = 10 * _truth(1)
    zero = torch.zeros(32, dtype=torch.float64)
    noise = torch.full((32,), 4 * FP32_EPS * 10)
    truth = {"big": big, "k_bias": zero}
    reference = {"big": big.float(), "k_bias": torch.zeros(32)}
    actual = {"big": big.float(), "k_bias": noise}
    assert not judge("k_bias", noise, torch.zeros(32), zero).passed
    assert judge_dicts("gradients", actual, reference, truth).passed


def test_dicts_name_the_keys_outside_and_the_tensor_nearest_its_bound():
    truth = {f"w{i}": _truth(i) for i in range(5)}
    reference = {k: _off(t, 1e-3) for k, t in truth.items()}
    actual = {k: _off(t, 2e-3) for k, t in truth.items()}
    actual["w3"] = _off(truth["w3"], 1e-2)
    result = judge_dicts("gradients", actual, reference, truth)
    assert not result.passed
    assert result.detail.startswith("1 of 5 tensors outside: w3:")
    assert result.error_vs_truth == pytest.approx(1e-2, rel=1e-3)
    del actual["w3"]
    result = judge_dicts("gradients", actual, reference, truth)
    assert not result.passed and "missing keys [w3]" in result.detail
    ok = judge_dicts("gradients", {k: _off(t, 2e-3) for k, t in truth.items()}, reference, truth)
    assert ok.passed and "5 tensors" in ok.detail and ok.error_ratio == pytest.approx(2, rel=1e-3)


def test_the_result_shows_both_errors_and_their_ratio():
    truth = _truth()
    check = judge("logits", _off(truth, 2e-3), _off(truth, 1e-3), truth)
    assert "error vs float64 truth 2.000e-03, reference's 1.000e-03, ratio 2, 0.50 of the bound" in check.line()
    assert check.allowed_error == pytest.approx(truth_bound(1e-3, float(truth.abs().max())), rel=1e-3)
    dumped = check.model_dump()
    assert dumped["error_ratio"] == pytest.approx(2, rel=1e-3)
    assert CheckResult.model_validate_json(check.model_dump_json()).error_ratio == pytest.approx(2, rel=1e-3)
    stage = StageResult(stage=4, stage_name="parity", case_id="c", model_type="m", checks=[check])
    assert stage.worst_truth_check() == check and stage.worst_truth_check("float64") is None


def test_float64_default_is_restored():
    with float64_default():
        assert torch.full((), 1.0).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(RuntimeError), float64_default():
        raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32
