"""Released checkpoints hold keys today's models have no parameter for: buffers saved while they
were persistent (GPT-NeoX's ``attention.bias``/``masked_bias`` and a layer's
``rotary_emb.inv_freq`` in Pythia; GPT-2's ``attn.bias``). transformers' load drops them by the
family's ``_keys_to_ignore_on_load_unexpected`` and its own ``rotary_emb.inv_freq`` rule; the
analysis records the patterns, the adapter edit drops what they find and its map does not cover,
and the rotary table's drop entry sits where the family's attention module saved it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from skill.codemod.cst import Document
from skill.harness import ModelCase
from skill.harness.models import build_archon_model, build_hf_config, build_hf_model, save_hf_checkpoint
from skill.porting.adapter_ignore_patterns import apply_ignore_patterns_adapter
from skill.porting.common import PackageLayout
from tests.skill.test_ignored_keys import compiled_adapter

REPO = Path(__file__).resolve().parents[2]


def test_the_analysis_records_the_familys_ignore_patterns():
    from skill.porting.plan import report_for

    assert report_for("gpt_neox").checkpoint.load_ignore_patterns == ["attention.bias", "attention.masked_bias"]
    assert report_for("gpt2").checkpoint.load_ignore_patterns == ["attn.bias", "crossattention.bias"]
    assert report_for("llama").checkpoint.load_ignore_patterns == []
    # Left out of the serialised report while empty: families without patterns read as before.
    assert "load_ignore_patterns" not in report_for("llama").checkpoint.model_dump()


def test_the_rotary_table_entry_sits_under_the_familys_attention_module():
    from skill.porting.edit_adapter_map import rotary_buffer_keys
    from skill.porting.plan import report_for

    assert rotary_buffer_keys(report_for("llama")) == ["model.layers.{}.self_attn.rotary_emb.inv_freq"]
    assert rotary_buffer_keys(report_for("gpt_neox")) == ["gpt_neox.layers.{}.attention.rotary_emb.inv_freq"]
    assert rotary_buffer_keys(report_for("gpt2")) == []  # learned positions: no rotary table to drop


def _edited_adapter(reference: str, patterns: list[str]) -> type:
    layout = PackageLayout.for_name(reference)
    text = Document((REPO / f"archon_models/{reference}/model/state_dict_adapter.py").read_text())
    edited = apply_ignore_patterns_adapter(text, layout, patterns).code
    assert apply_ignore_patterns_adapter(Document(edited), layout, patterns).code == edited  # idempotent
    return compiled_adapter(edited, layout, f"_ignore_patterns_adapter_{reference}")


@pytest.mark.parametrize(
    ("reference", "model_type"), [("qwen2", "qwen2"), ("qwen3", "qwen3_moe"), ("deepseek_v3", "deepseek_v3")]
)
def test_any_references_adapter_drops_only_unmapped_keys_a_pattern_finds(reference, model_type):
    # "self_attn.o_proj" finds a mapped weight too: a mapped key converts whatever the patterns say.
    adapter_class = _edited_adapter(reference, [r"attention\.bias", "self_attn.o_proj"])
    adapter = adapter_class(build_hf_config(ModelCase(model_type=model_type)))
    assert adapter._archon_key("model.layers.3.attention.bias") is None
    assert adapter._archon_key("model.layers.3.self_attn.o_proj.weight") == "layers.3.attention.wo.weight"
    with pytest.raises(KeyError, match=r"model\.layers\.3\.self_attn\.q_norm2\.weight"):
        adapter._archon_key("model.layers.3.self_attn.q_norm2.weight")
    assert apply_ignore_patterns_adapter(Document("x = 1\n"), PackageLayout.for_name(reference), []).code == "x = 1\n"


def _released(model_type: str, tmp_path: Path, legacy: dict[str, torch.Tensor]) -> tuple[dict, dict, Path]:
    """A tiny ``save_pretrained`` checkpoint, and the same file with ``legacy`` keys added as a
    release made by an older transformers holds them: both as the committed package's ``from_hf``
    reads them, and the released file's folder."""
    case = ModelCase(model_type=model_type)
    hf_config = build_hf_config(case)
    directory = save_hf_checkpoint(build_hf_model(case, hf_config), tmp_path / model_type)
    (file,) = sorted(directory.glob("*.safetensors"))
    saved = load_file(str(file))
    save_file({**saved, **legacy}, str(file), metadata={"format": "pt"})
    adapter = build_archon_model(hf_config).adapter
    return adapter.from_hf(dict(saved)), adapter.from_hf(load_file(str(file))), directory


def _causal_mask(n: int) -> torch.Tensor:
    return torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)


@pytest.mark.parametrize(
    ("model_type", "legacy"),
    [
        # Pythia's keys (EleutherAI/pythia-*: every layer's attention.bias, masked_bias, rotary_emb.inv_freq).
        (
            "gpt_neox",
            {
                **{f"gpt_neox.layers.{i}.attention.bias": _causal_mask(8) for i in range(2)},
                **{f"gpt_neox.layers.{i}.attention.masked_bias": torch.tensor(-1e9) for i in range(2)},
                **{f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq": torch.rand(2) for i in range(2)},
            },
        ),
        # GPT-2's (openai-community/gpt2: every layer's attn.bias).
        ("gpt2", {f"transformer.h.{i}.attn.bias": _causal_mask(8) for i in range(2)}),
        # Llama's before the rotary table moved to the model.
        ("llama", {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(4) for i in range(2)}),
    ],
)
def test_a_released_checkpoints_legacy_buffers_load_as_transformers_loads_them(model_type, legacy, tmp_path):
    clean, released, directory = _released(model_type, tmp_path, legacy)
    assert released.keys() == clean.keys()
    assert all(torch.equal(released[k], clean[k]) for k in clean)
    # transformers drops the same keys without reporting them.
    _, info = AutoModelForCausalLM.from_pretrained(str(directory), output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_an_unknown_weight_in_a_released_checkpoint_still_fails_by_name(tmp_path):
    with pytest.raises(KeyError, match=r"gpt_neox\.layers\.0\.attention\.q_norm\.weight"):
        _released("gpt_neox", tmp_path, {"gpt_neox.layers.0.attention.q_norm.weight": torch.ones(4)})
