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


def _workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    shutil.copytree(REPO / "archon_models", root / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "archon").mkdir(parents=True)
    for name in ("__init__.py",):
        shutil.copy(REPO / "tests" / name, root / "tests" / name)
        shutil.copy(REPO / "tests" / "archon" / name, root / "tests" / "archon" / name)
    shutil.copy(REPO / "tests/archon/conftest.py", root / "tests/archon/conftest.py")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _port(tmp_path: Path, rope_type: str) -> Path:
    root = _workspace(tmp_path)
    config = LlamaConfig(rope_parameters=dict(ROPE[rope_type]))
    source = tmp_path / "checkpoint"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config.to_dict()))
    result = port_model(PortModelRequest(source=str(source), overwrite=True, stages=[], workspace=root))
    assert result.passed, result.error
    assert "rope_scaling" in result.edits
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
