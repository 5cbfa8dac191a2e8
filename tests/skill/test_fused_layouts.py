"""Fused on-disk projections (q/k/v in one tensor, gate/up in one tensor): found by shape,
split by the generated adapter, and still checked strictly by stage 3."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import archon_models
from skill.codemod.cst import Document
from skill.harness import ModelCase, run_adapter_stage, run_completeness_stage
from skill.harness.completeness import check_completeness, stacked_shape
from skill.harness.models import build_archon_model, build_hf_config
from skill.harness.results import StageRecorder
from skill.porting.common import PackageLayout
from skill.porting.edit_adapter_map import (
    UnmappedKeyError,
    apply_fused_adapter,
    derive_from_hf_map,
    detect_fused_keys,
)
from skill.tiny_model import read_safetensors_shapes

# Four query heads, two KV heads of 16: q/k/v stack 64 + 32 + 32 = 128 rows; gate/up 2 * 96.
CONFIG = SimpleNamespace(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96
)
SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.self_attn.wqkv.weight": (128, 64),
    "model.layers.0.self_attn.wqkv.bias": (128,),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.fc_in.weight": (192, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 96),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.post_attention_layernorm.weight": (64,),
    "model.norm.weight": (64,),
    "lm_head.weight": (256, 64),
}
CASE = ModelCase(model_type="phi3", config_overrides={"num_key_value_heads": 2})
QKV = "model.layers.0.self_attn.qkv_proj.weight"


def test_fused_keys_are_found_by_shape_not_by_name():
    fused = detect_fused_keys(SHAPES, CONFIG)
    assert fused == {
        "model.layers.{}.mlp.fc_in.weight": ["layers.{}.feed_forward.w1.weight", "layers.{}.feed_forward.w3.weight"],
        "model.layers.{}.self_attn.wqkv.bias": [
            "layers.{}.attention.wq.bias",
            "layers.{}.attention.wk.bias",
            "layers.{}.attention.wv.bias",
        ],
        "model.layers.{}.self_attn.wqkv.weight": [
            "layers.{}.attention.wq.weight",
            "layers.{}.attention.wk.weight",
            "layers.{}.attention.wv.weight",
        ],
    }
    # A known module is never taken for a fused one, whatever its shape.
    assert detect_fused_keys({"model.layers.0.self_attn.q_proj.weight": (128, 64)}, CONFIG) == {}
    # Rows that are no q/k/v or gate/up stack, or a weight not over the hidden size: not fused.
    assert detect_fused_keys({"model.layers.0.self_attn.qkv_proj.weight": (127, 64)}, CONFIG) == {}
    assert detect_fused_keys({"model.layers.0.mlp.gate_up_proj.weight": (192, 63)}, CONFIG) == {}


def test_derived_map_leaves_fused_keys_to_the_fused_map():
    fused = detect_fused_keys(SHAPES, CONFIG)
    mapping = derive_from_hf_map(list(SHAPES), fused=fused)
    assert not set(fused) & set(mapping)
    assert mapping["model.layers.{}.self_attn.o_proj.weight"] == "layers.{}.attention.wo.weight"
    with pytest.raises(UnmappedKeyError, match="wqkv"):
        derive_from_hf_map(list(SHAPES))


def test_explicit_entries_map_only_the_keys_no_rule_covers():
    """A caller's entry (an ``add``, or one the map already holds) maps a key the rules do not
    know, such as a parameter a hand edit created; a key a rule maps keeps the rule's target."""
    keys = [*SHAPES, "model.layers.1.self_attn.dense_bias"]
    explicit = {
        "model.layers.{}.self_attn.dense_bias": "layers.{}.attention.wo.bias",
        "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.stale.weight",
    }
    fused = detect_fused_keys(SHAPES, CONFIG)
    mapping = derive_from_hf_map(keys, fused=fused, explicit=explicit)
    assert mapping["model.layers.{}.self_attn.dense_bias"] == "layers.{}.attention.wo.bias"
    assert mapping["model.layers.{}.self_attn.o_proj.weight"] == "layers.{}.attention.wo.weight"
    with pytest.raises(UnmappedKeyError, match=r"dense_bias.*`add`.*Porting by hand"):
        derive_from_hf_map(keys, fused=fused)


def test_fused_adapter_edit_is_idempotent_and_a_noop_without_fused_keys():
    with open(archon_models.__path__[0] + "/qwen2/model/state_dict_adapter.py") as f:
        source = f.read()
    layout = PackageLayout.for_name("qwen2")
    assert apply_fused_adapter(Document(source), layout, {}).code == source
    fused = detect_fused_keys(SHAPES, CONFIG)
    once = apply_fused_adapter(Document(source), layout, fused).code
    assert "fused_from_hf_map" in once and "_split_fused" in once
    assert apply_fused_adapter(Document(once), layout, fused).code == once


@pytest.fixture
def phi3():
    hf_config = build_hf_config(CASE)
    adapter_class = archon_models.get_model_spec("phi3").state_dict_adapter_class
    return hf_config, adapter_class(hf_config)


def test_phi3_adapter_splits_on_load_and_names_the_slice_destination(phi3):
    hf_config, adapter = phi3
    archon = build_archon_model(hf_config, device="meta")
    rows = {name: p.shape[0] for name, p in archon.model.named_parameters()}
    q, k, v = (rows[f"layers.0.attention.{w}.weight"] for w in ("wq", "wk", "wv"))
    assert k == v < q  # grouped-query attention: the split is uneven
    qkv = torch.randn(q + k + v, hf_config.hidden_size)
    parts = adapter._split_fused(QKV, "model.layers.{}.self_attn.qkv_proj.weight", ["0"], qkv)
    assert torch.equal(parts["layers.0.attention.wk.weight"], qkv[q : q + k])
    # Per parameter, the fused key its slice goes to; to_hf stacks the slices back.
    assert (
        adapter.convert_single_to_hf("layers.0.attention.wv.weight", parts["layers.0.attention.wv.weight"])[0][0] == QKV
    )
    assert torch.equal(adapter.to_hf(parts)[QKV], qkv)
    with pytest.raises(KeyError, match="rows"):
        adapter._split_fused(QKV, "model.layers.{}.self_attn.qkv_proj.weight", ["0"], qkv[:-1])
    with pytest.raises(KeyError, match="only parts"):
        adapter.to_hf({"layers.0.attention.wq.weight": parts["layers.0.attention.wq.weight"]})


def test_phi3_stages_2_and_3_pass(tmp_path):
    assert run_adapter_stage(CASE, workdir=tmp_path, raise_on_failure=False).passed
    assert run_completeness_stage(CASE, workdir=tmp_path, raise_on_failure=False).passed


def _completeness(disk, archon=None):
    archon = archon or build_archon_model(build_hf_config(CASE), device="meta")
    rec = StageRecorder(CASE, 3)
    check_completeness(rec, archon, disk)
    return [c.name for c in rec.finish().failures()]


def _disk(tmp_path):
    from skill.harness.models import build_hf_model, save_hf_checkpoint

    hf_config = build_hf_config(CASE)
    return read_safetensors_shapes(save_hf_checkpoint(build_hf_model(CASE, hf_config), tmp_path))


def test_stage3_fails_on_a_mis_shaped_fused_key(tmp_path):
    disk = _disk(tmp_path)
    assert _completeness(disk) == []
    rows, cols = disk[QKV]
    assert "shapes equal" in _completeness({**disk, QKV: (rows + 16, cols)})


def test_stage3_fails_when_a_fused_slice_is_missing(tmp_path, monkeypatch):
    disk = _disk(tmp_path)
    adapter_class = archon_models.get_model_spec("phi3").state_dict_adapter_class
    original = adapter_class.convert_single_to_hf

    def without_v(self, name, tensor):
        return [] if name == "layers.0.attention.wv.weight" else original(self, name, tensor)

    monkeypatch.setattr(adapter_class, "convert_single_to_hf", without_v)
    failed = _completeness(disk)
    assert "every Archon parameter maps to a checkpoint key" in failed
    assert "shapes equal" in failed  # wq + wk stack to fewer rows than qkv_proj holds


def test_stage3_fails_on_a_key_no_parameter_fills(tmp_path):
    disk = _disk(tmp_path)
    failed = _completeness({**disk, "model.layers.0.self_attn.extra_proj.weight": (8, 64)})
    assert "every checkpoint key comes from a parameter or an explicit None drop" in failed


def test_stacked_shape():
    assert stacked_shape([(4, 3)]) == (4, 3)
    assert stacked_shape([(4, 3), (2, 3), (2, 3)]) == (8, 3)
    assert stacked_shape([(4, 3), (2, 2)]) is None
    assert stacked_shape([(4,), (2, 3)]) is None


def test_attention_sinks_key_maps_to_the_attention_parameter():
    """A sink logit per head lives on the attention module itself (no .weight/.bias suffix)."""
    keys = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.sinks",
        "model.layers.1.self_attn.sinks",
        "model.embed_tokens.weight",
    ]
    mapping = derive_from_hf_map(keys)
    assert mapping["model.layers.{}.self_attn.sinks"] == "layers.{}.attention.sinks"
