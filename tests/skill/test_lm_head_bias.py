"""The LM head bias (Phi, GPT-J): the adapter side of the ``lm_head_bias`` edit.

The model side (``output`` built with a bias, zero at init, composing with the logit
transforms) is in ``test_contract_edits.py``; the detector in
``test_analyze_measurements.py``; parity, TP (the bias sharded with the head's vocabulary
rows) and the checkpoint roundtrip in ``tests/archon/test_phi.py`` / ``test_gptj.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skill.codemod.cst import Document
from skill.porting.common import PackageLayout
from skill.porting.edit_adapter_map import apply_head_bias_adapter, derive_from_hf_map

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("reference", ["qwen2", "qwen3"])
def test_critic_branch_drops_the_head_bias_on_both_references(reference: str) -> None:
    text = (REPO / f"archon_models/{reference}/model/state_dict_adapter.py").read_text()
    edited = apply_head_bias_adapter(Document(text), PackageLayout.for_name(reference)).code
    compile(edited, "state_dict_adapter.py", "exec")
    assert edited.count('state_dict.pop("output.bias", None)') == 1
    assert apply_head_bias_adapter(Document(edited), PackageLayout.for_name(reference)).code == edited


def test_head_bias_keys_follow_the_head_name() -> None:
    """The bias maps where the head's weight maps, also when the checkpoint renames the head."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "embed_out.weight", "embed_out.bias"]
    mapping = derive_from_hf_map(keys, module_map={"embed_out": "output"})
    assert mapping["embed_out.bias"] == "output.bias"
    assert mapping["embed_out.weight"] == "output.weight"
    mapping = derive_from_hf_map(["model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"])
    assert mapping["lm_head.bias"] == "output.bias"


def test_phi_critic_loads_a_causal_lm_checkpoint() -> None:
    """A critic converted from a checkpoint with ``lm_head.bias`` keeps neither head tensor
    (the adapter's completeness check refuses a stray ``output.bias``)."""
    import dataclasses

    from archon_models.phi.model.args import PhiModelArgs
    from archon_models.phi.model.model import PhiModel
    from archon_models.phi.model.state_dict_adapter import PhiStateDictAdapter
    from skill.tiny_model import tiny_config

    args = PhiModelArgs.from_hf_config(tiny_config("phi"), attn_type="sdpa")
    lm = PhiModel(args)
    lm.init_weights()
    adapter = PhiStateDictAdapter(args)
    hf = adapter.to_hf(lm.state_dict())
    assert "lm_head.bias" in hf
    critic_args = dataclasses.replace(args, is_critic=True)
    critic = PhiModel(critic_args)
    trunk = PhiStateDictAdapter(critic_args).from_hf(hf)
    assert not any(key.startswith("output.") for key in trunk)
    missing, unexpected = critic.load_state_dict(trunk, strict=False)
    assert not unexpected and all(key.startswith("score.") for key in missing)
    assert torch.equal(trunk["tok_embeddings.weight"], lm.tok_embeddings.weight)
