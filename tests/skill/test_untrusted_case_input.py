"""What a caller names in a test case (model_type, config overrides) reaches a generated test file
only as a checked literal: no code, no path outside the workspace, no NaN, no control character,
no size that would make the tiny model large; and a stage whose every test skipped did not pass."""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from skill.cli import main as cli_main
from skill.porting.locate_divergence import LocateDivergenceRequest
from skill.porting.overrides import MAX_CONTEXT, MAX_COUNT, MAX_VOCAB, MAX_WIDTH
from skill.porting.run_test_stage import RunTestStageRequest, StageTest, run_stage_subprocess, stage_verdict
from skill.porting.test_file import add_override_case, read_cases
from skill.tools import InvalidArgumentsError, invoke

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def stage_workspace(tmp_path: Path) -> Path:
    """archon_models/ and the stage tests' conftest, without llama's test file."""
    root = tmp_path / "ws"
    shutil.copytree(REPO / "archon_models", root / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "archon").mkdir(parents=True)
    for rel in ("tests/__init__.py", "tests/archon/__init__.py", "tests/archon/conftest.py"):
        shutil.copy(REPO / rel, root / rel)
    return root


def test_a_model_type_holding_code_or_naming_a_folder_outside_is_refused(stage_workspace: Path, tmp_path: Path):
    """A folder outside the workspace whose name closes the string literal: read as a
    checkpoint folder and written unescaped, its name ran as code in the stage (19fb638)."""
    marker = tmp_path / "pwned"
    payload = f'x", config_overrides={{}}), __import__("os").system("touch {marker.name}"), ModelCase(model_type="y'
    folder = tmp_path / "outside" / payload
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    test_file = stage_workspace / "tests/archon/test_llama.py"
    for model_type in (str(folder), payload, "../llama", "/etc"):
        with pytest.raises(InvalidArgumentsError, match=r"model_type: .*is not a model_type name"):
            invoke(
                "run_test_stage",
                {"model_name": "llama", "stage": 1, "model_type": model_type},
                workspace=stage_workspace,
            )
        with pytest.raises(ValidationError, match="is not a model_type name"):
            LocateDivergenceRequest(model_name="llama", model_type=model_type)
    assert not test_file.exists() and not marker.exists() and not (stage_workspace / marker.name).exists()


def test_a_name_that_could_be_a_folder_is_no_model_type_for_a_new_test_file(stage_workspace: Path, monkeypatch):
    """A bare name resolving to a folder in the server's working directory is not read as a checkpoint."""
    (stage_workspace / "lookalike").mkdir()
    (stage_workspace / "lookalike" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.chdir(stage_workspace)
    with pytest.raises(ValueError, match="'lookalike' is not a model_type of the installed transformers"):
        arguments = {"model_name": "llama", "stage": 1, "model_type": "lookalike"}
        invoke("run_test_stage", arguments, workspace=stage_workspace)
    assert not (stage_workspace / "tests/archon/test_llama.py").exists()


REFUSED_OVERRIDES = {
    "nan": ({"rms_norm_eps": math.nan}, "not a finite number"),
    "infinity": ({"rope_theta": math.inf}, "not a finite number"),
    "nested_infinity": ({"rope_parameters": {"factor": -math.inf}}, "not a finite number"),
    "file_separator": ({"hidden_act": "gelu\x1c"}, "control character '\\\\x1c'"),
    "newline": ({"hidden_act": "gelu\nimport os"}, "control character '\\\\n'"),
    "line_separator": ({"hidden_act": "gelu\u2028"}, "control character"),
    "newline_in_a_nested_key": ({"rope_parameters": {"a\nb": 1.0}}, "control character"),
    "vocabulary": ({"vocab_size": 5_000_000}, f"above the bound of {MAX_VOCAB} on a vocabulary"),
    "vocabulary_as_float": ({"vocab_size": 4e9}, f"above the bound of {MAX_VOCAB} on a vocabulary"),
    "width": ({"hidden_size": 65536}, f"above the bound of {MAX_WIDTH} on a width"),
    "layers": ({"num_hidden_layers": 1000}, f"above the bound of {MAX_COUNT} on a count"),
    "nested_length": (
        {"rope_parameters": {"original_max_position_embeddings": 10**9}},
        f"above the bound of {MAX_CONTEXT} on a context length",
    ),
    "not_an_attribute": ({"x; import os": 1}, "not a config attribute name"),
    "remote_code": ({"auto_map": {"AutoConfig": "evil.Config"}}, "chooses the code that builds the model"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED_OVERRIDES))
def test_an_override_that_is_not_a_small_plain_literal_is_refused_with_one_line(kind: str):
    overrides, message = REFUSED_OVERRIDES[kind]
    for model in (RunTestStageRequest, LocateDivergenceRequest):
        arguments = {"model_name": "llama", "config_overrides": overrides}
        if model is RunTestStageRequest:
            arguments["stage"] = 4
        with pytest.raises(ValidationError, match=message) as refused:
            model.model_validate(arguments)
        assert len(refused.value.errors()) == 1 and "\n" not in refused.value.errors()[0]["msg"]


def test_overrides_the_committed_cases_use_stay_accepted():
    for path in sorted((REPO / "tests/archon").glob("test_*.py")):
        try:
            cases = read_cases(path.read_text())
        except Exception:  # a harness test, not a family's stage file
            continue
        for case in cases:
            RunTestStageRequest(model_name="llama", stage=1, config_overrides=case.get("config_overrides", {}))


BAD_CLI_OVERRIDES = ["rms_norm_eps=NaN", "rope_theta=Infinity", "hidden_act=a\nb", "vocab_size=5000000"]


@pytest.mark.parametrize("override", BAD_CLI_OVERRIDES)
def test_the_cli_refuses_a_bad_override_with_one_line_and_writes_nothing(
    stage_workspace: Path, monkeypatch, capsys, override: str
):
    shutil.copy(REPO / "tests/archon/test_llama.py", stage_workspace / "tests/archon/test_llama.py")
    before = (stage_workspace / "tests/archon/test_llama.py").read_text()
    monkeypatch.chdir(stage_workspace)
    assert cli_main(["stage", "llama", "4", "--override", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("archon-port: error: ") and "Traceback" not in err, err
    assert (stage_workspace / "tests/archon/test_llama.py").read_text() == before


def test_a_control_character_already_in_a_case_does_not_stop_new_cases():
    """A raw U+001C inside a string of CASES (written by an older engine, or by hand): Python
    reads it inside the literal, str.splitlines() ends a line at it; the file must still take cases."""
    text = (REPO / "tests/archon/test_llama.py").read_text()
    crafted, _ = add_override_case(text, None, {"hidden_act": "gelu"})
    crafted = crafted.replace('"hidden_act": "gelu"', '"hidden_act": "ge\x1clu"')
    assert read_cases(crafted)[1]["config_overrides"]["hidden_act"] == "ge\x1clu"
    new, case = add_override_case(crafted, None, {"rms_norm_eps": 0.5})
    cases = read_cases(new)
    assert [c.get("name") for c in cases] == [None, "llama-hidden_act-gelu", case]
    assert cases[1]["config_overrides"]["hidden_act"] == "ge\x1clu"
    compile(new, "test_llama.py", "exec")


def test_strings_are_written_as_escaped_literals():
    text = (REPO / "tests/archon/test_llama.py").read_text()
    value = "quote \" and ' and back\\slash and \x1c and \u2028"
    new, _ = add_override_case(text, None, {"hidden_act": value})
    assert "\x1c" not in new and "\u2028" not in new
    assert read_cases(new)[1]["config_overrides"]["hidden_act"] == value
    node = ast.parse(new)
    assert not [n for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "__import__"]


# --- a stage that only skipped ---------------------------------------------------------------

SKIPPING_TEST_FILE = """
import pytest


@pytest.mark.stage4
def test_stage4_parity():
    pytest.skip("the tiny model cannot be built here")
"""


def test_a_stage_whose_every_test_skipped_did_not_pass(stage_workspace: Path):
    (stage_workspace / "tests/archon/test_llama.py").write_text(SKIPPING_TEST_FILE)
    result = run_stage_subprocess(stage_workspace, "llama", 4, timeout_s=300)
    assert [t.outcome for t in result.tests] == ["skipped"]
    assert result.passed is False
    assert "every test of the stage was skipped (the tiny model cannot be built here)" in result.reason


def test_the_verdict_needs_one_passed_test_and_no_failure():
    passed = StageTest(test="a", outcome="passed", seconds=0.0)
    skipped = StageTest(test="b", outcome="skipped", seconds=0.0, message="needs CUDA")
    failed = StageTest(test="c", outcome="failed", seconds=0.0)
    assert stage_verdict([passed, skipped], 0) == (True, "")
    assert stage_verdict([skipped], 0)[0] is False and "needs CUDA" in stage_verdict([skipped], 0)[1]
    assert stage_verdict([passed, failed], 1) == (False, "1 of 2 test(s) failed: c")
    assert stage_verdict([], 5) == (False, "no test of the stage ran (pytest exit 5)")


# --- a divergence run that fails --------------------------------------------------------------


def test_diverge_whose_child_fails_is_one_line(stage_workspace: Path):
    # 7 is no multiple of the 4 heads: the child cannot build the model and raises.
    (stage_workspace / "tests/archon/test_llama.py").write_text(
        "from skill.harness import ModelCase\n\n"
        'CASES = [ModelCase(model_type="llama", config_overrides={"hidden_size": 7})]\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "skill.cli", "diverge", "llama"],
        cwd=stage_workspace,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith(("INFO ", "DEBUG "))]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("archon-port: error: divergence run of llama failed (exit 1): "), errors
    assert proc.stdout == ""
