"""Tensor comparisons that report a number, not only a verdict."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from skill.harness.results import CheckResult


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute elementwise difference, computed in fp32, or in float64 when either
    side is (a float64 truth rounded to fp32 first would hide errors below fp32's rounding);
    inf on a shape mismatch."""
    if actual.shape != expected.shape:
        return float("inf")
    if actual.numel() == 0:
        return 0.0
    dtype = torch.promote_types(torch.promote_types(actual.dtype, expected.dtype), torch.float32)
    diff = actual.detach().to("cpu", dtype) - expected.detach().to("cpu", dtype)
    return float(diff.abs().max())


def compare_tensors(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | None = None,
    atol: float | None = None,
) -> CheckResult:
    """``torch.testing.assert_close`` (its dtype defaults unless given) as a check result."""
    diff = max_abs_diff(actual, expected)
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:4])
        return CheckResult(name=name, passed=False, detail=detail, max_abs_diff=diff)
    return CheckResult(name=name, passed=True, max_abs_diff=diff)


def compare_tensor_dicts(
    name: str,
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    exact: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
) -> CheckResult:
    """Same keys, and each tensor equal: bit-exactly (``exact``) or within tolerance.

    The message names the missing, unexpected and differing keys, the worst first.
    """
    problems = key_differences(actual, expected)
    worst = 0.0
    differing: list[tuple[float, str]] = []
    for key in sorted(set(actual) & set(expected)):
        a, e = actual[key], expected[key]
        diff = max_abs_diff(a, e)
        worst = max(worst, diff)
        if exact:
            same = a.shape == e.shape and a.dtype == e.dtype and torch.equal(a, e)
            if not same:
                differing.append((diff, f"{key} ({tuple(a.shape)} {a.dtype} vs {tuple(e.shape)} {e.dtype})"))
        else:
            check = compare_tensors(key, a, e, rtol=rtol, atol=atol)
            if not check.passed:
                differing.append((diff, f"{key} (max abs diff {diff:.3e})"))
    if differing:
        differing.sort(key=lambda item: -item[0])
        kind = "not bit-identical" if exact else "outside tolerance"
        problems.append(f"{len(differing)} tensors {kind}: {_head([d for _, d in differing])}")
    if not expected and not actual:
        problems.append("both sides are empty; nothing was compared")
    return CheckResult(
        name=name,
        passed=not problems,
        detail="; ".join(problems) if problems else f"{len(expected)} tensors",
        max_abs_diff=worst,
    )


def key_differences(actual: Mapping[str, object], expected: Mapping[str, object]) -> list[str]:
    """The keys ``actual`` lacks and the keys it has that ``expected`` does not, said in words."""
    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    problems: list[str] = []
    if missing:
        problems.append(f"missing keys {_head(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_head(unexpected)}")
    return problems


def _head(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return f"[{shown}{more}]"
