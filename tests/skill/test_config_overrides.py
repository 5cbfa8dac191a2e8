"""config_overrides: an extra test case that proves a feature a default hides, through every face."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from skill import session as sessions
from skill.cli import build_parser
from skill.codemod import StagedTree, Workspace
from skill.porting.run_test_stage import ensure_test_file
from skill.porting.test_file import CasesError, add_override_case, carry_extra_cases, read_cases
from skill.tools import invoke

REPO = Path(__file__).resolve().parents[2]


def test_an_override_case_is_added_once_on_top_of_the_generated_case():
    text = (REPO / "tests/archon/test_granite.py").read_text()
    generated = read_cases(text)[0]["config_overrides"]

    once, case = add_override_case(text, None, {"residual_multiplier": 0.125, "clip_qkv": 8.0})

    assert case == "granite-residual_multiplier-0.125-clip_qkv-8.0"
    cases = read_cases(once)
    assert len(cases) == 2 and cases[0] == read_cases(text)[0]  # the generated case is kept as it was
    # The generated overrides stay (they exercise the multipliers); the new ones win where they overlap.
    assert cases[1] == {
        "model_type": "granite",
        "config_overrides": {**generated, "residual_multiplier": 0.125, "clip_qkv": 8.0},
        "name": case,
    }
    compile(once, "test_granite.py", "exec")
    # The same overrides again: nothing changes, the same case is named.
    assert add_override_case(once, None, {"residual_multiplier": 0.125, "clip_qkv": 8.0}) == (once, case)
    assert add_override_case(once, "granite", {"clip_qkv": 8.0, "residual_multiplier": 0.125}) == (once, case)
    # Different overrides: one more case, and the comment that explains them is written once.
    twice, other = add_override_case(once, None, {"clip_qkv": 4.0})
    assert other == "granite-clip_qkv-4.0" and len(read_cases(twice)) == 3
    assert twice.count("# Extra cases from run_test_stage") == 1


def test_an_override_case_turns_a_one_line_case_list_into_one_case_a_line():
    text = (REPO / "tests/archon/test_gemma.py").read_text()
    assert 'CASES = [ModelCase(model_type="gemma", config_overrides={"num_key_value_heads": 2})]' in text
    new, case = add_override_case(text, None, {"hidden_act": "gelu", "rope_parameters": {"rope_type": "default"}})
    assert case == "gemma-hidden_act-gelu-rope_parameters-rope_type_default"
    assert '    ModelCase(model_type="gemma", config_overrides={"num_key_value_heads": 2}),\n' in new
    assert read_cases(new)[1]["config_overrides"] == {
        "num_key_value_heads": 2,
        "hidden_act": "gelu",
        "rope_parameters": {"rope_type": "default"},
    }
    with pytest.raises(CasesError, match="CASES"):
        add_override_case("import torch\n", None, {"clip_qkv": 8.0})


def test_a_regenerated_test_file_keeps_the_named_cases_of_the_one_it_replaces(tmp_path):
    """``add --overwrite`` rewrites the test file; the override cases proving what a default
    hides (olmo3's per-layer-type RoPE thetas) must survive it, once, by name."""
    old = (REPO / "tests/archon/test_olmo3.py").read_text()
    old_cases = read_cases(old)
    assert len(old_cases) == 2 and "name" in old_cases[1]
    shutil.copytree(REPO / "archon_models", tmp_path / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    tree = StagedTree(Workspace(tmp_path))
    assert ensure_test_file(tree, "olmo3", "olmo3", keep_cases_of=old) == ["tests/archon/test_olmo3.py"]
    regenerated = tree.read_text("tests/archon/test_olmo3.py") or ""
    assert read_cases(regenerated) == old_cases
    compile(regenerated, "test_olmo3.py", "exec")
    # Carrying again adds nothing; a replaced file whose CASES cannot be read carries nothing.
    assert carry_extra_cases(old, regenerated) == regenerated
    fresh = read_cases(regenerated)[:1]
    assert read_cases(carry_extra_cases("CASES = make_cases()\n", old)) == old_cases
    assert fresh == old_cases[:1]


@pytest.fixture
def stage_workspace(tmp_path) -> Path:
    """archon_models/ and the stage tests' conftest: enough to run a package's stages."""
    shutil.copytree(REPO / "archon_models", tmp_path / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests" / "archon").mkdir(parents=True)
    for rel in (
        "tests/__init__.py",
        "tests/archon/__init__.py",
        "tests/archon/conftest.py",
        "tests/archon/test_llama.py",
    ):
        shutil.copy(REPO / rel, tmp_path / rel)
    return tmp_path


def test_run_test_stage_adds_the_override_case_runs_only_it_and_records_it(stage_workspace):
    test_file = stage_workspace / "tests/archon/test_llama.py"
    session = stage_workspace / "session.jsonl"
    arguments = {"model_name": "llama", "stage": 1, "config_overrides": {"rms_norm_eps": 0.5}}

    with sessions.recording(session, stage_workspace):
        result = invoke("run_test_stage", arguments, workspace=stage_workspace)
        again = invoke("run_test_stage", arguments, workspace=stage_workspace)

    assert result.passed, result.output_tail
    assert result.case_id == "llama-rms_norm_eps-0.5"
    assert result.changed_files == ["tests/archon/test_llama.py"]
    assert [t.test for t in result.tests] == ["test_stage1_args[llama-rms_norm_eps-0.5]"]
    generated = read_cases(test_file.read_text())[0]["config_overrides"]
    assert read_cases(test_file.read_text())[1]["config_overrides"] == {**generated, "rms_norm_eps": 0.5}
    assert again.passed and again.changed_files == [] and again.case_id == result.case_id
    calls = [r for r in sessions.read_session(session) if r.kind == "call"]
    assert [c.arguments["config_overrides"] for c in calls] == [{"rms_norm_eps": 0.5}] * 2
    assert list(calls[0].files) == ["tests/archon/test_llama.py"] and not calls[1].files


def test_the_cli_reads_override_values_as_json_when_they_parse(capsys):
    parser = build_parser()
    stage = parser.parse_args(
        [
            "stage",
            "olmo",
            "4",
            "--override",
            "clip_qkv=8.0",
            "--override",
            "hidden_act=gelu",
            "--override",
            'rope_parameters={"factor": 2.0}',
            "--override",
            "use_bias=true",
        ]
    )
    assert stage.config_overrides == {
        "clip_qkv": 8.0,
        "hidden_act": "gelu",
        "rope_parameters": {"factor": 2.0},
        "use_bias": True,
    }
    diverge = parser.parse_args(["diverge", "granite", "--override", "residual_multiplier=0.5"])
    assert diverge.config_overrides == {"residual_multiplier": 0.5}
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["stage", "olmo", "4", "--override", "clip_qkv"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KEY=VALUE" in err and "--override" in err, err
