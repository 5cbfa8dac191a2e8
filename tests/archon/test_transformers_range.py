"""pyproject.toml accepts transformers from 5.3.0 on: a committed family the installed
version does not know is skipped with the version named, never failed."""

from __future__ import annotations

import transformers

from skill.harness import ModelCase
from tests.archon.conftest import _skip_if_unknown


def test_a_known_family_runs():
    case = ModelCase(model_type="llama")
    assert _skip_if_unknown(case) is case


def test_a_family_the_installed_transformers_lacks_is_skipped_naming_the_version():
    case = ModelCase(model_type="a_family_from_the_future")
    param = _skip_if_unknown(case)
    assert param.values == (case,)
    (mark,) = param.marks
    assert mark.name == "skip"
    assert mark.kwargs["reason"] == (
        f"model_type 'a_family_from_the_future' is unknown to the installed transformers {transformers.__version__}"
    )
