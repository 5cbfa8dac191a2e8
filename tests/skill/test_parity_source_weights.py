"""Stage 4 with a source folder (issue 8, item 5): the folder's own weights are compared too.

HF ``from_pretrained(folder)`` against the Archon model loaded from the folder's
safetensors through the adapter, logits in fp32 judged by HF's float64 run of the same weights. The
remote-code path (``trust_remote_code``) is exercised by tests/skill/test_composition_families.py.
"""

from __future__ import annotations

import torch

from skill.harness import parity
from skill.harness.case import ModelCase
from skill.harness.models import build_hf_model, save_hf_checkpoint
from skill.harness.parity import run_parity_stage

OWN = "source folder's own weights"


def _folder(tmp_path):
    # Seeded differently from the stage's own tiny model, so the two comparisons differ.
    model = build_hf_model(ModelCase(model_type="qwen2", seed=11))
    return save_hf_checkpoint(model, tmp_path / "checkpoint")


def _own_checks(result):
    return [c for c in result.checks if OWN in c.name]


def test_stage4_compares_the_source_folders_weights(tmp_path):
    folder = _folder(tmp_path)
    result = run_parity_stage(ModelCase(model_type="qwen2", source=str(folder)), workdir=tmp_path)
    own = _own_checks(result)
    assert result.passed
    # One sequence and packed documents, for both attention backends and the package run in
    # float64, each judged by HF's float64 run of the folder's weights.
    assert len(own) == 6 and all(c.passed for c in own)
    assert sum(c.run_dtype == "float64" for c in own) == 2
    assert all(c.error_vs_truth is not None and c.reference_error_vs_truth is not None for c in own)
    assert all(c.max_abs_diff is not None and c.max_abs_diff < 1e-5 for c in own)


def test_stage4_without_weights_in_the_folder_compares_only_the_tiny_model(tmp_path):
    folder = _folder(tmp_path)
    for file in folder.glob("*.safetensors"):
        file.unlink()
    result = run_parity_stage(ModelCase(model_type="qwen2", source=str(folder)), workdir=tmp_path)
    assert result.passed and not _own_checks(result)
    assert not _own_checks(run_parity_stage(ModelCase(model_type="qwen2"), workdir=tmp_path))


def test_stage4_fails_when_archon_disagrees_with_the_folders_weights(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    load = parity.load_archon_model

    def skewed(hf_config, checkpoint, attn_type="sdpa"):
        archon = load(hf_config, checkpoint, attn_type=attn_type)
        if checkpoint == folder:
            with torch.no_grad():
                archon.model.norm.weight.mul_(1.01)
        return archon

    monkeypatch.setattr(parity, "load_archon_model", skewed)
    result = run_parity_stage(
        ModelCase(model_type="qwen2", source=str(folder)),
        workdir=tmp_path,
        raise_on_failure=False,
    )
    own = _own_checks(result)
    assert not result.passed and own and not any(c.passed for c in own)
    # The tiny seeded model's own comparison is untouched by the skew.
    assert all(c.passed for c in result.checks if OWN not in c.name)


def test_stage4_passes_a_folder_whose_logits_reach_30(tmp_path):
    """Real checkpoints have logits of +-30: HF's own fp32 run of such a folder is further
    from its float64 run than assert_close's 1e-5 allows, and so is a correct port; judged
    against the float64 run, the port passes."""
    model = build_hf_model(ModelCase(model_type="qwen2", seed=11, config_overrides={"initializer_range": 1.0}))
    folder = save_hf_checkpoint(model, tmp_path / "checkpoint")
    result = run_parity_stage(ModelCase(model_type="qwen2", source=str(folder)), workdir=tmp_path)
    own = _own_checks(result)
    assert result.passed and len(own) == 6
    for check in own:
        assert check.reference_error_vs_truth > 1e-5 + 1.3e-6 * 40, check.line()
        assert check.error_ratio < 1.5, check.line()
