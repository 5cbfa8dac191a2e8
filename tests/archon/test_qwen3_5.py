"""Stage tests of the qwen3_5 reference: a hybrid of Gated DeltaNet and gated full attention,
dense and MoE.

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
# second case ties its embeddings, sets a head_dim other than hidden / heads (as Qwen3.5-MoE's
# 256 on 2048 / 16; the analysis counts it as served, REFERENCE_VARIANTS) and packs a document
# of 70 tokens: more than one chunk of the gated delta rule (64), so the state carried between
# chunks is compared with HF too.
CASES = [
    ModelCase(model_type="qwen3_5_text"),
    # The MoE variant: routed experts (top-k renormalised) beside a gated shared expert.
    ModelCase(model_type="qwen3_5_moe_text"),
    ModelCase(
        model_type="qwen3_5_text",
        config_overrides={
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "tie_word_embeddings": True,
            "head_dim": 32,
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


def test_reference_variants_are_proven_cases():
    """Every config variant the analyser counts as served by this reference is a case above."""
    from skill.analysis.reference import REFERENCE_VARIANTS

    for variant in REFERENCE_VARIANTS["qwen3_5"]:
        assert any(all(case.config_overrides.get(k, object()) == v for k, v in variant) for case in CASES), variant


def test_a_released_checkpoint_s_multimodal_namespace_loads_and_is_written_back(tmp_path):
    """Released Qwen3.5 checkpoints keep the text model under ``model.language_model.`` beside
    the vision tower and the MTP blocks. The adapter built on such a folder (as AReaL's engine
    builds it, with ``hf_assets_path``) loads the text weights, drops the others as
    transformers' load does, and writes back the checkpoint's own names, which AReaL's engine
    loads the checkpoint by."""
    from safetensors.torch import save_file

    from skill.harness.models import build_archon_model, build_hf_config, build_hf_model, read_hf_checkpoint
    from skill.harness.models import save_hf_checkpoint as save

    hf_config = build_hf_config(CASES[0])
    clean = read_hf_checkpoint(save(build_hf_model(CASES[0], hf_config), tmp_path / "clean"))
    text = {k.replace("model.language_model.", "model.", 1): v for k, v in clean.items()}
    released = {k.replace("model.", "model.language_model.", 1): v for k, v in text.items()}
    extras = {"model.visual.blocks.0.attn.qkv.weight": torch.ones(3, 3), "mtp.fc.weight": torch.ones(2, 2)}
    folder = tmp_path / "released"
    folder.mkdir()
    save_file({**released, **extras}, str(folder / "model.safetensors"), metadata={"format": "pt"})

    adapter = build_archon_model(hf_config, hf_assets_path=folder).adapter
    loaded = adapter.from_hf({**released, **extras})
    expected = build_archon_model(hf_config).adapter.from_hf(text)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert adapter.to_hf(loaded).keys() == released.keys()
    # A text-only folder is written back text-only.
    text_only = build_archon_model(hf_config, hf_assets_path=tmp_path / "clean").adapter
    assert text_only.to_hf(loaded).keys() == clean.keys()
