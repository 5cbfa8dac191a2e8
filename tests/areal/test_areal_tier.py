"""Every committed package, renamed into AReaL 1.0.4, works as AReaL's engine uses it."""

from __future__ import annotations

import json

import pytest

from skill.areal.export import AReaLChecker
from tests.areal.conftest import _PROPERTY, committed_packages

pytestmark = [pytest.mark.areal, pytest.mark.slow]

MODEL_TYPES = [t for types in committed_packages().values() for t in types]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_package_inside_areal(model_type: str, areal_checker: AReaLChecker, record_property) -> None:  # type: ignore[no-untyped-def]
    result = areal_checker.check(model_type)
    record_property(
        _PROPERTY,
        json.dumps(
            {
                "model_type": model_type,
                "package": result.package,
                "logits": result.max_logit_diff,
                "grads": result.max_grad_diff,
                "seconds": result.seconds,
                "passed": result.passed,
            }
        ),
    )
    failures = [c for c in result.checks if not c.passed]
    assert result.package.startswith("areal.experimental.models.archon."), result.package
    assert not failures, "\n".join(f"{c.name}: {c.detail}" for c in failures)
    # The checks that must be there: both attention types, the roundtrip, the critic, TP and FSDP
    # (TP unless AReaL's validate_tp_constraints refuses the heads: one KV head cannot split).
    names = " | ".join(c.name for c in result.checks)
    tp = "tp=2 not applicable" if "tp=2 not applicable" in names else "(tp=2)"
    for required in ("[AReaL, sdpa]", "[AReaL, varlen]", "to_hf reproduces", "_orig_mod", "critic", tp, "(fsdp=2)"):
        assert required in names, f"missing check {required!r}"
