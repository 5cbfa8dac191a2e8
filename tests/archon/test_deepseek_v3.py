"""Stage tests of the deepseek_v3 reference: multi-head latent attention and DeepSeek-V3 routing.

Everything model-specific comes from the registry and the transformers config class;
the cases only say which tiny variant to prove.
"""

from pathlib import Path

import pytest
import torch

from skill.harness import (
    ModelCase,
    run_adapter_stage,
    run_args_stage,
    run_checkpoint_stage,
    run_completeness_stage,
    run_parity_stage,
)
from skill.harness.distributed import run_stage5
from skill.harness.models import build_hf_config, build_hf_model, load_archon_model, save_hf_checkpoint
from skill.harness.parity import parity_inputs, single_sequence

# The tiny default has a query latent (q_lora_rank), interleaved RoPE pairs, one leading
# dense layer, a shared expert, and grouped top-k (n_group=2, topk_group=1) with
# renormalised, scaled sigmoid scores. The second case has a plain q_proj, half-rotation
# RoPE, value heads narrower than query/key heads (padded for the kernel), one expert
# group, no renormalisation, no leading dense layer, and tied embeddings. The third
# stretches the context with YaRN, whose mscale/mscale_all_dim change both cos/sin and the
# softmax scale.
CASES = [
    ModelCase(model_type="deepseek_v3"),
    ModelCase(
        model_type="deepseek_v3",
        config_overrides={
            "q_lora_rank": None,
            "rope_interleave": False,
            "v_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "first_k_dense_replace": 0,
            "tie_word_embeddings": True,
        },
        name="deepseek_v3-noqlora",
    ),
    ModelCase(
        model_type="deepseek_v3",
        config_overrides={
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.8,
                "mscale_all_dim": 1.0,
            },
        },
        name="deepseek_v3-yarn",
    ),
]


@pytest.mark.stage1
def test_stage1_args(case, prove):
    prove(run_args_stage, case)


@pytest.mark.stage2
def test_stage2_adapter(case, prove, tmp_path):
    prove(run_adapter_stage, case, workdir=tmp_path)


@pytest.mark.stage3
def test_stage3_completeness(case, prove, tmp_path):
    prove(run_completeness_stage, case, workdir=tmp_path)


@pytest.mark.stage4
def test_stage4_parity(case, prove, tmp_path):
    prove(run_parity_stage, case, workdir=tmp_path)


@pytest.mark.stage4
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 parity needs a CUDA GPU; it is never faked on CPU")
def test_stage4_parity_bf16_cuda(case, prove, tmp_path):
    prove(run_parity_stage, case, workdir=tmp_path, device="cuda", dtype=torch.bfloat16)


@pytest.mark.stage6
def test_stage6_checkpoint(case, prove, tmp_path):
    prove(run_checkpoint_stage, case, workdir=tmp_path)


@pytest.mark.stage5
def test_stage5_distributed(case, prove, tmp_path):
    prove(run_stage5, case, workdir=tmp_path)


def _logits_with_bias(tmp_path: Path, bias_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF and Archon logits of one sequence, every router's correction bias drawn at ``bias_scale``."""
    case = CASES[0]
    hf_config = build_hf_config(case)
    hf_model = build_hf_model(case, hf_config)
    generator = torch.Generator().manual_seed(7)
    for name, buffer in hf_model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * bias_scale)
    checkpoint = save_hf_checkpoint(hf_model, tmp_path / f"hf_bias_{bias_scale}")
    archon = load_archon_model(hf_config, checkpoint)
    inputs = single_sequence(parity_inputs(case, hf_config))
    with torch.no_grad():
        expected = hf_model(input_ids=inputs.tokens).logits
        got = archon.model(inputs.tokens, inputs.positions, inputs.cu_seqlens, inputs.max_seqlen)
    return got, expected


@pytest.mark.stage4
def test_score_correction_bias_selects_experts_like_hf(tmp_path):
    """The tiny models' bias is zero; a drawn one must steer selection the same way in both.

    A bias large enough to override the sigmoid scores changes the logits (so the check
    is not vacuous), and Archon still matches HF: the bias picks experts but does not
    weight them, and it loads from ``e_score_correction_bias`` into ``expert_bias``.
    """
    got, expected = _logits_with_bias(tmp_path, bias_scale=1.0)
    baseline, _ = _logits_with_bias(tmp_path, bias_scale=0.0)
    assert (expected - baseline).abs().max() > 1e-3, "the drawn bias did not change the routing"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_reference_variants_are_proven_cases():
    """Every config variant the analyser counts as served by this reference is a case above."""
    from skill.analysis.reference import REFERENCE_VARIANTS

    for variant in REFERENCE_VARIANTS["deepseek_v3"]:
        assert any(all(case.config_overrides.get(k, object()) == v for k, v in variant) for case in CASES), variant
