"""The GPU tier's checks (``skill.harness.device_checks``) run on CPU: what the GPU tier will
judge, proven on the paths a CPU has, and shown to fail a port that is slightly wrong.

On CPU the "device" is the CPU itself, so the fp32 agreement is exact; the bf16 ratio is a
real measurement of the CPU kernels in bf16 against HF's own bf16 error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.utils import logging as hf_logging

import archon_models  # noqa: F401 - registers every family
from skill.harness import device_checks
from skill.harness.device_checks import (
    BF16_RATIO_LIMIT,
    DEVICE_FP32_RTOL,
    REPRESENTATIVES,
    DeviceDiff,
    ErrorRatio,
    check_on_device,
    computes_bf16_on,
    named_gradients,
    representative,
)
from skill.harness.models import (
    ArchonModel,
    build_archon_model,
    build_hf_config,
    build_hf_model,
    load_archon_model_on,
    read_hf_checkpoint,
    save_hf_checkpoint,
)
from tests.gpu import test_gpu_tier


@pytest.fixture(autouse=True)
def _quiet() -> None:
    hf_logging.disable_progress_bar()


def _layer_norm_weights(family: str) -> set[str]:
    model = build_archon_model(build_hf_config(representative(family).case()), device="meta").model
    return {f"grad {name}.weight" for name, module in model.named_modules() if isinstance(module, nn.LayerNorm)}


@pytest.mark.parametrize("family", [rep.family for rep in REPRESENTATIVES])
def test_representative_within_bf16_ratio_on_cpu(family: str, tmp_path: Path) -> None:
    """Every representative, its GPU case run on CPU: within twice HF's own bf16 error.

    One exception, a property of the CPU kernel, not of a package: CPU's bf16 LayerNorm
    backward rounds its weight gradient along the rows it reduces, so a packed row of 2400
    tokens loses more than four documents reduced apart (measured in isolation: 1.5x the
    error), and bloom's and gptj's final LayerNorm weight lands at 1.6-2.4x. CUDA reduces in
    fp32. Those gradients are left to the GPU tier; the rest of each family is checked here.
    """
    report = check_on_device(representative(family).case(), "cpu", workdir=tmp_path)
    assert report.bf16_logits.passed, report.bf16_summary()
    cpu_rounding = _layer_norm_weights(family)
    checked = [g for g in report.bf16_grads if g.name not in cpu_rounding]
    assert checked and all(g.passed for g in checked), report.bf16_summary()
    assert report.devices_passed and report.computes_bf16 is None, report.devices_summary()
    assert report.doc_lens == device_checks.DOC_LENS


def test_named_gradients_cover_each_part_of_the_model() -> None:
    """Embedding, first attention, the last layer's router and experts (MoE) or MLP, final norm, head."""

    def meta_model(family: str) -> nn.Module:
        return build_archon_model(build_hf_config(representative(family).case()), device="meta").model

    def names(family: str) -> list[str]:
        return named_gradients(meta_model(family))

    assert names("llama") == [
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.1.feed_forward.w1.weight",
        "norm.weight",
        "output.weight",
    ]
    deepseek = names("deepseek_v3")
    assert deepseek[:2] == ["tok_embeddings.weight", "layers.0.attention.wq_a.weight"]
    last = f"layers.{len(meta_model('deepseek_v3').layers) - 1}"
    assert f"{last}.moe.router.gate.weight" in deepseek and f"{last}.moe.experts.w1" in deepseek
    # Tied embeddings: one parameter, named once.
    assert "output.weight" not in names("qwen3")


def _perturbed_loader(scale: float):
    """``load_archon_model_on`` whose bf16 models have the final norm's weight scaled: a port
    off by ``scale - 1`` in one place, as a missed offset or scalar would be."""

    def load(*args, **kwargs) -> ArchonModel:
        archon = load_archon_model_on(*args, **kwargs)
        dtype = kwargs.get("dtype", args[3] if len(args) > 3 else None)
        if dtype == torch.bfloat16:
            with torch.no_grad():
                archon.model.norm.weight.mul_(scale)
        return archon

    return load


def test_bf16_ratio_fails_a_port_off_by_two_percent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    case = representative("llama").case()
    monkeypatch.setattr(device_checks, "load_archon_model_on", _perturbed_loader(1.02))
    report = check_on_device(case, "cpu", workdir=tmp_path)
    # Measured: logits 2.7x, the final norm's gradient 5.4x HF's own bf16 error.
    assert not report.bf16_passed
    assert report.bf16_logits.ratio > BF16_RATIO_LIMIT, report.bf16_summary()


def test_error_ratio_and_device_diff_judgements() -> None:
    assert ErrorRatio(name="x", archon_error=2e-3, hf_error=1e-3).passed
    assert not ErrorRatio(name="x", archon_error=2.1e-3, hf_error=1e-3).passed
    assert ErrorRatio(name="x", archon_error=0.0, hf_error=0.0).passed
    assert not ErrorRatio(name="x", archon_error=1e-9, hf_error=0.0).passed
    # Tolerance: the max difference against the reference's largest value.
    close = DeviceDiff(name="x", max_abs_diff=0.9 * DEVICE_FP32_RTOL * 10, mean_abs_diff=1.0, scale=10.0)
    far = DeviceDiff(name="x", max_abs_diff=1.1 * DEVICE_FP32_RTOL * 10, mean_abs_diff=0.0, scale=10.0)
    assert close.judged_by == "tolerance" and close.passed and not far.passed
    # Ratio (bf16 on purpose): the mean difference against twice HF's own bf16 error.
    ratio_ok = DeviceDiff(name="x", max_abs_diff=1.0, mean_abs_diff=1.9e-3, scale=10.0, hf_bf16_error=1e-3)
    ratio_bad = DeviceDiff(name="x", max_abs_diff=0.0, mean_abs_diff=2.1e-3, scale=10.0, hf_bf16_error=1e-3)
    assert ratio_ok.judged_by == "ratio" and ratio_ok.passed and not ratio_bad.passed


def test_grouped_expert_gemms_are_bf16_on_cuda_only() -> None:
    class Experts(nn.Module):
        use_grouped_mm = True

    model = nn.Sequential(nn.Linear(2, 2), Experts())
    assert "grouped expert GEMMs" in (computes_bf16_on(model, torch.device("cuda")) or "")
    assert computes_bf16_on(model, torch.device("cpu")) is None
    assert computes_bf16_on(nn.Linear(2, 2), torch.device("cuda")) is None


def test_load_archon_model_on_keeps_ties_buffers_and_fp32_rope(tmp_path: Path) -> None:
    """Meta -> to_empty -> load: tied weights stay one parameter (to_empty alone unties them),
    the RoPE cache is recomputed in fp32, a loaded router bias keeps the checkpoint's values."""
    qwen3 = representative("qwen3").case()
    config = build_hf_config(qwen3)
    checkpoint = save_hf_checkpoint(build_hf_model(qwen3, config), tmp_path / "qwen3")
    model = load_archon_model_on(config, checkpoint, "cpu", torch.bfloat16).model
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.rope_cache.dtype == torch.float32

    deepseek = representative("deepseek_v3").case()
    config = build_hf_config(deepseek)
    checkpoint = save_hf_checkpoint(build_hf_model(deepseek, config), tmp_path / "deepseek_v3")
    saved = {k: v for k, v in read_hf_checkpoint(checkpoint).items() if k.endswith("e_score_correction_bias")}
    assert saved and any(bool(v.abs().max() > 0) for v in saved.values())
    model = load_archon_model_on(config, checkpoint, "cpu", torch.bfloat16).model
    for key, value in saved.items():
        layer = key.split(".")[2]
        loaded = model.get_buffer(f"layers.{layer}.moe.expert_bias")
        # In the buffer's own dtype: the package's init_buffers decides it (fp32 here).
        torch.testing.assert_close(loaded, value.to(loaded.dtype), rtol=0, atol=0)


def test_gpu_tier_assertions_pass_on_cpu_reports(tmp_path: Path) -> None:
    """The GPU tier's own test functions, handed a report computed on CPU: they run and pass."""
    report = check_on_device(representative("llama").case(), "cpu", workdir=tmp_path)
    test_gpu_tier.test_bf16_error_within_twice_hf_own(lambda family: report, "llama")
    test_gpu_tier.test_cuda_matches_cpu_in_fp32(lambda family: report, "llama")
