"""pyproject.toml accepts transformers from 5.3.0 on: a committed family the installed
version does not know, or a case whose override the installed config class rewrites, is
skipped with the version named, never failed; every other case runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers

from skill.harness import ModelCase, models
from tests.archon import conftest
from tests.archon.conftest import _skip_if_inexpressible


def test_a_known_family_runs():
    case = ModelCase(model_type="llama")
    assert _skip_if_inexpressible(case) is case


def test_a_family_the_installed_transformers_lacks_is_skipped_naming_the_version():
    case = ModelCase(model_type="a_family_from_the_future")
    param = _skip_if_inexpressible(case)
    assert param.values == (case,)
    (mark,) = param.marks
    assert mark.name == "skip"
    assert mark.kwargs["reason"] == (
        f"model_type 'a_family_from_the_future' is unknown to the installed transformers {transformers.__version__}"
    )


def test_an_override_the_config_keeps_runs():
    case = ModelCase(model_type="llama", config_overrides={"tie_word_embeddings": True, "layer_types": None})
    assert models.unhonoured_overrides(case) == []
    assert _skip_if_inexpressible(case) is case


def test_an_override_the_config_rewrites_is_named(monkeypatch: pytest.MonkeyPatch):
    # What transformers 5.3's Olmo3 config does to a per-layer-type rope_parameters.
    per_layer = {"full_attention": {"rope_type": "default", "rope_theta": 5e5}}
    merged = {**per_layer, "rope_type": "default", "rope_theta": 1e4}
    monkeypatch.setattr(models, "build_hf_config", lambda case: SimpleNamespace(rope_parameters=merged, head_dim=(8,)))
    case = ModelCase(model_type="llama", config_overrides={"rope_parameters": per_layer, "head_dim": [8]})
    assert models.unhonoured_overrides(case) == [f"rope_parameters={per_layer!r} became {merged!r}"]


def test_a_case_whose_override_is_rewritten_is_skipped_naming_the_version(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(conftest, "unhonoured_overrides", lambda case: ["rope_theta=1.0 became 2.0"])
    case = ModelCase(model_type="llama", config_overrides={"rope_theta": 1.0})
    (mark,) = _skip_if_inexpressible(case).marks
    assert mark.name == "skip"
    assert mark.kwargs["reason"] == (
        f"transformers {transformers.__version__}'s config does not keep this case's override: "
        "rope_theta=1.0 became 2.0"
    )
