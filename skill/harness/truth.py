"""fp32 results judged by their distance from a float64 truth, next to the reference's own.

fp32 rounding error grows with what is computed: on a model whose logits reach +-30, HF's
own fp32 forward differs from its float64 forward by 6e-5, so a fixed tolerance (the
``assert_close`` defaults, 1e-5 absolute) fails correct ports of real checkpoints, and a
tolerance loose enough for them would hide a real 1e-4 error on a model whose logits are
small. So the same weights and inputs also run in float64, the *truth*, and each fp32
result is measured against it next to the reference's fp32 result (HF's in stages 4 and 6,
one process's in stage 5):

    error            = max |result - truth|
    reference error  = max |reference - truth|       how much rounding this computation makes
    passes when        error <= ERROR_RATIO * reference error + FLOOR_ULPS * eps(fp32) * scale

``scale`` is the largest value of the truth: of the tensor itself for logits and a loss, of
every gradient of the same backward for a gradient (see :data:`FLOOR_ULPS`).

The truth is not exact. HF computes a few steps in fp32 even in a float64 model (its
RMSNorm casts to fp32, eager attention takes the softmax in fp32, RoPE's cos/sin are fp32);
the ported packages mirror most of those casts. Those roundings are a small part of an fp32
run's error, which is what the rule compares, but they bound how close a float64 run of the
package (:data:`FLOAT64_ERROR_RATIO`) can come to HF's float64 run: not 1e-12, but measured
0-0.7x HF's fp32 error on the logits of every committed family.

Every constant below is measured with ``bench/parity_truth.py`` over the 89 cases of the
committed families (87 of them: xglm's HF model does not run in float64), and again with
``initializer_range=1.0`` (logits up to +-30) on eight of them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping

import torch

from skill.harness.compare import compare_tensor_dicts, compare_tensors, key_differences, max_abs_diff
from skill.harness.results import CheckResult

TRUTH_DTYPE = torch.float64
FP32_EPS = float(torch.finfo(torch.float32).eps)

# An fp32 result's error may be this many times the reference's own. Two fp32 computations
# of the same maths in a different order are equally valid, and their errors against the
# truth differ by a factor of about one either way. Measured over the committed families:
# Archon's error / HF's is 0.67 / 1.0 / 1.56 (min / median / max) on the logits, and at most
# 3.2 on any gradient tensor of 32 or more elements (glm4's fused gate_up_proj 2.65 over
# 16384 elements: its Archon port splits the fusion, and rounds more). 4 leaves a margin.
ERROR_RATIO = 4.0
# Plus this many fp32 ulps of the scale. A scalar (the loss) that HF happens to round right
# has an error of almost nothing to multiply: Archon's loss is then up to 0.9 ulps off (HF's
# 0.02), which the ratio cannot allow. A gradient that is zero or small in exact arithmetic
# (a key bias under the softmax's shift invariance; a scalar activation parameter summing
# cancelling terms) carries the rounding of the large terms it sums, so its floor is taken
# from the largest gradient of the backward: at logits of +-30, opt's k_proj.bias gradient
# (truth 3e-6, itself rounding noise) is 2.0e-5 off in Archon, 4.0e-7 in HF, i.e. 8 ulps of
# the largest gradient (19.2). 16 ulps (1.9e-6 of the scale) leaves a factor of two there and
# stays below the old fixed tolerance everywhere: on logits of magnitude 1.5 the bound is
# about 5e-6, against assert_close's 1e-5 + 1.3e-6 * |x|.
FLOOR_ULPS = 16.0

# The package run in float64 against the truth may differ by this many times HF's own fp32
# error, plus FLOAT64_FLOOR_ULPS fp32 ulps of the scale. Its difference comes only from the
# fp32 steps one side has and the other has not (HF's fp32 softmax against Archon's float64
# SDPA; a router or expert sum in fp32), fewer than an fp32 run's. Measured: 0 / 0.28 / 0.71
# of HF's error on the logits, at most 1.41 on a loss, and with logits of +-30 at most 2.0
# (glm4's gradients); the worst floor needed at a ratio of 2 is 1.1 ulps.
FLOAT64_ERROR_RATIO = 2.0
FLOAT64_FLOOR_ULPS = 2.0


@contextlib.contextmanager
def float64_default() -> Iterator[None]:
    """Tensors created without a dtype are float64 inside: a model run in float64 that builds
    a constant with ``torch.full`` or ``torch.tensor`` mid-forward (xglm's attention fills its
    mask with ``torch.finfo(float64).min``) computes in float64 instead of overflowing fp32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(TRUTH_DTYPE)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def truth_scale(truth: torch.Tensor | Mapping[str, torch.Tensor]) -> float:
    """The largest absolute value of a tensor, or of every tensor of a dict."""
    tensors = list(truth.values()) if isinstance(truth, Mapping) else [truth]
    return max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)


def truth_bound(reference_error: float, scale: float, float64_run: bool = False) -> float:
    """The largest error against the truth a result may have, when the reference's own is
    ``reference_error`` and the truth's scale is ``scale``."""
    if float64_run:
        return FLOAT64_ERROR_RATIO * reference_error + FLOAT64_FLOOR_ULPS * FP32_EPS * scale
    return ERROR_RATIO * reference_error + FLOOR_ULPS * FP32_EPS * scale


def _verdict(
    name: str,
    error: float,
    reference_error: float,
    bound: float,
    max_abs_diff_value: float,
    float64_run: bool,
    reference: str,
) -> CheckResult:
    passed = error <= bound and not math.isnan(bound)
    detail = (
        ""
        if passed
        else f"{_side(float64_run)} is {error:.3e} from the float64 truth, {reference} {reference_error:.3e}: "
        f"over the bound {bound:.3e}"
    )
    return CheckResult(
        name=name,
        passed=passed,
        detail=detail,
        max_abs_diff=max_abs_diff_value,
        error_vs_truth=error,
        reference_error_vs_truth=reference_error,
        allowed_error=bound,
        run_dtype="float64" if float64_run else "float32",
    )


def _side(float64_run: bool) -> str:
    return "the float64 run" if float64_run else "the result"


def judge(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    truth: torch.Tensor | None,
    float64_run: bool = False,
    reference_label: str = "HF fp32",
) -> CheckResult:
    """``actual`` against the float64 ``truth``, allowed :func:`truth_bound` of the fp32
    ``reference``'s own error. ``max_abs_diff`` stays the difference from ``reference`` (from the
    truth for a float64 run). Without a truth: ``assert_close``'s fp32 defaults against ``reference``."""
    if truth is None:
        return compare_tensors(name, actual, reference)
    reference_error = max_abs_diff(reference, truth)
    error = max_abs_diff(actual, truth)
    bound = truth_bound(reference_error, truth_scale(truth), float64_run)
    diff = error if float64_run else max_abs_diff(actual, reference)
    return _verdict(name, error, reference_error, bound, diff, float64_run, reference_label)


def judge_dicts(
    name: str,
    actual: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    truth: Mapping[str, torch.Tensor] | None,
    float64_run: bool = False,
    reference_label: str = "HF fp32",
) -> CheckResult:
    """:func:`judge` per key (the same keys on every side), the floor's scale taken over every
    tensor of ``truth``. The result carries the numbers of the key nearest its bound, and the
    detail names it; failing keys are listed, the furthest over first."""
    if truth is None:
        return compare_tensor_dicts(name, dict(actual), dict(reference))
    problems = key_differences(actual, truth)
    if problems:
        return CheckResult(name=name, passed=False, detail="; ".join(problems))
    scale = truth_scale(truth)
    verdicts: list[tuple[float, str, CheckResult]] = []
    for key in sorted(truth):
        reference_error = max_abs_diff(reference[key], truth[key])
        error = max_abs_diff(actual[key], truth[key])
        bound = truth_bound(reference_error, scale, float64_run)
        diff = error if float64_run else max_abs_diff(actual[key], reference[key])
        share = error / bound if bound > 0 else (0.0 if error == 0 else math.inf)
        verdicts.append((share, key, _verdict(key, error, reference_error, bound, diff, float64_run, reference_label)))
    verdicts.sort(key=lambda item: -item[0] if not math.isnan(item[0]) else -math.inf)
    failed = [f"{key}: {check.detail}" for _, key, check in verdicts if not check.passed]
    _, tightest, check = verdicts[0] if verdicts else (0.0, "", CheckResult(name=name, passed=False))
    if not verdicts:
        detail = "both sides are empty; nothing was compared"
    elif failed:
        shown = "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
        detail = f"{len(failed)} of {len(verdicts)} tensors outside: {shown}"
    else:
        detail = f"{len(verdicts)} tensors; the errors shown are {tightest}'s, the tensor nearest its bound"
    return check.model_copy(
        update={
            "name": name,
            "passed": bool(verdicts) and not failed,
            "detail": detail,
            "max_abs_diff": max((c.max_abs_diff or 0.0 for _, _, c in verdicts), default=0.0),
        }
    )
