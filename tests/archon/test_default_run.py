"""The default run's split of the per-family tests: stage 5 and the AReaL tier of the families
outside ``DEFAULT_RUN_FAMILIES`` carry the ``every_family`` marker, which .ci/run runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import archon_models
from tests.archon.conftest import DEFAULT_RUN_FAMILIES, EVERY_FAMILY_MARKER

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
