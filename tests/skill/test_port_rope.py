"""set_rope: a scaled-RoPE checkpoint gets the variant, equal to transformers' own frequencies."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from skill.porting.port_model import PortModelRequest, port_model
from skill.porting.run_test_stage import run_stage_subprocess

REPO = Path(__file__).resolve().parents[2]

ROPE = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
    },
}


def _workspace(tmp_path: Path, *packages: str) -> Path:
    """A project copy; each of ``packages`` is created as a copy of the qwen2 reference
    (set_rope edits a package that exists, it never creates one)."""
    from skill.porting.copy_reference import CopyReferenceRequest, copy_reference

    root = tmp_path / "ws"
    shutil.copytree(REPO / "archon_models", root / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "archon").mkdir(parents=True)
    for name in ("__init__.py",):
        shutil.copy(REPO / "tests" / name, root / "tests" / name)
        shutil.copy(REPO / "tests" / "archon" / name, root / "tests" / "archon" / name)
    shutil.copy(REPO / "tests/archon/conftest.py", root / "tests/archon/conftest.py")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    for package in packages:
        copy_reference(CopyReferenceRequest(model_name=package, reference="qwen2", workspace=root))
    return root


def _port(tmp_path: Path, rope_type: str) -> Path:
    root = _workspace(tmp_path)
    config = LlamaConfig(rope_parameters=dict(ROPE[rope_type]))
    source = tmp_path / "checkpoint"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config.to_dict()))
    result = port_model(PortModelRequest(source=str(source), overwrite=True, stages=[], workspace=root))
    assert result.passed, result.error
    assert "rope_cache" in result.edits
    return root


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rope_type", ["llama3", "linear", "yarn"])
def test_scaled_rope_matches_transformers(tmp_path, rope_type):
    root = _port(tmp_path, rope_type)
    rope = _load(root / "archon_models/llama/model/rope.py", f"_rope_{rope_type}")
    head_dim, seq = 16, 200
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(ROPE[rope_type]))
    scaling = {k: float(v) for k, v in ROPE[rope_type].items() if k not in ("rope_type", "rope_theta")}
    # HF asks max_position_embeddings >= the original context for YaRN's factor check.
    config.max_position_embeddings = 128
    cache = rope.precompute_rope_cache(head_dim, seq, ROPE[rope_type]["rope_theta"], scaling)
    hf = LlamaRotaryEmbedding(config)
    positions = torch.arange(seq).unsqueeze(0)
    cos, sin = hf(torch.zeros(1, seq, head_dim), positions)
    torch.testing.assert_close(cache[:, :head_dim], cos[0])
    torch.testing.assert_close(cache[:, head_dim:], sin[0])
    default = rope.precompute_rope_cache(head_dim, seq, ROPE[rope_type]["rope_theta"])
    assert not torch.allclose(default, cache), "the scaling must change the frequencies"


@pytest.mark.slow
def test_llama3_port_matches_hf_end_to_end(tmp_path):
    root = _port(tmp_path, "llama3")
    test_file = (root / "tests/archon/test_llama.py").read_text()
    assert '"rope_type": "llama3"' in test_file
    result = run_stage_subprocess(root, "llama", [1, 4])
    assert result.passed, result.output_tail
    assert result.max_abs_diff is not None and result.max_abs_diff < 1e-5


def _cohere_reference(head_dim: int, base: float):
    from transformers import CohereConfig
    from transformers.models.cohere.modeling_cohere import (
        CohereRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = CohereConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    return CohereRotaryEmbedding(config), apply_rotary_pos_emb


def _write_interleaved(root: Path) -> tuple[Path, list[str]]:
    from skill.porting.common import staged
    from skill.porting.plan import plan_for
    from skill.porting.set_rope import SetRopeRequest, apply_set_rope

    # llama's plan with the one feature under test changed: set_rope reads only the plan.
    plan = plan_for("llama").model_copy(update={"rotary_interleaved": True})
    request = SetRopeRequest(model_name="llama", source="llama", workspace=root)
    with staged(root) as tree:
        result = apply_set_rope(tree, request, plan)
    assert not result.reexported and result.rope_type == "default"
    return root / "archon_models/llama/model/rope.py", result.changed_files


@pytest.mark.parametrize(
    "positions",
    [
        torch.arange(12).unsqueeze(0).expand(2, 12),
        # Packed documents restarting at 0, different per row.
        torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 0]]),
        torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(1)),
    ],
    ids=["arange", "packed", "random"],
)
def test_interleaved_rope_matches_cohere(tmp_path, positions):
    root = _workspace(tmp_path, "ropey")
    path, changed = _write_interleaved(root)
    assert changed == ["archon_models/llama/model/rope.py"]
    rope = _load(path, f"_rope_interleaved_{id(positions)}")
    head_dim, n_heads, n_kv, base = 16, 4, 2, 10000.0
    generator = torch.Generator().manual_seed(0)
    xq = torch.randn(2, 12, n_heads, head_dim, generator=generator)
    xk = torch.randn(2, 12, n_kv, head_dim, generator=generator)
    cache = rope.precompute_rope_cache(head_dim, 64, base)
    q_out, k_out = rope.apply_rotary_emb(xq, xk, cache, positions)

    hf_rotary, hf_apply = _cohere_reference(head_dim, base)
    cos, sin = hf_rotary(xq, positions)
    q_ref, k_ref = hf_apply(xq.transpose(1, 2), xk.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2))
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2))
    # The halves layout (qwen2's) gives something else: the test can tell them apart.
    from archon_models.qwen2.model import rope as half_rope

    q_half, _ = half_rope.apply_rotary_emb(xq, xk, half_rope.precompute_rope_cache(head_dim, 64, base), positions)
    assert not torch.allclose(q_half, q_out)
    assert rope.repeat_kv(xk, 2).shape == (2, 12, n_heads, head_dim)


def test_interleaved_rope_written_once_and_idempotent(tmp_path):
    root = _workspace(tmp_path, "ropey")
    path, changed = _write_interleaved(root)
    first = path.read_text()
    assert changed and "x[..., ::2]" in first and "repeat_interleave" in first
    _, changed_again = _write_interleaved(root)
    assert changed_again == []
    assert path.read_text() == first


def test_interleaved_pairing_detected_and_chosen(tmp_path):
    from skill.porting.plan import plan_for
    from skill.porting.set_rope import SetRopeRequest, interleaved_source, set_rope

    # The analysis reads the pairing (repeat_interleave / x[..., ::2] in cohere's helpers).
    assert plan_for("cohere").rotary_interleaved
    assert not plan_for("qwen2").rotary_interleaved
    root = _workspace(tmp_path)
    result = set_rope(SetRopeRequest(model_name="llama", source="cohere", workspace=root))
    assert result.changed_files == ["archon_models/llama/model/rope.py"]
    assert (root / "archon_models/llama/model/rope.py").read_text() == interleaved_source("Llama")
    again = set_rope(SetRopeRequest(model_name="llama", source="cohere", workspace=root))
    assert again.changed_files == []


@pytest.mark.parametrize("scaled", [False, True], ids=["default", "linear"])
def test_interleaved_partial_rope_matches_glm(scaled):
    """Interleaved pairing x partial rotary (x frequency scaling) compose: GLM's rotary."""
    from transformers import GlmConfig
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding, apply_rotary_pos_emb

    from skill.porting.set_rope import composed_source

    head_dim, n_heads, seq, base = 16, 4, 12, 10000.0
    rope = (
        {"rope_type": "linear", "rope_theta": base, "factor": 2.0}
        if scaled
        else {"rope_type": "default", "rope_theta": base}
    )
    config = GlmConfig(
        hidden_size=64,
        num_attention_heads=n_heads,
        head_dim=head_dim,
        rope_parameters={**rope, "partial_rotary_factor": 0.5},
    )
    path = REPO / "build" / f"_glm_rope_{scaled}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(composed_source("Glm", rope["rope_type"], partial=True, interleaved=True))
    try:
        module = _load(path, f"_glm_rope_{scaled}")
    finally:
        path.unlink()
    generator = torch.Generator().manual_seed(0)
    xq = torch.randn(1, seq, n_heads, head_dim, generator=generator)
    xk = torch.randn(1, seq, 2, head_dim, generator=generator)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]])
    scaling = {"factor": 2.0} if scaled else None
    cache = module.precompute_rope_cache(head_dim // 2, 64, base, *([scaling] if scaled else []))
    q_out, k_out = module.apply_rotary_emb(xq, xk, cache, positions)
    cos, sin = GlmRotaryEmbedding(config)(xq, positions)
    q_ref, k_ref = apply_rotary_pos_emb(xq.transpose(1, 2), xk.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2))
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2))


def test_per_layer_type_rope_reads_nested_and_shared_parameters():
    """Per-layer-type RoPE reads each layer type's dict; a config whose ``rope_parameters``
    is one dict (transformers 5.3's Olmo3, whose model shares one RoPE) serves every layer
    type from it instead of failing with a KeyError."""
    from types import SimpleNamespace

    from skill.snippets.args import _layer_rope_freq_scaling, _layer_rope_parameters

    nested = SimpleNamespace(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    assert _layer_rope_parameters(nested, "full_attention")["rope_theta"] == 1e6
    assert _layer_rope_parameters(nested, "sliding_attention")["rope_theta"] == 1e4
    assert _layer_rope_freq_scaling(nested, "full_attention") == {"factor": 8.0}
    assert _layer_rope_freq_scaling(nested, "sliding_attention") is None
    shared = SimpleNamespace(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0})
    for layer_type in ("full_attention", "sliding_attention"):
        assert _layer_rope_parameters(shared, layer_type)["rope_theta"] == 5e5
        assert _layer_rope_freq_scaling(shared, layer_type) == {"factor": 2.0}
