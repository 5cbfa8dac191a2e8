"""The cached venvs' specs: exact pins (a range would let pip pick a CUDA torch), the
transformers-only venv that CI runs stages 1-4 in holds no AReaL, and the venv on AReaL's own
pins holds AReaL with torch 2.10.0 and transformers 5.3.0."""

from __future__ import annotations

from importlib import metadata

from skill.areal.environment import (
    AREAL_RUNTIME_REQUIREMENTS,
    AREAL_TORCH,
    AREAL_VERSION,
    OLDEST_TRANSFORMERS,
    _read_stamp,
    default_spec,
    transformers_spec,
)


def test_the_areal_spec_pins_this_interpreters_torch_and_transformers():
    spec = default_spec()
    assert spec.areal_version == AREAL_VERSION and spec.requirements == AREAL_RUNTIME_REQUIREMENTS
    assert spec.torch == metadata.version("torch").split("+")[0]
    assert spec.transformers == metadata.version("transformers")


def test_the_transformers_spec_has_no_areal_and_the_oldest_transformers():
    spec = transformers_spec()
    assert spec.areal_version is None and spec.requirements == ()
    assert spec.transformers == OLDEST_TRANSFORMERS == "5.3.0"
    assert spec.torch == default_spec().torch and spec.parent_site == default_spec().parent_site
    assert spec != default_spec(OLDEST_TRANSFORMERS)  # the stamps differ: one venv never passes for the other


def test_the_areal_pins_spec_holds_areals_newest_torch_and_transformers():
    spec = default_spec(OLDEST_TRANSFORMERS, AREAL_TORCH)
    assert spec.areal_version == AREAL_VERSION and spec.requirements == AREAL_RUNTIME_REQUIREMENTS
    # AReaL 1.0.4's pins: torch>=2.9.1,<2.11 and transformers>=5.0.0,<=5.3.0; exact, never a range.
    assert (spec.torch, spec.transformers) == ("2.10.0", "5.3.0")
    assert spec.parent_site == default_spec().parent_site
    assert spec != default_spec()


def test_a_stamp_round_trips_and_a_missing_venv_has_none(tmp_path):
    spec = transformers_spec()
    venv = tmp_path / "venv"
    assert _read_stamp(venv) is None
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "archon-port-env.json").write_text(spec.model_dump_json())
    assert _read_stamp(venv) == spec
