"""Checkpoint keys transformers' load ignores where the model lacks them: the analysis measures
them (``_keys_to_ignore_on_load_unexpected`` after the conversion mapping) and the generated
adapter's ``from_hf`` drops the same copies, on any reference's adapter."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

from skill.codemod.cst import Document
from skill.porting.common import PackageLayout
from skill.porting.edit_adapter_map import apply_ignored_keys_adapter, apply_transposed_adapter
from skill.tiny_model import tiny_config

REPO = Path(__file__).resolve().parents[2]
# An HF key a released checkpoint stores on every layer, mapped to a norm the reference's blocks lack.
IGNORED = "model.layers.{}.post_mlp_layernorm.weight"
TARGET = "layers.{}.post_ffn_norm.weight"


def test_the_analysis_measures_axk1s_post_mlp_layernorm_as_ignored_where_dense():
    # AXK1PreTrainedModel: _keys_to_ignore_on_load_unexpected = ["inv_freq", r"mlp\.post_mlp_layernorm"];
    # the MoE layers hold mlp.post_mlp_layernorm, saved (renamed back) as model.layers.{}.post_mlp_layernorm.
    from skill.porting.plan import report_for

    assert report_for("axk1").checkpoint.ignored_unexpected == [IGNORED]
    # Patterns every layer's parameters match (gpt2's "attn.bias" finds c_attn.bias) drop nothing.
    assert report_for("gpt2").checkpoint.ignored_unexpected == []


def _edited_adapter(reference: str, transposed: list[str]) -> type:
    layout = PackageLayout.for_name(reference)
    text = Document((REPO / f"archon_models/{reference}/model/state_dict_adapter.py").read_text())
    text = apply_transposed_adapter(text, layout, transposed)
    edited = apply_ignored_keys_adapter(text, layout, [IGNORED]).code
    assert apply_ignored_keys_adapter(Document(edited), layout, [IGNORED]).code == edited  # idempotent
    return compiled_adapter(edited, layout, f"_ignored_keys_adapter_{reference}")


def compiled_adapter(code: str, layout: PackageLayout, name: str) -> type:
    """The adapter class of an edited adapter module's ``code``, run as module ``name``."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(code, "<adapter>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return getattr(module, layout.adapter_class)


@pytest.mark.parametrize(
    ("reference", "model_type", "transposed"),
    [
        ("qwen2", "qwen2", []),
        ("qwen2", "qwen2", ["model.layers.{}.self_attn.o_proj.weight"]),
        ("qwen3", "qwen3_moe", []),
        ("deepseek_v3", "deepseek_v3", []),
    ],
)
def test_from_hf_drops_the_ignored_copies_on_layers_without_the_module(reference, model_type, transposed):
    prefix = PackageLayout.for_name(reference).adapter_class.removesuffix("StateDictAdapter")
    args_class = getattr(importlib.import_module(f"archon_models.{reference}.model.args"), f"{prefix}ModelArgs")
    model_class = getattr(importlib.import_module(f"archon_models.{reference}.model.model"), f"{prefix}Model")
    args = args_class.from_hf_config(tiny_config(model_type, num_hidden_layers=2))
    torch.manual_seed(0)
    model = model_class(args)
    model.init_buffers(buffer_device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.normal_()
    archon = {k: v.detach().clone() for k, v in model.state_dict().items()}
    adapter = _edited_adapter(reference, transposed)(args)
    adapter.from_hf_map[IGNORED] = TARGET  # as the hand port's edit_adapter_map --add maps it
    released = adapter.to_hf(archon) | {IGNORED.format(layer): torch.ones(args.dim) for layer in range(2)}
    back = adapter.from_hf(released)
    assert set(back) == set(archon)
    assert all(torch.equal(back[key], value) for key, value in archon.items())
    # A key outside ignored_unexpected_hf_keys whose target the model lacks still fails, naming it.
    adapter.from_hf_map["model.layers.{}.other_norm.weight"] = "layers.{}.other_norm.weight"
    with pytest.raises(KeyError, match="other_norm"):
        adapter.from_hf(adapter.to_hf(archon) | {"model.layers.0.other_norm.weight": torch.ones(args.dim)})
