"""The tiny-model builder: generic shrink rules, seeded instances, on-disk keys."""

from __future__ import annotations

import pytest
import torch

from skill.tiny_model import (
    MAX_TINY_LAYERS,
    TINY_HIDDEN,
    TINY_VOCAB,
    TinyModelError,
    build_tiny_model,
    parameter_count,
    saved_checkpoint_keys,
    tiny_config,
)


def test_qwen3_shrinks_to_tiny_sizes_and_keeps_features() -> None:
    config = tiny_config("qwen3")
    assert config.hidden_size == TINY_HIDDEN
    assert config.num_attention_heads * config.head_dim == TINY_HIDDEN
    assert config.vocab_size == TINY_VOCAB
    assert config.num_hidden_layers == 2
    assert config.dtype == torch.float32 or config.dtype == "float32"


def test_gqa_and_mqa_ratios_survive() -> None:
    assert tiny_config("mistral").num_key_value_heads == 2  # 32 heads / 8 KV heads: GQA
    assert tiny_config("falcon", new_decoder_architecture=False, multi_query=True).num_attention_heads == 4
    assert tiny_config("llama").num_key_value_heads == 4  # MHA by default


def test_per_layer_pattern_keeps_each_kind() -> None:
    config = tiny_config("gemma3_text")
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert len(config.layer_types) == config.num_hidden_layers <= MAX_TINY_LAYERS
    assert config.sliding_window <= 8


def test_a_run_length_layer_pattern_shrinks_in_its_own_encoding() -> None:
    # GPT-Neo's attention_types is [[["global", "local"], 12]]; transformers 5.3 re-expands it
    # and rejects a list whose length is not num_layers, so it must shrink to one run.
    config = tiny_config("gpt_neo")
    assert config.num_layers == 2
    assert config.attention_types == [[["global", "local"], 1]]
    assert list(config.attention_layers) == ["global", "local"]
    three = tiny_config("gpt_neo", num_layers=3)
    assert three.attention_types == [[["global", "local", "global"], 1]]


def test_token_ids_fall_inside_the_tiny_vocab() -> None:
    config = tiny_config("llama")  # defaults: bos 1, eos 2 ... and llama3-style ids elsewhere
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, name)
        values = value if isinstance(value, list) else [value]
        assert all(v is None or 0 <= v < config.vocab_size for v in values)


def test_mla_head_widths_add_up() -> None:
    config = tiny_config("deepseek_v3")
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.first_k_dense_replace <= config.num_hidden_layers - 1
    assert config.n_routed_experts <= 4 and config.num_experts_per_tok <= 2


def test_overrides_win_and_attribute_map_names_work() -> None:
    assert tiny_config("qwen3", num_hidden_layers=3).num_hidden_layers == 3
    gpt2 = tiny_config("gpt2", hidden_size=32)  # stored as n_embd
    assert gpt2.n_embd == 32


def test_config_object_keeps_its_non_default_features() -> None:
    from transformers import Qwen2Config

    full = Qwen2Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True)
    tiny = tiny_config(full)
    assert tiny.tie_word_embeddings is True
    assert tiny.num_key_value_heads == 2
    assert full.hidden_size == 1024  # input untouched


def test_build_is_seeded_and_small() -> None:
    config = tiny_config("qwen2")
    first, second = build_tiny_model(config, seed=3), build_tiny_model(config, seed=3)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert parameter_count(first) < 500_000
    assert not first.training


def test_saved_keys_are_the_on_disk_names() -> None:
    keys = saved_checkpoint_keys(tiny_config("qwen3_moe"))
    # transformers v5 fuses experts in memory but writes per-expert 2D keys.
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert keys["model.layers.0.mlp.experts.0.gate_proj.weight"] == (32, TINY_HIDDEN)
    assert keys["model.embed_tokens.weight"] == (TINY_VOCAB, TINY_HIDDEN)
    assert list(keys) == sorted(keys)


def test_unknown_model_type_names_the_problem() -> None:
    with pytest.raises(TinyModelError, match="unknown model_type 'not_a_family'"):
        tiny_config("not_a_family")


def test_perturb_scalars_moves_neutral_multipliers_only() -> None:
    plain = tiny_config("granite")
    moved = tiny_config("granite", perturb_scalars=True, residual_multiplier=0.5)
    assert plain.embedding_multiplier == 1.0
    assert moved.embedding_multiplier == 1.25 and moved.logits_scaling == 1.25
    assert moved.residual_multiplier == 0.5  # explicit overrides win
    assert tiny_config("qwen3", perturb_scalars=True).to_dict() == tiny_config("qwen3").to_dict()
