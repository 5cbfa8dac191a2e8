"""Stage tests of the qwen3_5 reference: a hybrid of Gated DeltaNet and gated full attention.

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

# The tiny config keeps Qwen3.5's pattern (three linear-attention layers, then full
# attention), grouped value heads (2 key heads serve 4 value heads) and partial RoPE. The
# second case ties its embeddings and packs a document of 70 tokens: more than one chunk of
# the gated delta rule (64), so the state carried between chunks is compared with HF too.
CASES = [
    ModelCase(model_type="qwen3_5_text"),
    ModelCase(
        model_type="qwen3_5_text",
        config_overrides={
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "tie_word_embeddings": True,
        },
        doc_lens=(70, 9, 4),
        name="qwen3_5_text-tied-two-chunks",
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
