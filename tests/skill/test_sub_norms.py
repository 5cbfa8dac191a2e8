"""Sub-norms: a norm inside the attention (or the feed-forward) whose output the output (or down)
projection reads, BitNet's ``attn_sub_norm`` and ``ffn_sub_norm``. The analysis measures them on
the HF model (where the projection reads them: :func:`skill.analysis.places.norm_place`), the
``attention_sub_norm`` / ``ffn_sub_norm`` edits write them as the block norms are built, whatever
the norm kind and MLP shape, and the TP plan gathers the sharded width for them."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import BitNetConfig

from skill.analysis.places import ATTENTION_OUTPUT, FFN_DOWN, norm_place
from skill.analysis.reference import engine_limits
from skill.codemod.cst import Document, read_dict_literal
from skill.features import Feature, NormKind
from skill.porting.model_edits import EditContext, apply_model_edits, select_edits
from skill.porting.plan import plan_for, report_for
from skill.porting.write_parallelize import PLAN_TARGET
from skill.tiny_model import build_tiny_model, tiny_config

REPO = Path(__file__).resolve().parents[2]
QWEN2_MODEL = (REPO / "archon_models" / "qwen2" / "model" / "model.py").read_text()


def test_bitnets_sub_norms_are_measured_features_an_edit_writes() -> None:
    report = report_for("bitnet")
    assert report.unsupported == []
    assert report.checklist.attention.sub_norm is NormKind.RMS
    assert report.checklist.ffn.sub_norm is NormKind.RMS
    deltas = {d.feature: (d.target, d.supported) for d in report.deltas}
    assert deltas[Feature.ATTN_SUB_NORM] == ("rms", True)
    assert deltas[Feature.FFN_SUB_NORM] == ("rms", True)
    module_map = report.checkpoint.module_map
    assert module_map["model.layers.{}.self_attn.attn_sub_norm"] == "layers.{}.attention.sub_norm"
    assert module_map["model.layers.{}.mlp.ffn_sub_norm"] == "layers.{}.feed_forward.sub_norm"
    plan = plan_for("bitnet")
    assert plan.attn_sub_norm and plan.ffn_sub_norm


def test_a_family_without_sub_norms_reports_none() -> None:
    report = report_for("llama")
    assert report.checklist.attention.sub_norm is None and report.checklist.ffn.sub_norm is None
    assert "sub_norm" not in report.checklist.attention.model_dump(exclude_none=True)
    assert not {Feature.ATTN_SUB_NORM, Feature.FFN_SUB_NORM} & {d.feature for d in report.deltas}
    assert not plan_for("llama").attn_sub_norm


def test_the_place_of_a_sub_norm_is_the_projection_that_reads_its_output() -> None:
    """Measured in one forward of BitNet's tiny HF model: ``o_proj`` reads ``attn_sub_norm``'s
    output and ``down_proj`` reads ``ffn_sub_norm``'s; offered the other projection, no place."""
    config = tiny_config(BitNetConfig())
    model = build_tiny_model(config)
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    attn_norm = {"attn_sub_norm": attention.attn_sub_norm}
    ffn_norm = {"ffn_sub_norm": mlp.ffn_sub_norm}
    assert norm_place(model, config, attn_norm, {attention.o_proj: ATTENTION_OUTPUT}) == ATTENTION_OUTPUT.place
    assert norm_place(model, config, ffn_norm, {mlp.down_proj: FFN_DOWN}) == FFN_DOWN.place
    assert norm_place(model, config, attn_norm, {mlp.down_proj: FFN_DOWN}) is None


def test_a_sub_norm_of_another_kind_than_the_block_norms_is_refused_by_name() -> None:
    checklist = report_for("bitnet").checklist
    other = checklist.model_copy(
        update={
            "attention": checklist.attention.model_copy(update={"sub_norm": NormKind.LAYER_NORM}),
            "ffn": checklist.ffn.model_copy(update={"sub_norm": NormKind.RMS_ONE_PLUS_W}),
        }
    )
    assert engine_limits(checklist) == []
    assert engine_limits(other) == [
        "norm before the attention output projection of kind layer_norm beside rms block norms",
        "norm before the down projection of kind rms_one_plus_w beside rms block norms",
    ]


def _load(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module


@pytest.mark.parametrize("mlp", ["gated", "plain"])
@pytest.mark.parametrize("norm", ["rms", "rms_offset", "layernorm_no_bias", "layernorm_weightless"])
def test_sub_norms_are_built_as_the_block_norms_are_and_read_by_wo_and_w2(mlp: str, norm: str) -> None:
    """Composed with every norm-kind edit and either MLP shape (the plain MLP rewrites the
    feed-forward class): each sub-norm is the block norms' class over the projection's input
    width, the projection reads its output, and a second run changes nothing."""
    from archon_models.qwen2.model.args import Qwen2ModelArgs

    plan = plan_for("bitnet").model_copy(update={"norm": norm, "mlp": mlp, "activation": "silu"})
    ctx = EditContext(camel="Toy", model_class="Qwen2Model", profile=plan)
    names = select_edits(plan, QWEN2_MODEL)
    assert {"attention_sub_norm", "ffn_sub_norm"} <= set(names)
    text = apply_model_edits(QWEN2_MODEL, ctx, names)
    assert apply_model_edits(text, ctx, names) == text
    assert "return self.wo(self.sub_norm(out.view(bs, seqlen, -1)))" in text
    assert "return self.w2(self.sub_norm(" in text
    args = Qwen2ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, head_dim=8, hidden_dim=48)
    args.norm_eps = 1e-5
    model = _load(text, f"_sub_norm_{mlp}_{norm}").Qwen2Model(args)
    block = model.layers["0"]
    attention_norm, ffn_norm = block.attention.sub_norm, block.feed_forward.sub_norm
    assert type(attention_norm) is type(block.attention_norm) is type(ffn_norm)
    torch.manual_seed(0)
    for sub_norm, width in ((attention_norm, 32), (ffn_norm, 48)):
        with torch.no_grad():
            for parameter in sub_norm.parameters():
                parameter.normal_()
        reference = type(block.attention_norm)(width, eps=1e-5, **_kwargs(norm))
        reference.load_state_dict(sub_norm.state_dict())
        x = torch.randn(3, width)
        torch.testing.assert_close(sub_norm(x), reference(x))


def _kwargs(norm: str) -> dict[str, bool]:
    return {"layernorm_no_bias": {"bias": False}, "layernorm_weightless": {"elementwise_affine": False}}.get(norm, {})


def test_the_tp_plan_gathers_the_sharded_width_for_each_sub_norm() -> None:
    """The norm reduces over every head (every hidden unit), which the column-wise projections
    shard: the plan gathers the shards for it and the row-wise projection reads a replicated
    input. bitnet's committed plan is the one stage 5 proves."""
    text = (REPO / "archon_models" / "bitnet" / "infra" / "parallelize.py").read_text()
    plan = read_dict_literal(Document(text), PLAN_TARGET)
    assert {"attention.sub_norm", "feed_forward.sub_norm", "attention.wo", "feed_forward.w2"} <= set(plan)
    gathered = "input_layouts=(Shard(-1),), desired_input_layouts=(Replicate(),), use_local_output=True"
    assert text.count(gathered) == 2
    for projection in ("attention.wo", "feed_forward.w2"):
        assert f'"{projection}": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))' in text
