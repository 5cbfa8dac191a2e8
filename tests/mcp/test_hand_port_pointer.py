"""A step that fails for an unsupported feature or a missing file points to SKILL.md § Porting by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest
from mcp import Client

from mcp_server import build_server
from skill.console import reports_bad_input
from skill.errors import HAND_PORT_POINTER, HAND_PORT_SECTION, UnsupportedFeatureError
from tests.mcp.conftest import REPO


def _call(workspace: Path, tool: str, arguments: dict):
    async def main():
        async with Client(build_server(workspace, record=False)) as client:
            return await client.call_tool(tool, arguments)

    return anyio.run(main)


def test_skill_md_has_the_section_the_errors_point_to():
    skill_md = (REPO / "SKILL.md").read_text(encoding="utf-8")
    assert f"\n## {HAND_PORT_SECTION}\n" in skill_md


def test_an_unsupported_feature_points_to_the_hand_port_section(workspace: Path):
    result = _call(workspace, "toy_port_feature", {"model_name": "olmo", "feature": "clip_qkv"})
    assert result.is_error
    error = result.structured_content["error"]
    assert error["kind"] == "step_failed" and error["exception"] == "UnsupportedFeatureError"
    assert error["message"].startswith("olmo has a feature no edit supports: clip_qkv. Nothing was written.")
    assert error["message"].endswith(f"({HAND_PORT_POINTER})")
    assert error["see"] == f"{HAND_PORT_POINTER} (resource archon://skill)"


def test_a_missing_file_names_the_step_that_writes_it_and_points_to_the_section(workspace: Path):
    result = _call(workspace, "register_spec", {"model_name": "nopkg", "model_types": ["nopkg"]})
    error = result.structured_content["error"]
    assert error["exception"] == "FileNotFoundError"
    # The message names the steps that create the package, and the way past it.
    assert "archon-port add" in error["message"] and "copy_reference" in error["message"]
    assert HAND_PORT_POINTER in error["message"]
    assert error["see"] is not None


def test_other_failures_do_not_point_there(workspace: Path):
    (workspace / "empty.txt").write_text("")
    error = _call(workspace, "toy_read_note", {"model_name": "m", "note": "empty.txt"}).structured_content["error"]
    assert HAND_PORT_POINTER not in error["message"] and error["see"] is None


@pytest.mark.parametrize(
    ("error", "pointed"),
    [
        (UnsupportedFeatureError("granite has a feature no edit supports: x.", ["x"]), True),
        (FileNotFoundError("archon_models/x/model/model.py does not exist; run copy_reference first."), True),
        (ValueError("stage 7 does not exist; stages are 1 to 6."), False),
    ],
)
def test_the_cli_prints_the_pointer_on_the_same_errors(capsys, error: Exception, pointed: bool):
    @reports_bad_input
    def command() -> int:
        raise error

    assert command() == 2
    err = capsys.readouterr().err
    assert err.startswith(f"archon-port: error: {error}")
    assert (HAND_PORT_POINTER in err) is pointed


def test_a_hand_edited_weight_is_mapped_with_add_while_the_map_is_derived(workspace: Path):
    """Doge's attention parameter ``A`` and its layers' residual scales match no rule: the
    derivation names them, says to map them with ``add`` and points to the section; with ``add``
    in the same call the map is derived around them. (gpt_neox_japanese's last-layer
    ``dense_bias``, then DiffLlama's ``lambda_*`` vectors were the example until edits mapped them.)"""
    name = "doge"
    keys = {
        "model.layers.{}.self_attn.A": "layers.{}.attention.A",
        "model.layers.{}.input_residual": "layers.{}.input_residual",
        "model.layers.{}.post_attention_residual": "layers.{}.post_attention_residual",
    }
    copied = _call(workspace, "copy_reference", {"model_name": name, "reference": "qwen2", "model_types": [name]})
    assert not copied.is_error
    refused = _call(workspace, "edit_adapter_map", {"model_name": name, "source": name})
    error = refused.structured_content["error"]
    assert error["exception"] == "UnmappedKeyError" and all(key in error["message"] for key in keys)
    assert "`add`" in error["message"] and error["see"] is not None
    derived = _call(workspace, "edit_adapter_map", {"model_name": name, "source": name, "add": keys})
    assert not derived.is_error, derived.structured_content
    from_hf_map = derived.structured_content["from_hf_map"]
    assert {key: from_hf_map[key] for key in keys} == keys
    assert from_hf_map["model.layers.{}.self_attn.o_proj.weight"] == "layers.{}.attention.wo.weight"


# deepseek_v32 ports from deepseek_v3, a reference whose map no edit derives. With the analysis'
# indexer probe finding nothing (the fixture below), its sparse-attention indexer is a feature no
# edit writes, whose weights no rule maps: the example of a hand port on that reference (axk1's
# MoE output norm was it until the moe_output_norm edit, the indexer until the sparse_indexer edit).
SPARSE, INDEXER = "deepseek_v32", "model.layers.{}.self_attn.indexer."
INDEXER_KEYS = {
    f"{INDEXER}{module}.{param}": f"layers.{{}}.attention.indexer.{module}.{param}"
    for module, param in (
        ("k_norm", "bias"),
        ("k_norm", "weight"),
        ("weights_proj", "weight"),
        ("wk", "weight"),
        ("wq_b", "weight"),
    )
}


@pytest.fixture
def unrecognised_indexer(monkeypatch: pytest.MonkeyPatch):
    """The analysis with its sparse-attention indexer probe finding nothing."""
    from skill.analysis import detect
    from skill.porting import plan

    monkeypatch.setattr(detect, "sparse_indexer", lambda *args, **kwargs: None)
    plan._report.cache_clear()
    yield
    plan._report.cache_clear()


def _fresh_sparse(workspace: Path) -> None:
    shutil.rmtree(workspace / "archon_models" / SPARSE, ignore_errors=True)  # port it afresh here
    arguments = {"model_name": SPARSE, "reference": "deepseek_v3", "model_types": [SPARSE]}
    assert not _call(workspace, "copy_reference", arguments).is_error


def test_an_unmapped_key_of_a_reference_no_edit_derives_names_the_fix_and_the_section(
    workspace: Path, unrecognised_indexer: None
):
    """The refusal names the key, the fix on both faces (``add``, ``--add HF_KEY=ARCHON_KEY``) and
    ends with the pointer to SKILL.md § Porting by hand, as the ground rules promise."""
    _fresh_sparse(workspace)
    refused = _call(workspace, "edit_adapter_map", {"model_name": SPARSE, "source": SPARSE})
    error = refused.structured_content["error"]
    assert error["exception"] == "UnmappedKeyError" and all(key in error["message"] for key in INDEXER_KEYS)
    assert "`add`" in error["message"] and "`--add HF_KEY=ARCHON_KEY`" in error["message"]
    assert error["message"].endswith(f"({HAND_PORT_POINTER})") and error["see"] is not None


def test_the_documented_call_maps_a_hand_edited_weight_of_a_reference_no_edit_derives(
    workspace: Path, unrecognised_indexer: None
):
    """SKILL.md § Porting by hand, step 2: after the hand edit, call edit_adapter_map again with the
    same ``source`` and ``add``. For a deepseek_v3 family that call refused the added key as it did
    without it (only ``add`` without ``source`` passed)."""
    _fresh_sparse(workspace)
    arguments = {"model_name": SPARSE, "source": SPARSE, "add": INDEXER_KEYS}
    mapped = _call(workspace, "edit_adapter_map", arguments)
    assert not mapped.is_error, mapped.structured_content
    assert {key: mapped.structured_content["from_hf_map"][key] for key in INDEXER_KEYS} == INDEXER_KEYS
    assert mapped.structured_content["added"] == sorted(INDEXER_KEYS)
    # The entries now in the map keep the derivation passing without `add`.
    again = _call(workspace, "edit_adapter_map", {"model_name": SPARSE, "source": SPARSE})
    assert not again.is_error and again.structured_content["changed_files"] == []


def test_edit_args_returns_the_features_every_other_step_reports(workspace: Path, unrecognised_indexer: None):
    """With allow_unsupported, edit_args's skipped_features is the analysis's unsupported list, as
    edit_model's is: for a deepseek_v3 family it came back empty."""
    unsupported = _call(workspace, "analyze_hf_model", {"source": SPARSE}).structured_content["unsupported"]
    assert unsupported, "deepseek_v32's indexer is a feature no edit writes"
    _fresh_sparse(workspace)
    arguments = {"model_name": SPARSE, "source": SPARSE, "allow_unsupported": True}
    for tool in ("edit_args", "edit_model"):
        result = _call(workspace, tool, arguments)
        assert not result.is_error, result.structured_content
        assert result.structured_content["skipped_features"] == unsupported, tool
