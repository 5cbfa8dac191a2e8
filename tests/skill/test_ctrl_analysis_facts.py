"""Facts the analysis once inferred wrong for CTRL (issue 20, a fresh agent's hand port),
each now measured on the real HF classes, and checked on another family the same rule moves.

transformers' ``modeling_ctrl.py``: ``CTRLModel`` scales the token embeddings by
``sqrt(n_embd)`` and adds a non-persistent sinusoidal table; each ``EncoderLayer`` holds
``MultiHeadAttention`` and ``ffn = nn.Sequential(Linear(d_model, dff), ReLU(), Linear(dff,
d_model))`` with two ``LayerNorm(d_model, eps=1e-6)``; the final ``layernorm`` reads
``config.layer_norm_epsilon``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

import archon_models
from skill.codemod.cst import Document
from skill.porting.common import PackageLayout
from skill.porting.edit_adapter_map import (
    UnmappedKeyError,
    apply_literal_inner_adapter,
    derive_from_hf_map,
    derive_literal_inner,
    has_inner_index,
)
from skill.porting.plan import plan_for
from skill.tiny_model import TINY_INDEX_TOPK, TINY_INTERMEDIATE, saved_checkpoint_keys, tiny_config
from tests.skill.test_analyze_families import report_for

# ------------------------------------------------- 1. the FFN width field, by probe


def test_ctrl_ffn_width_is_dff_at_released_size() -> None:
    # CTRLConfig's defaults are the released Salesforce/ctrl (n_embd 1280, dff 8192): the
    # width is dff, not a multiple of the hidden size (8192 / 64 was once taken as 128x).
    released = AutoConfig.for_model("ctrl")
    assert (released.n_embd, released.dff) == (1280, 8192)
    ffn = report_for("ctrl").checklist.ffn
    assert ffn.intermediate_size == released.dff
    assert ffn.intermediate_size_field == "dff"
    assert ffn.intermediate_multiple is None and ffn.intermediate_ratio_field is None
    assert plan_for("ctrl").ffn_width_field == "dff"


def test_tiny_config_shrinks_a_width_field_the_names_miss() -> None:
    # dff (CTRL) and dim_ff (CPM-Ant) set the FFN width: the shrinker measures that and
    # shrinks them; fields that set no projection width keep their value.
    assert tiny_config("ctrl").dff == TINY_INTERMEDIATE
    assert tiny_config("cpmant").dim_ff == TINY_INTERMEDIATE
    # A sparse-attention indexer's keys per query shrink below the stage tests' documents, so
    # its selection is real there.
    assert tiny_config("deepseek_v32").index_topk == TINY_INDEX_TOPK < AutoConfig.for_model("deepseek_v32").index_topk
    assert tiny_config("minicpm3").dim_model_base == AutoConfig.for_model("minicpm3").dim_model_base
    assert tiny_config("ctrl", dff=96).dff == 96


# ------------------------------------------- 2. each norm's epsilon, by perturbation


def _without_feature_modules(source: str, trust_remote_code: bool = False) -> Any:
    """The report as the engine gave it before CTRL's two hand edits became feature modules:
    the facts the modules port, refused by name with their hand-edit places."""
    import skill.feature_modules
    from skill.analysis.analyze import analyze_hf_model
    from skill.analysis.report import AnalyzeInput

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(skill.feature_modules, "FEATURE_MODULES", ())
        return analyze_hf_model(AnalyzeInput(source=source, trust_remote_code=trust_remote_code))


@pytest.fixture(scope="module")
def ctrl_without_modules() -> Any:
    """ctrl's report without the feature modules, analysed once for the tests that read it."""
    return _without_feature_modules("ctrl")


EPS_FACT = (
    "norms whose epsilon is a constant, not layer_norm_epsilon: "
    "transformer.h.{}.layernorm1 eps=1e-06, transformer.h.{}.layernorm2 eps=1e-06"
)


def test_ctrl_block_norm_eps_is_a_constant_the_feature_module_ports() -> None:
    # EncoderLayer: LayerNorm(d_model, eps=1e-6) twice; CTRLModel.layernorm reads
    # layer_norm_epsilon. Equal by default, so only moving the field tells them apart.
    report = report_for("ctrl")
    assert report.checklist.norm.eps_field == "layer_norm_epsilon"
    assert report.checklist.feature_modules["constant_norm_eps"] == {
        "eps": 1e-06,
        "field": "layer_norm_epsilon",
        "norms": ["attention_norm", "ffn_norm"],
    }
    assert not [line for line in report.unsupported if "epsilon is a constant" in line]
    delta = next(d for d in report.deltas if d.feature == "constant_norm_eps")
    assert delta.supported and delta.target == "block norms with a constant epsilon of 1e-06"


def test_ctrl_block_norm_eps_without_its_module_is_refused_at_its_place(ctrl_without_modules: Any) -> None:
    report = ctrl_without_modules
    assert not report.checklist.feature_modules
    named = [line for line in report.unsupported if "epsilon is a constant" in line]
    assert named == [f"unsupported: {EPS_FACT}"]
    # Its hand edit sets the eps where the block norms are built, not in the forward (the ctrl
    # agent found the marker in TransformerBlock.forward while the eps is set in __init__).
    place = report.hand_edit_places[EPS_FACT]
    assert (place.class_name, place.function, place.anchor) == ("TransformerBlock", "__init__", "self.attention_norm")


def test_a_constant_epsilon_other_than_the_field_s_value_is_measured(tmp_path: Path) -> None:
    # The composition family epsmoe builds its four block norms with eps=1e-5 while rms_norm_eps is
    # 1e-6 (the final and QK norms read it). The norms then hold two values, so the field is
    # used; moving it leaves the block norms' 1e-5: a constant, named (not ported silently with
    # norm_eps, as when only a constant equal to the field's value was looked for).
    from tests.skill.test_composition_families import make_checkpoint

    report = _without_feature_modules(str(make_checkpoint(tmp_path, "epsmoe")), trust_remote_code=True)
    named = [line for line in report.unsupported if "epsilon is a constant" in line]
    assert named == [
        "unsupported: norms whose epsilon is a constant, not rms_norm_eps: "
        + ", ".join(
            f"model.layers.{{}}.{n} eps=1e-05"
            for n in sorted(
                (
                    "input_layernorm",
                    "post_attention_layernorm",
                    "pre_feedforward_layernorm",
                    "post_feedforward_layernorm",
                )
            )
        )
    ]


def test_mla_latent_norms_are_not_named_as_block_norms() -> None:
    # DeepseekV3Attention's q_a_layernorm / kv_a_layernorm keep 1e-6 too, but they are the
    # latent norms (latent_norm_eps_field), not the block norms that norm_eps builds.
    report = report_for("deepseek_v3")
    assert report.checklist.norm.eps_field == "rms_norm_eps"
    assert not [line for line in report.unsupported if "epsilon is a constant" in line]


# ------------------------------ 3. sinusoidal positions in a buffer, sqrt(d) embedding scale


def test_ctrl_sinusoidal_buffer_and_sqrt_dim_scale_are_reported() -> None:
    # CTRLModel: pos_encoding = positional_encoding(n_positions, n_embd) (non-persistent,
    # [sin | cos] of p * 10000^(-2i/d)), added after `inputs_embeds *= np.sqrt(d_model_size)`.
    report = report_for("ctrl")
    positions = report.checklist.positions
    assert positions.kind == "sinusoidal" and positions.table_offset == 0
    assert positions.table_zero_row_field is None
    scalars = report.checklist.scalars
    assert scalars.embedding_scale_kind == "sqrt_dim"
    assert scalars.embedding_scale == pytest.approx(AutoConfig.for_model("ctrl").n_embd ** 0.5)
    # The paper's rates, not fairseq's: the vaswani_positions feature module ports them.
    assert report.checklist.feature_modules["vaswani_positions"] == {"offset": 0}
    assert not [line for line in report.unsupported if "sinusoidal" in line]
    assert not [line for line in report.unsupported if "position encoding = none" in line]
    assert not [line for line in report.unsupported if "beyond a constant scale" in line]


def test_ctrl_sinusoidal_formula_without_its_module_is_refused_at_its_place(ctrl_without_modules: Any) -> None:
    report = ctrl_without_modules
    formula = [line for line in report.unsupported if "sinusoidal" in line]
    assert len(formula) == 1 and "10000^(-2i/d)" in formula[0] and "offset 0" in formula[0]
    # Its hand edit changes the table's frequencies: marked above the call that builds it (the
    # ctrl agent found the marker in the model's forward, above the embedding).
    place = report.hand_edit_places[formula[0].removeprefix("unsupported: ")]
    assert (place.class_name, place.function, place.anchor) == ("SinusoidalPositions", "build", "sinusoidal_positions(")


def test_xglm_fairseq_sinusoidal_table_still_matches_the_edit() -> None:
    # XGLMSinusoidalPositionalEmbedding: fairseq's table, offset 2, pad row zero: the
    # sinusoidal_positions edit's formula, so nothing is named.
    report = report_for("xglm")
    positions = report.checklist.positions
    assert positions.kind == "sinusoidal" and positions.table_offset == 2
    assert positions.table_zero_row_field == "pad_token_id"
    assert not [line for line in report.unsupported if "sinusoidal" in line]


# --------------------------------------- 4. Sequential positions in checkpoint keys


def _ctrl_map_inputs() -> dict[str, Any]:
    report = report_for("ctrl")
    return {
        "hf_keys": list(saved_checkpoint_keys(tiny_config("ctrl"))),
        "norm_roles": report.checklist.norm.block_norms,
        "layer_prefix": "transformer.h.{}.",
        "top_modules": report.checkpoint.top_modules,
        "module_map": report.checkpoint.module_map,
    }


def test_ctrl_sequential_ffn_positions_stay_apart() -> None:
    # EncoderLayer.ffn = nn.Sequential(Linear, ReLU, Linear): ffn.0 is the up projection, ffn.2
    # the down one; the analysis' module map pairs them with w1 and w2.
    inputs = _ctrl_map_inputs()
    assert inputs["module_map"]["transformer.h.{}.ffn.0"] == "layers.{}.feed_forward.w1"
    with pytest.raises(UnmappedKeyError) as refused:
        derive_from_hf_map(**inputs)
    # The refusal says what is true: the module map pairs them (not "no edit creates them").
    assert "module map pairs their modules (transformer.h.{}.ffn.0 -> layers.{}.feed_forward.w1" in str(refused.value)
    assert "no edit that creates" not in str(refused.value)
    derived = derive_literal_inner(**inputs)
    assert derived is not None
    assert derived["transformer.h.{}.ffn.0.weight"] == "layers.{}.feed_forward.w1.weight"
    assert derived["transformer.h.{}.ffn.0.bias"] == "layers.{}.feed_forward.w1.bias"
    assert derived["transformer.h.{}.ffn.2.weight"] == "layers.{}.feed_forward.w2.weight"
    layer_keys = [key for key in derived if key.startswith("transformer.h.{}.")]
    assert layer_keys and not [key for key in layer_keys if has_inner_index(key, "transformer.h.{}.")]


def test_adapter_abstracts_only_the_layer_and_expert_index() -> None:
    # The generated adapter's _abstract must read keys as the literal map writes them.
    reference = Path(archon_models.__file__).parent / "qwen2" / "model" / "state_dict_adapter.py"
    text = apply_literal_inner_adapter(
        Document(reference.read_text()), PackageLayout.for_name("ctrl"), "transformer.h.{}."
    )
    line = next(row for row in text.code.splitlines() if row.startswith("_INDEX = "))
    namespace: dict[str, Any] = {}
    exec("import re\n" + line, namespace)
    index = namespace["_INDEX"]
    assert index.sub(".{}", "transformer.h.11.ffn.2.weight") == "transformer.h.{}.ffn.2.weight"
    assert index.sub(".{}", "layers.11.feed_forward.w1.weight") == "layers.{}.feed_forward.w1.weight"
    assert index.sub(".{}", "layers.1.moe.experts.7.w1") == "layers.{}.moe.experts.{}.w1"


@pytest.mark.slow
def test_check_package_reads_a_literal_sequential_position_as_mapped(tmp_path: Path) -> None:
    """The ctrl agent's check failed on 'unmapped HF keys transformer.h.{}.ffn.{}.weight' while the
    map it was given holds ffn.0 and ffn.2 literally and stages 2-3 mapped every key: the check
    generalised every index of the checkpoint keys. It matches each key against the map's
    templates now, an index for ``{}`` and a literal position for itself."""
    from skill.porting.check_package import CheckPackageRequest, check_package
    from skill.porting.copy_reference import CopyReferenceRequest, copy_reference
    from skill.porting.edit_adapter_map import EditAdapterMapRequest, edit_adapter_map
    from tests.mcp.conftest import make_workspace

    workspace = make_workspace(tmp_path / "ws")
    shutil.rmtree(workspace / "archon_models" / "ctrl", ignore_errors=True)  # the committed hand port
    copy_reference(
        CopyReferenceRequest(workspace=workspace, model_name="ctrl", reference="qwen2", model_types=["ctrl"])
    )
    mapped = edit_adapter_map(EditAdapterMapRequest(workspace=workspace, model_name="ctrl", source="ctrl")).from_hf_map
    assert mapped["transformer.h.{}.ffn.2.weight"] == "layers.{}.feed_forward.w2.weight"
    checks = check_package(CheckPackageRequest(workspace=workspace, model_name="ctrl", source="ctrl")).checks
    keys = next(check for check in checks if check.name == "hf_keys_mapped")
    assert keys.passed, keys.detail

    adapter = workspace / "archon_models" / "ctrl" / "model" / "state_dict_adapter.py"
    adapter.write_text(
        adapter.read_text().replace('"transformer.h.{}.ffn.2.weight"', '"transformer.h.{}.ffn.3.weight"')
    )
    checks = check_package(CheckPackageRequest(workspace=workspace, model_name="ctrl", source="ctrl")).checks
    keys = next(check for check in checks if check.name == "hf_keys_mapped")
    assert not keys.passed and "transformer.h.{}.ffn.{}.weight" in keys.detail


def test_analyze_text_names_each_hand_edit_place(ctrl_without_modules: Any) -> None:
    """The second ctrl agent needed `analyze --json` for `hand_edit_places`, which SKILL.md's hand
    port reads: the text output lists each place too (ctrl's, without the modules that port them)."""
    from skill.cli.analyze import format_report

    report = ctrl_without_modules
    assert len(report.hand_edit_places) == 2
    text = format_report(report)
    assert "hand edit places (hand_edit_places):" in text
    for feature, place in report.hand_edit_places.items():
        assert f"  {feature}: {place.where('<Model>')}" in text
    assert "TransformerBlock.__init__, where the block norms are built" in text
