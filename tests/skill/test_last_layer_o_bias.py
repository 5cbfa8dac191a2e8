"""A bias on the last layer's output projection only (GPT-NeoX-Japanese's ``dense_bias``): the
analysis measures it on the HF model (tests/skill/test_analyze_measurements.py), the
``last_layer_o_bias`` edit builds it on that layer alone, composed with the edits that also build
the block's attention (a per-layer sliding window), and the adapter maps its key."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from skill.porting.edit_adapter_map import derive_from_hf_map
from skill.porting.model_edits import EditContext, apply_model_edits, select_edits
from skill.porting.plan import plan_for

REPO = Path(__file__).resolve().parents[2]
QWEN2_MODEL = (REPO / "archon_models" / "qwen2" / "model" / "model.py").read_text()


def _load(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module


@pytest.mark.parametrize("windowed", [False, True])
def test_only_the_last_layers_output_projection_has_a_bias(windowed: bool) -> None:
    from archon_models.qwen2.model.args import Qwen2ModelArgs

    plan = plan_for("llama").model_copy(
        update={"o_bias_last_layer": True, "sliding_window": windowed, "sliding_layer_types": windowed}
    )
    ctx = EditContext(camel="Toy", model_class="Qwen2Model", profile=plan)
    names = select_edits(plan, QWEN2_MODEL)
    assert "last_layer_o_bias" in names
    text = apply_model_edits(QWEN2_MODEL, ctx, names)
    assert apply_model_edits(text, ctx, names) == text
    assert "output_bias=layer_id == model_args.n_layers - 1" in text
    args = Qwen2ModelArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, head_dim=8, hidden_dim=48)
    if windowed:
        args.sliding_window = 4  # fields the window edit reads that the reference's args lack
        args.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    model = _load(text, f"_last_layer_o_bias_{windowed}").Qwen2Model(args)
    biased = [index for index, layer in model.layers.items() if layer.attention.wo.bias is not None]
    assert biased == ["2"]
    if windowed:
        assert [layer.attention.packed_attn.window for layer in model.layers.values()] == [4, None, 4]


def test_the_adapter_maps_the_bias_held_by_the_attention_itself() -> None:
    prefix = "gpt_neox_japanese.layers.{}."
    keys = [f"{prefix}attention.dense.weight", f"{prefix}attention.dense_bias"]
    mapping = derive_from_hf_map(
        keys,
        layer_prefix=prefix,
        layer_buffers={"attention.dense_bias": "attention.wo.bias"},
        module_map={f"{prefix}attention.dense": "layers.{}.attention.wo"},
    )
    assert mapping[f"{prefix}attention.dense_bias"] == "layers.{}.attention.wo.bias"
    assert mapping[f"{prefix}attention.dense.weight"] == "layers.{}.attention.wo.weight"
