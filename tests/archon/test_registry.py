"""Contracts of archon_models itself: the model-spec registry, the base helpers, and the
errors bad input must raise (naming the field or key, never dropping it silently)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import archon_models
from archon_models import model_spec
from archon_models.base import SAFETENSORS_INDEX, BaseModelArgs, BaseStateDictAdapter
from skill.harness import ModelCase
from skill.harness.models import build_hf_config, build_hf_model, read_hf_checkpoint, save_hf_checkpoint

REFERENCE_TYPES = ("qwen2", "qwen3", "qwen3_moe")


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A copy of the registry, so registering in a test leaves the real one alone."""
    registry = dict(model_spec._MODEL_SPECS)
    monkeypatch.setattr(model_spec, "_MODEL_SPECS", registry)
    return registry


def test_importing_archon_models_registers_the_references():
    assert set(REFERENCE_TYPES) <= archon_models.get_supported_model_types()
    assert all(archon_models.is_supported_model(t) for t in REFERENCE_TYPES)
    # One spec serves both Qwen3 variants.
    assert archon_models.get_model_spec("qwen3") is archon_models.get_model_spec("qwen3_moe")


def test_register_and_look_up_a_new_type(isolated_registry):
    spec = dataclasses.replace(
        archon_models.get_model_spec("qwen2"),
        name="HarnessProbe",
        supported_model_types=frozenset({"harness_probe"}),
    )
    archon_models.register_model_spec(spec)
    assert archon_models.get_model_spec("harness_probe") is spec
    assert "harness_probe" in archon_models.get_supported_model_types()


def test_registering_a_type_twice_raises_and_registers_nothing(isolated_registry):
    spec = dataclasses.replace(
        archon_models.get_model_spec("qwen2"),
        name="Duplicate",
        supported_model_types=frozenset({"qwen2", "fresh_type"}),
    )
    with pytest.raises(ValueError, match="qwen2"):
        archon_models.register_model_spec(spec)
    assert not archon_models.is_supported_model("fresh_type")
    assert archon_models.get_model_spec("qwen2").name != "Duplicate"


def test_unknown_type_raises_key_error_listing_available():
    with pytest.raises(KeyError) as excinfo:
        archon_models.get_model_spec("no_such_model")
    message = str(excinfo.value)
    assert "no_such_model" in message
    assert all(t in message for t in REFERENCE_TYPES)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SimpleNamespace(rope_theta=500000.0), 500000.0),  # transformers v4
        (SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 1e6),  # v5
        (SimpleNamespace(rope_parameters={"rope_theta": 2e6}, rope_theta=3.0), 2e6),  # v5 wins
        (
            SimpleNamespace(
                rope_parameters={
                    "full_attention": {"rope_theta": 1e6},
                    "sliding_attention": {"rope_theta": 1e4},
                }
            ),
            1e6,
        ),  # per layer type: the first
        (SimpleNamespace(), 1234.0),  # neither: the default
    ],
)
def test_get_rope_theta(config, expected):
    assert BaseModelArgs._get_rope_theta(config, 1234.0) == expected


def test_get_rope_theta_of_a_real_v5_config():
    config = build_hf_config(
        ModelCase(
            model_type="qwen3",
            config_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 4321.0}},
        )
    )
    assert BaseModelArgs._get_rope_theta(config) == 4321.0


def _adapter_class(model_type: str) -> type[BaseStateDictAdapter]:
    return archon_models.get_model_spec(model_type).state_dict_adapter_class


def test_index_parsing_maps_every_key_to_its_shard(tmp_path):
    weight_map = {
        "model.embed_tokens.weight": "model-00001-of-00003.safetensors",
        "model.layers.0.self_attn.q_proj.weight": "model-00002-of-00003.safetensors",
        "lm_head.weight": "model-00003-of-00003.safetensors",
    }
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    adapter = _adapter_class("qwen2")(build_hf_config(ModelCase(model_type="qwen2")), str(tmp_path))
    assert adapter.fqn_to_index_mapping == {
        "model.embed_tokens.weight": 1,
        "model.layers.0.self_attn.q_proj.weight": 2,
        "lm_head.weight": 3,
    }


def test_index_parsing_without_index_and_with_a_broken_one(tmp_path):
    config = build_hf_config(ModelCase(model_type="qwen2"))
    assert _adapter_class("qwen2")(config, str(tmp_path)).fqn_to_index_mapping is None
    assert _adapter_class("qwen2")(config).fqn_to_index_mapping is None
    (tmp_path / SAFETENSORS_INDEX).write_text('{"no_weight_map": {}}')
    with pytest.raises(ValueError, match="weight_map"):
        _adapter_class("qwen2")(config, str(tmp_path))


def _config_without(model_type: str, field: str) -> SimpleNamespace:
    """A config-like object lacking one field (a v5 config class always has every field)."""
    config = build_hf_config(ModelCase(model_type=model_type))
    values = config.to_dict()
    for alias, stored in type(config).attribute_map.items():
        values.setdefault(alias, values.get(stored))
    values.pop(field, None)
    for alias, stored in type(config).attribute_map.items():
        if field in (alias, stored):
            values.pop(alias, None)
            values.pop(stored, None)
    return SimpleNamespace(**values)


@pytest.mark.parametrize(
    ("model_type", "field"),
    [
        *[
            (t, f)
            for t in REFERENCE_TYPES
            for f in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
                "intermediate_size",
                "rms_norm_eps",
            )
        ],
        ("qwen3_moe", "moe_intermediate_size"),
        ("qwen3_moe", "num_experts_per_tok"),
    ],
)
def test_from_hf_config_names_a_missing_required_field(model_type, field):
    args_class = archon_models.get_model_spec(model_type).model_args_class
    with pytest.raises((ValueError, AttributeError, KeyError, TypeError), match=field):
        args_class.from_hf_config(_config_without(model_type, field))


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def saved(request, tmp_path_factory):
    case = ModelCase(model_type=request.param)
    config = build_hf_config(case)
    folder = save_hf_checkpoint(build_hf_model(case, config), tmp_path_factory.mktemp(request.param))
    return _adapter_class(request.param)(config), read_hf_checkpoint(folder)


def test_adapter_rejects_an_unknown_key_naming_it(saved):
    adapter, state = saved
    bogus = "model.layers.0.mlp.harness_bogus.weight"
    with pytest.raises((KeyError, ValueError), match="harness_bogus"):
        adapter.from_hf({**state, bogus: torch.zeros(2)})


@pytest.mark.parametrize("key", ["model.norm.weight", "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"])
def test_adapter_rejects_a_missing_key_naming_it(saved, key):
    adapter, state = saved
    assert key in state
    with pytest.raises((KeyError, ValueError)) as excinfo:
        adapter.from_hf({k: v for k, v in state.items() if k != key})
    archon_name = {"model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}.get(
        key, "layers.1.attention.wo.weight"
    )
    assert key in str(excinfo.value) or archon_name in str(excinfo.value)


def _packages() -> list[str]:
    """One registered model_type per package (a spec serving several types is tested once)."""
    seen: dict[int, str] = {}
    for model_type in sorted(archon_models.get_supported_model_types()):
        seen.setdefault(id(archon_models.get_model_spec(model_type)), model_type)
    return sorted(seen.values())


@pytest.mark.parametrize("model_type", _packages())
def test_every_package_refuses_an_attn_type_it_does_not_run(model_type: str):
    """AReaL passes ``attn_type`` ("tree" under tree training, or a typo from a config): every
    package takes the two it runs and refuses any other at once, whichever kernel it carries
    (the packages with a kernel of their own once stored any value and never read it)."""
    args_class = archon_models.get_model_spec(model_type).model_args_class
    for served in ("varlen", "sdpa"):
        assert args_class(attn_type=served).attn_type == served
    with pytest.raises(ValueError, match="attn_type must be 'varlen' or 'sdpa', got 'tree'"):
        args_class(attn_type="tree")
