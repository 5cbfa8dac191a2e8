"""Every committed package, renamed into AReaL 1.0.4, works as AReaL's engine uses it."""

from __future__ import annotations

import json

import pytest

from skill.areal.checks import TP_NOT_PLANNED, TP_REFUSED
from skill.areal.export import AReaLChecker
from skill.harness.case import ModelCase
from skill.harness.models import build_hf_config, installed_model_refused, unknown_model_type
from tests.archon.conftest import DEFAULT_RUN_FAMILIES
from tests.areal.conftest import _PROPERTY, AREAL_TREE_GROUP, committed_packages
from tests.conftest import ONE_PROCESS_OPTION

pytestmark = [pytest.mark.areal, pytest.mark.slow, AREAL_TREE_GROUP]

PACKAGE_OF = {t: package for package, types in committed_packages().items() for t in types}


def _param(model_type: str):  # type: ignore[no-untyped-def]
    """The model_type, skipped where the installed transformers has no config class for it
    (the AReaL-pins venv holds AReaL 1.0.4's transformers 5.3.0, older than some families), and
    marked ``every_family`` (left to .ci/run's own step) unless its package is one the default
    run proves in full."""
    unknown = unknown_model_type(model_type)
    marks = [] if unknown is None else [pytest.mark.skip(reason=unknown)]
    if PACKAGE_OF[model_type] not in DEFAULT_RUN_FAMILIES:
        marks.append(pytest.mark.every_family)
    return pytest.param(model_type, marks=marks, id=model_type)


def _maps_a_correction_bias(model_type: str) -> bool:
    """Whether the package's adapter loads a checkpoint key into the router's ``expert_bias``."""
    import archon_models

    adapter = archon_models.get_model_spec(model_type).state_dict_adapter_class
    return any(target and target.endswith(".moe.expert_bias") for target in adapter.from_hf_map.values())


def _ties_its_head(model_type: str) -> bool:
    """Whether the tier's model (the default case's config) ties the LM head to the embedding."""
    return bool(getattr(build_hf_config(ModelCase(model_type=model_type)), "tie_word_embeddings", False))


@pytest.mark.parametrize("model_type", [_param(t) for t in PACKAGE_OF])
def test_package_inside_areal(model_type: str, areal_checker: AReaLChecker, record_property, request) -> None:  # type: ignore[no-untyped-def]
    one_process = request.config.getoption(ONE_PROCESS_OPTION)
    result = areal_checker.check(model_type, distributed=not one_process)
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
    refused = installed_model_refused(ModelCase(model_type=model_type)) if failures else None
    if refused is not None:
        # Compared against another model than the package's (the checker's transformers is this one).
        pytest.skip(refused)
    assert result.package.startswith("areal.experimental.models.archon."), result.package
    assert not failures, "\n".join(f"{c.name}: {c.detail}" for c in failures)
    # The checks that must be there: both attention types, the roundtrip, the critic, TP and FSDP
    # (TP unless AReaL's own validate_tp_constraints refuses the model, e.g. one KV head, or the
    # package has no TP plan, e.g. a hybrid's linear-attention layers).
    # Built by AReaL's own engine code: every checkpoint tensor in the model after its load, the
    # router's score-correction bias kept (and fixed through a training step unless opted into
    # balancing), a tied head still tied after materialisation and after a training step.
    names = " | ".join(c.name for c in result.checks)
    tp = () if TP_REFUSED in names or TP_NOT_PLANNED in names or one_process else ("(tp=2)",)
    fsdp = () if one_process else ("(fsdp=2)",)
    bias = (
        ("score-correction bias: the checkpoint's", "bias fixed through a training step", "opted into balancing")
        if _maps_a_correction_bias(model_type)
        else ()
    )
    tie = ("tied LM head is the embedding's", "tied LM head still") if _ties_its_head(model_type) else ()
    for required in (
        "[AReaL, sdpa]",
        "[AReaL, varlen]",
        "every checkpoint tensor in the model after AReaL's load",
        *bias,
        *tie,
        "to_hf reproduces",
        "_orig_mod",
        "critic",
        *tp,
        *fsdp,
    ):
        assert required in names, f"missing check {required!r}"
