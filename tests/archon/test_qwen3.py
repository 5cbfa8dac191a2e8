"""Stage tests of the qwen3 reference: dense and MoE, per-head QK RMSNorm, no bias.

Everything model-specific comes from the registry and the transformers config class;
the cases only say which tiny variant to prove.
"""

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

# Grouped-query attention throughout. The dense case ties its embeddings, as Qwen3-0.6B does
# (qwen2 and the MoE cases cover untied heads). The second MoE case mixes MoE and dense
# layers (mlp_only_layers) and renormalises the top-k weights, so both FFN paths and
# route_norm are exercised.
CASES = [
    ModelCase(model_type="qwen3", config_overrides={"num_key_value_heads": 2, "tie_word_embeddings": True}),
    ModelCase(model_type="qwen3_moe"),
    ModelCase(
        model_type="qwen3_moe",
        config_overrides={"mlp_only_layers": [1], "norm_topk_prob": True},
        name="qwen3_moe-mixed",
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
