"""The GPU tier: each representative family in bf16 on CUDA against HF, and on CUDA against CPU in fp32.

Run on a CUDA machine: ``python -m pytest -m gpu tests/gpu``. Without CUDA every test is
skipped, saying so. The checks are ``skill.harness.device_checks`` (the suite runs the same
code on CPU in ``tests/skill/test_device_checks.py``); ``bench/gpu_check.py`` prints them as
a table next to the training-step measurements.

Each family is one kernel or block structure (``REPRESENTATIVES``): varlen (llama), flex
soft-cap and window (gemma2), sinks (gpt_oss), ALiBi (bloom), MoE (mixtral), MLA
(deepseek_v3), parallel block (gptj), fused q/k/v (phi3), QK norm (qwen3), Gated DeltaNet beside
attention (qwen3_5_text: fla's and causal-conv1d's kernels when installed). Every case runs
on several documents of different lengths packed in one row with ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

import archon_models  # noqa: F401 - registers every family
from skill.harness.device_checks import REPRESENTATIVES, DeviceTierReport, check_on_device, representative

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]

FAMILIES = [rep.family for rep in REPRESENTATIVES]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], DeviceTierReport]:
    """Both checks of a family, run once per module (the two tests read the same report)."""
    hf_logging.disable_progress_bar()
    reports: dict[str, DeviceTierReport] = {}
    workdir: Path = tmp_path_factory.mktemp("gpu-tier")

    def get(family: str) -> DeviceTierReport:
        if family not in reports:
            reports[family] = check_on_device(representative(family).case(), "cuda", workdir=workdir)
        return reports[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_error_within_twice_hf_own(report: Callable[[str], DeviceTierReport], family: str) -> None:
    """Archon bf16's mean error against HF fp32, over HF bf16's own: logits and named gradients."""
    result = report(family)
    assert result.bf16_passed, result.bf16_summary()


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_matches_cpu_in_fp32(report: Callable[[str], DeviceTierReport], family: str) -> None:
    """The same package in fp32 on CUDA and on CPU: within tolerance, or by the ratio where its
    CUDA path computes in bf16 on purpose (the grouped expert GEMMs)."""
    result = report(family)
    assert result.devices_passed, result.devices_summary()
