"""The default run's split of the per-family tests: stage 5 and the AReaL tier of the families
outside ``DEFAULT_RUN_FAMILIES``, and stage 5 of the cases in ``STAGE5_VARIANTS_BEYOND_DEFAULT_RUN``,
carry the ``every_family`` marker, which .ci/run runs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import archon_models
from tests.archon.conftest import DEFAULT_RUN_FAMILIES, EVERY_FAMILY_MARKER, STAGE5_VARIANTS_BEYOND_DEFAULT_RUN

ARCHON_TESTS = Path(__file__).parent


def test_the_default_run_families_are_committed_and_tested():
    """A renamed or removed family must not leave the default run's stage 5 with fewer families."""
    packages = {p.parent.name for p in Path(archon_models.__file__).parent.glob("*/spec.py")}
    assert packages >= DEFAULT_RUN_FAMILIES, sorted(DEFAULT_RUN_FAMILIES - packages)
    tested = {p.stem.removeprefix("test_") for p in ARCHON_TESTS.glob("test_*.py")}
    assert tested >= DEFAULT_RUN_FAMILIES, sorted(DEFAULT_RUN_FAMILIES - tested)


def test_every_family_step_is_registered_and_run_by_ci(pytestconfig: pytest.Config):
    markers = " ".join(pytestconfig.getini("markers"))
    assert f"{EVERY_FAMILY_MARKER}:" in markers
    ci_run = (ARCHON_TESTS.parents[1] / ".ci" / "run").read_text()
    assert f"python -m pytest -n 2 -m {EVERY_FAMILY_MARKER}\n" in ci_run


def test_the_stage5_variants_left_to_every_family_are_cases_of_the_default_run_families():
    """Each names a case of a default-run family (a renamed case must not drop out silently), and
    every such family keeps the stage 5 of at least one case of each model type in the default run."""
    cases = {family: importlib.import_module(f"tests.archon.test_{family}").CASES for family in DEFAULT_RUN_FAMILIES}
    ids = {case.id for family_cases in cases.values() for case in family_cases}
    assert ids >= STAGE5_VARIANTS_BEYOND_DEFAULT_RUN, sorted(STAGE5_VARIANTS_BEYOND_DEFAULT_RUN - ids)
    for family, family_cases in cases.items():
        kept = {c.model_type for c in family_cases if c.id not in STAGE5_VARIANTS_BEYOND_DEFAULT_RUN}
        assert kept == {c.model_type for c in family_cases}, family
