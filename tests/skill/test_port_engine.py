"""The porting steps on a temporary copy of the project: rename, register, refuse, reproduce."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from skill.porting.check_package import CheckPackageRequest, check_package
from skill.porting.copy_reference import CopyReferenceRequest, copy_reference
from skill.porting.port_model import PortModelRequest, port_model
from skill.porting.register_spec import RegisterSpecRequest, register_spec

REPO = Path(__file__).resolve().parents[2]


def _snapshot(root: Path) -> dict[str, bytes]:
    """The project's files (not caches, not the engine's own state under .archon-port/)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and ".archon-port" not in p.parts
    }


@pytest.fixture
def workspace(tmp_path) -> Path:
    """A copy of archon_models/ and tests/archon/ (the engine writes into both)."""
    shutil.copytree(REPO / "archon_models", tmp_path / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests" / "archon").mkdir(parents=True)
    return tmp_path


def test_copy_reference_renames_and_refuses_a_different_existing_package(workspace):
    request = CopyReferenceRequest(model_name="newfam", reference="qwen2", workspace=workspace)
    result = copy_reference(request)
    model = (workspace / "archon_models/newfam/model/model.py").read_text()
    assert "class NewfamModel(BaseArchonModel)" in model
    assert "from archon_models.newfam.model.args import NewfamModelArgs" in model
    assert "qwen2" not in model.lower().replace("qwen2.model.rope", "")
    spec = (workspace / "archon_models/newfam/spec.py").read_text()
    assert "NEWFAM_SPEC" in spec and "parallelize_newfam" in spec
    assert len(result.changed_files) == len(result.files)
    assert copy_reference(request).changed_files == []  # identical: a no-op
    (workspace / "archon_models/newfam/model/model.py").write_text(model + "\n# hand edit\n")
    before = _snapshot(workspace)
    with pytest.raises(FileExistsError, match="overwrite"):
        copy_reference(request)
    assert _snapshot(workspace) == before


def test_register_spec_is_idempotent_and_refuses_a_taken_model_type(workspace):
    copy_reference(CopyReferenceRequest(model_name="newfam", reference="qwen2", workspace=workspace))
    first = register_spec(RegisterSpecRequest(model_name="newfam", model_types=["newfam"], workspace=workspace))
    assert "archon_models/__init__.py" in first.changed_files
    init = (workspace / "archon_models/__init__.py").read_text()
    assert first.import_line in init
    assert (
        register_spec(
            RegisterSpecRequest(model_name="newfam", model_types=["newfam"], workspace=workspace)
        ).changed_files
        == []
    )
    before = _snapshot(workspace)
    with pytest.raises(ValueError, match=re.escape("archon_models/llama/spec.py")):
        register_spec(RegisterSpecRequest(model_name="newfam", model_types=["llama"], workspace=workspace))
    assert _snapshot(workspace) == before


def test_port_model_reproduces_the_committed_llama_and_a_rerun_changes_nothing(workspace):
    shutil.rmtree(workspace / "archon_models/llama")
    init = workspace / "archon_models/__init__.py"
    lines = init.read_text().splitlines(keepends=True)
    init.write_text("".join(line for line in lines if "archon_models.llama " not in line))
    result = port_model(PortModelRequest(source="llama", stages=[], workspace=workspace))
    assert result.passed, result.error
    assert result.edits == ["projection_bias"]
    for path in sorted((REPO / "archon_models/llama").rglob("*.py")):
        rel = path.relative_to(REPO)
        assert (workspace / rel).read_text() == path.read_text(), f"{rel} differs from the committed port"
    assert (workspace / "tests/archon/test_llama.py").read_text() == (REPO / "tests/archon/test_llama.py").read_text()
    assert "from archon_models.llama import spec as llama_spec" in init.read_text()
    before = _snapshot(workspace)
    again = port_model(PortModelRequest(source="llama", stages=[], workspace=workspace))
    assert again.passed and again.changed_files == []
    assert _snapshot(workspace) == before


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_port_model_of_a_type_a_reference_serves_writes_nothing(workspace, model_type):
    # deepseek_v3 is the MLA reference: the analyser picks it, and add is served by it like
    # the qwen references' own types.
    before = _snapshot(workspace)
    result = port_model(PortModelRequest(source=model_type, stages=[], workspace=workspace))
    assert result.passed, result.error
    reference = "qwen3" if model_type == "qwen3_moe" else model_type
    assert (result.model_name, result.reference, result.unsupported) == (reference, reference, [])
    served = [s for s in result.steps if s.step == "served"]
    assert served and served[0].detail == f"by the {reference} reference"
    assert result.changed_files == []
    assert _snapshot(workspace) == before


def test_port_model_of_an_alias_type_is_served_by_the_package_of_its_config(workspace):
    # transformers maps gpt-sw3 to GPT2Config (model_type gpt2): its checkpoints say gpt2, which
    # archon_models/gpt2 registers. add gpt-sw3 writes nothing (before: it regenerated gpt2 with
    # a different header and failed "exists and differs").
    before = _snapshot(workspace)
    result = port_model(PortModelRequest(source="gpt-sw3", stages=[], workspace=workspace))
    assert result.passed, result.error
    assert (result.model_name, result.model_types, result.changed_files) == ("gpt2", ["gpt2"], [])
    served = [s for s in result.steps if s.step == "served"]
    assert served and served[0].detail == "gpt-sw3 is transformers' gpt2: by archon_models/gpt2"
    assert _snapshot(workspace) == before


def test_port_model_reproduces_the_committed_glm4_moe_lite_from_the_mla_reference(workspace):
    # glm4_moe_lite is copied from deepseek_v3 with no model edit; its dense/sparse MoE layer
    # list (mlp_layer_types) replaces the reference's leading-dense rule in the args.
    shutil.rmtree(workspace / "archon_models/glm4_moe_lite")
    init = workspace / "archon_models/__init__.py"
    lines = init.read_text().splitlines(keepends=True)
    init.write_text("".join(line for line in lines if "archon_models.glm4_moe_lite " not in line))
    result = port_model(PortModelRequest(source="glm4_moe_lite", stages=[], workspace=workspace))
    assert result.passed, result.error
    assert (result.reference, result.edits) == ("deepseek_v3", [])
    for path in sorted((REPO / "archon_models/glm4_moe_lite").rglob("*.py")):
        rel = path.relative_to(REPO)
        assert (workspace / rel).read_text() == path.read_text(), f"{rel} differs from the committed port"
    args = (workspace / "archon_models/glm4_moe_lite/model/args.py").read_text()
    assert 'self.mlp_layer_types[layer_id] == "sparse"' in args and "first_k_dense_replace" not in args
    rope = (workspace / "archon_models/glm4_moe_lite/model/rope.py").read_text()
    assert "def apply_interleaved_rotary_emb" in rope  # the reference's own RoPE, not a qwen2 re-export


def test_only_block_contract_edits_target_the_mla_reference(workspace):
    from skill.porting.edit_model import EditModelRequest, edit_model
    from skill.porting.model_edits import MLA_MODEL_EDITS, select_edits
    from skill.porting.plan import plan_for

    plan = plan_for("glm4_moe_lite")
    text = (REPO / "archon_models/deepseek_v3/model/model.py").read_text()
    assert plan.reference == "deepseek_v3" and select_edits(plan, text) == []
    # A dense MLA family with scalar factors gets exactly the block-contract edits.
    minicpm3 = plan_for("minicpm3")
    assert select_edits(minicpm3, text) == [
        "residual_multiplier",
        "dense_layers",
        "embedding_multiplier",
        "logits_multiplier",
    ]
    assert set(select_edits(minicpm3, text)) <= set(MLA_MODEL_EDITS)
    before = _snapshot(workspace)
    with pytest.raises(ValueError, match="targets the deepseek_v3 reference's modules; projection_bias cannot"):
        edit_model(
            EditModelRequest(
                model_name="glm4_moe_lite", source="glm4_moe_lite", edits=["projection_bias"], workspace=workspace
            )
        )
    assert _snapshot(workspace) == before


def test_port_model_refuses_an_unsupported_feature_before_writing(workspace):
    before = _snapshot(workspace)
    # Doge's attention parameter A (its dynamic mask's scale) is outside every edit.
    result = port_model(PortModelRequest(source="doge", stages=[], workspace=workspace))
    assert not result.passed
    assert "A (DogeAttention)" in result.error and "Nothing was written" in result.error
    assert _snapshot(workspace) == before


def test_port_model_refuses_a_changed_package_without_overwrite(workspace):
    model = workspace / "archon_models/llama/model/model.py"
    model.write_text(model.read_text() + "\n# a hand edit\n")
    before = _snapshot(workspace)
    result = port_model(PortModelRequest(source="llama", stages=[], workspace=workspace))
    assert not result.passed and "overwrite" in result.error
    assert _snapshot(workspace) == before


def test_ctrl_c_while_writing_leaves_no_half_package(workspace, monkeypatch):
    shutil.rmtree(workspace / "archon_models/llama")
    init = workspace / "archon_models/__init__.py"
    lines = init.read_text().splitlines(keepends=True)
    init.write_text("".join(line for line in lines if "archon_models.llama " not in line))
    before = _snapshot(workspace)
    real_replace = os.replace
    calls = []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 5:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        port_model(PortModelRequest(source="llama", stages=[], workspace=workspace))
    assert _snapshot(workspace) == before
    assert not (workspace / "archon_models/llama").exists()


@pytest.mark.parametrize("name", ["../escape", "Llama", "my-llama"])
def test_port_model_refuses_bad_model_names(name):
    with pytest.raises(ValidationError):
        PortModelRequest(source="llama", model_name=name)


def test_check_package_catches_the_guides_common_mistakes(workspace):
    request = CheckPackageRequest(model_name="llama", workspace=workspace)
    assert check_package(request).passed
    adapter = workspace / "archon_models/llama/model/state_dict_adapter.py"
    adapter.write_text(
        adapter.read_text().replace('        "model.layers.{}.self_attn.rotary_emb.inv_freq": None,\n', "")
    )
    model = workspace / "archon_models/llama/model/model.py"
    model.write_text(model.read_text() + "\nprint('debug')\n")
    init = workspace / "archon_models/__init__.py"
    init.write_text(init.read_text().replace("from archon_models.llama import spec as llama_spec  # noqa: F401\n", ""))
    args = workspace / "archon_models/llama/model/args.py"
    args.write_text(args.read_text().replace("hf_config.intermediate_size", "hf_config.ffn_dim"))
    failed = {c.name for c in check_package(request).failures}
    assert failed == {"runtime_buffers_dropped", "logging_not_print", "import_line", "config_attributes"}


def test_cli_add_reports_a_bad_name_in_one_line(capsys):
    from skill.cli import main

    assert main(["add", "llama", "--name", "../escape", "--stages", ""]) == 2
    err = capsys.readouterr().err
    # The option the person typed, the field it fills, and the fix, on one line.
    assert err.startswith("archon-port: error: --name (model_name): Model name '../escape' would leave archon_models/")
    assert err.count("\n") == 1 and "pass a bare package name" in err


def _tp_plan_modules(result):
    return next(c for c in result.checks if c.name == "tp_plan_modules")


def test_check_package_fails_a_tp_plan_entry_that_matches_no_module(workspace):
    request = CheckPackageRequest(model_name="llama", workspace=workspace)
    clean = _tp_plan_modules(check_package(request))
    assert clean.passed, clean.detail
    plan = workspace / "archon_models/llama/infra/parallelize.py"
    text = plan.read_text()
    wo = '            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),\n'
    norm = '        root_plan["norm"] = SequenceParallel()\n'
    assert wo in text and norm in text
    # llama has no QK norm, and its final norm is called `norm`, not `final_norm`.
    text = text.replace(wo, wo + '            "attention.q_norm": SequenceParallel(sequence_dim=2),\n')
    text = text.replace(norm, norm + '        root_plan["final_norm"] = SequenceParallel()\n')
    plan.write_text(text)

    check = _tp_plan_modules(check_package(request))

    assert not check.passed
    assert "layer-level plan entry 'attention.q_norm'" in check.detail
    assert "model-level plan entry 'final_norm'" in check.detail
    assert "applied to layers.0-" in check.detail and "wq" in check.detail  # where, and what the block has
    assert "re-run write_parallelize" in check.detail and "infra/parallelize.py" in check.detail
    # Every entry that does resolve is not named.
    assert "'attention.wo'" not in check.detail and "'norm'" not in check.detail


def test_check_package_traces_moe_variants_and_fails_a_package_that_cannot_build(workspace):
    # qwen3 serves qwen3_moe too: the MoE plan (with and without EP) is traced on a MoE config.
    result = check_package(
        CheckPackageRequest(model_name="qwen3", model_types=["qwen3", "qwen3_moe"], workspace=workspace)
    )
    check = _tp_plan_modules(result)
    assert check.passed, check.detail
    # Each probe on the default and on the tiny config (the tiny one where the default builds no model).
    assert "traced on 10 models" in check.detail
    # A package that cannot be built fails the check, naming the cause.
    model = workspace / "archon_models/qwen3/model/model.py"
    model.write_text(model.read_text() + '\nraise ImportError("a half-written hand edit")\n')
    broken = _tp_plan_modules(check_package(CheckPackageRequest(model_name="qwen3", workspace=workspace)))
    assert not broken.passed
    assert "cannot build Qwen3Model on the meta device" in broken.detail and "a half-written hand edit" in broken.detail


def test_check_package_fails_while_a_hand_edit_marker_is_left(workspace):
    from skill.porting.common import HAND_EDIT_MARKER

    request = CheckPackageRequest(model_name="llama", workspace=workspace)
    model = workspace / "archon_models/llama/model/model.py"
    source = model.read_text()
    anchor = "        return self.w2(F.silu(self.w1(x)) * self.w3(x))\n"
    model.write_text(source.replace(anchor, f"        {HAND_EDIT_MARKER} clip_qkv\n" + anchor))
    check = next(c for c in check_package(request).checks if c.name == "hand_edits_done")
    assert not check.passed
    assert "archon_models/llama/model/model.py:" in check.detail and "(clip_qkv)" in check.detail
    model.write_text(source)
    assert next(c for c in check_package(request).checks if c.name == "hand_edits_done").passed


def test_config_reads_guarded_by_getattr_in_the_if_test_are_not_required():
    """The deepseek_v3 reference warns with ``hf_config.attention_dropout`` only inside
    ``if getattr(hf_config, "attention_dropout", 0.0):``: a config without the field is fine
    (the fuzzer's MLA families, seeds 1/22/23/29, failed check_package on it). A read
    outside such a guard, or in its ``else``, is still required."""
    from skill.porting.check_package import _config_reads

    text = (
        "def f(hf_config):\n"
        '    if getattr(hf_config, "attention_dropout", 0.0):\n'
        "        log(hf_config.attention_dropout)\n"
        "    else:\n"
        "        log(hf_config.hidden_act)\n"
        '    if hasattr(hf_config, "rope_scaling") and hf_config.rope_scaling:\n'
        "        log(hf_config.rope_scaling, hf_config.rope_theta)\n"
        "    return hf_config.vocab_size\n"
    )
    assert _config_reads(text) == {"hidden_act", "rope_theta", "vocab_size"}


def test_args_check_compares_a_dataclass_field_by_its_values():
    """The generated args module, executed on its own, defines its own ``YarnArgs``: equal
    fields are the same value (fuzzer seeds 2 and 38, MLA with YaRN, failed edit_args with
    'expected YarnArgs(...), got YarnArgs(...)', the same text)."""
    import dataclasses

    from skill.porting.edit_args import _same_value

    def yarn_class():
        @dataclasses.dataclass
        class YarnArgs:
            factor: float = 4.0
            truncate: bool = True

        return YarnArgs

    ours, theirs = yarn_class(), yarn_class()
    assert ours() != theirs()  # two classes: dataclass equality says no
    assert _same_value(ours(), theirs())
    assert not _same_value(ours(), theirs(factor=2.0))
    assert _same_value(3, 3) and not _same_value(3, 4)
