"""analyze_hf_model's sources, bad input, the CLI, and the all-family config smoke."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from skill.analysis import AnalysisError, AnalyzeInput, analyze_hf_model, decoder_only_candidates
from skill.analysis.inputs import check_decoder_only, resolve_source
from skill.cli import main as cli_main
from skill.tiny_model import TinyModelError, build_tiny_model, tiny_config

hf_logging.set_verbosity_error()


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("not_a_family", "unknown model_type 'not_a_family'"),
        ("bert", "is an encoder"),
        ("bart", "is an encoder-decoder"),
        ("gemma3", "analyse its text model instead: model_type 'gemma3_text'"),
        ("jamba", "hybrid, state-space or recurrent"),
        ("mamba", "hybrid, state-space or recurrent"),
        ("lfm2", "hybrid, state-space or recurrent"),  # conv_* fields: short-convolution layers
        ("bert-generation", "attends to later tokens"),  # causal-LM head on a bidirectional encoder
        ("org/some-model", "not fetched (no network)"),
    ],
)
def test_bad_sources_name_the_problem_and_the_fix(source: str, message: str) -> None:
    with pytest.raises(AnalysisError, match=message.replace("(", r"\(").replace(")", r"\)")):
        analyze_hf_model(AnalyzeInput(source=source))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(AnalysisError, match=re.escape("has no config.json")):
        analyze_hf_model(AnalyzeInput(source=str(tmp_path)))


def test_malformed_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(AnalysisError, match="is not valid JSON"):
        analyze_hf_model(AnalyzeInput(source=str(tmp_path / "config.json")))
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(AnalysisError, match="has no 'model_type'"):
        analyze_hf_model(AnalyzeInput(source=str(tmp_path)))


def test_remote_code_needs_trust(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "my_remote_lm", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}})
    )
    (tmp_path / "configuration_my.py").write_text("raise RuntimeError('must not run')\n")
    (tmp_path / "modeling_my.py").write_text("raise RuntimeError('must not run')\n")
    with pytest.raises(AnalysisError, match="pass trust_remote_code=True"):
        analyze_hf_model(AnalyzeInput(source=str(tmp_path)))


def test_checkpoint_folder_with_weights_and_non_default_scalars(tmp_path: Path) -> None:
    """A granite checkpoint: every multiplier read from the probes, keys from the files."""
    config = tiny_config(
        "granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=8.0,
        attention_multiplier=0.0078125,
    )
    build_tiny_model(config).save_pretrained(tmp_path)
    before = _snapshot(tmp_path)
    cwd_before = sorted(os.listdir("."))
    report = analyze_hf_model(AnalyzeInput(source=str(tmp_path)))
    assert report.source_kind == "folder"
    scalars = report.checklist.scalars
    assert scalars.embedding_scale_kind == "constant"
    assert scalars.embedding_scale == pytest.approx(12.0)
    assert scalars.residual_multiplier == pytest.approx(0.22)
    assert scalars.logit_multiplier == pytest.approx(1 / 8.0)
    assert report.checklist.attention.custom_scaling
    assert report.checklist.attention.scaling_field == "attention_multiplier"
    file_keys = {k.key for k in report.checkpoint.from_files}
    assert "model.layers.0.self_attn.q_proj.weight" in file_keys
    assert "model.layers.1.self_attn.q_proj.weight" not in file_keys
    # Nothing written: neither in the checkpoint folder nor in the working directory.
    assert _snapshot(tmp_path) == before
    assert sorted(os.listdir(".")) == cwd_before


def test_config_file_source_keeps_its_values(tmp_path: Path) -> None:
    config = AutoConfig.for_model("qwen2", num_key_value_heads=4, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    report = analyze_hf_model(AnalyzeInput(source=str(tmp_path / "config.json")))
    assert report.source_kind == "config_file"
    assert report.checklist.attention.gqa
    assert report.checklist.scalars.tie_word_embeddings
    assert report.reference == "qwen2"


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["analyze", "qwen3"]) == 0
    table = capsys.readouterr().out
    # A dense family starts from qwen2 (its per-head QK norm is an edit there).
    assert "nearest reference: qwen2" in table
    assert "qk_norm" in table and "per_head_rms" in table
    assert cli_main(["analyze", "qwen3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reference"] == "qwen2"
    assert data["checklist"]["attention"]["qk_norm"] == "per_head_rms"


def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["analyze", "bart"]) == 2
    assert "encoder-decoder" in capsys.readouterr().err


def test_every_candidate_family_resolves_or_is_refused_by_name() -> None:
    """Fast smoke over every causal-LM family of transformers: the config-level checks.

    Each candidate either passes the decoder-only checks and shrinks to a tiny config, or
    is refused with an AnalysisError (or TinyModelError) naming the problem. The full
    analysis of every family is the benchmark ``bench/analyze_all.py``.
    """
    candidates = decoder_only_candidates()
    assert len(candidates) > 100
    accepted = 0
    for model_type in candidates:
        config = None
        try:
            config = resolve_source(model_type).config
            check_decoder_only(config)
            tiny = tiny_config(config)
        except AnalysisError as exc:
            names = {model_type, getattr(config, "model_type", model_type)}
            assert any(name in str(exc) for name in names), str(exc)
            continue
        except TinyModelError as exc:
            assert type(config).__name__ in str(exc)
            continue
        assert tiny.hidden_size <= 64, model_type
        accepted += 1
    assert accepted > 80


def test_bench_table_counts_analysed_and_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "analyze_all.py"))
    assert bench["main"](["qwen2", "bart"]) == 0
    out = capsys.readouterr().out
    assert "analysed 1 families, 1 with no unsupported feature, refused 1, failed 0" in out
    assert "bart: 'bart' is an encoder-decoder model" in out


def test_a_dense_family_does_not_claim_its_moe_variant():
    """A dense port cannot load a MoE checkpoint, so glm4's package serves glm4 only (its
    session registered glm4_moe too, unlike `add`); a MoE family keeps its dense variant."""
    from skill.analysis.analyze import _variants

    assert _variants("glm4", has_moe=False) == ["glm4"]
    assert _variants("ernie4_5", has_moe=False) == ["ernie4_5"]
    assert _variants("qwen3_moe", has_moe=True) == ["qwen3", "qwen3_moe"]
