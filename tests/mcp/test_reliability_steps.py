"""Steps refuse cleanly, writing nothing: on a package that does not exist, over a reference
package, and for a family the analyser refuses."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from skill import tools
from skill.cli import main as cli_main
from skill.porting.register_spec import ARCHON_INIT


def _snapshot(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".archon-port" not in p.parts and "__pycache__" not in p.parts
    }


STEPS_ON_A_PACKAGE = {
    "edit_args": {"source": "llama"},
    "edit_model": {"source": "llama"},
    "set_rope": {"source": "llama"},
    "edit_adapter_map": {"source": "llama"},
    "write_parallelize": {"source": "llama"},
    "register_spec": {},
    "run_test_stage": {"stage": 1, "model_type": "llama"},
}


@pytest.mark.parametrize("step", sorted(STEPS_ON_A_PACKAGE))
def test_a_step_on_a_package_that_does_not_exist_writes_nothing(workspace: Path, step: str):
    before = _snapshot(workspace)
    with pytest.raises(FileNotFoundError) as caught:
        tools.invoke(step, {"model_name": "ghost", **STEPS_ON_A_PACKAGE[step]}, workspace=workspace)
    message = str(caught.value)
    assert "archon_models/ghost/ does not exist" in message and "archon-port add" in message
    assert "\n" not in message
    assert _snapshot(workspace) == before
    assert not (workspace / "archon_models" / "ghost").exists()


def test_cli_stage_on_a_missing_package_is_one_line_and_writes_no_test_file(workspace: Path, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    assert cli_main(["stage", "doge", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "archon_models/doge/ does not exist" in err
    assert not (workspace / "tests" / "archon" / "test_doge.py").exists()


@pytest.mark.parametrize("reference", ["qwen2", "qwen3", "deepseek_v3"])
def test_overwrite_never_replaces_a_reference(workspace: Path, reference: str):
    before = _snapshot(workspace)
    other = "qwen3" if reference == "qwen2" else "qwen2"
    with pytest.raises(ValueError, match="reference package"):
        tools.invoke(
            "copy_reference", {"model_name": reference, "reference": other, "overwrite": True}, workspace=workspace
        )
    result = tools.invoke(
        "port_model",
        {"source": "llama", "model_name": reference, "overwrite": True, "stages": []},
        workspace=workspace,
    )
    assert not result.passed and result.failed_step == "analyze"
    assert "reference package" in result.error and "never replaced" in result.error
    assert _snapshot(workspace) == before


@pytest.mark.parametrize("family", ["bert", "jamba", "t5", "llava"])
def test_port_model_refuses_what_the_analyser_refuses_with_its_message(workspace: Path, family: str):
    from skill.analysis import AnalysisError

    with pytest.raises(AnalysisError) as refused:
        tools.invoke("analyze_hf_model", {"source": family}, workspace=workspace)
    before = _snapshot(workspace)
    result = tools.invoke("port_model", {"source": family, "stages": []}, workspace=workspace)
    assert not result.passed and result.failed_step == "analyze"
    assert result.error == f"AnalysisError: {refused.value}"
    assert _snapshot(workspace) == before


def test_cli_add_of_a_refused_family_is_one_line_and_exit_2(workspace: Path, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    registry = (workspace / ARCHON_INIT).read_text()
    assert cli_main(["add", "t5", "--stages", ""]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "encoder-decoder" in captured.err
    assert (workspace / ARCHON_INIT).read_text() == registry
