"""DeepSeek Sparse Attention's indexer, ported by the ``sparse_indexer`` edit, against the real
HF classes: the analysis measures it, the port picks HF's keys, the mask it makes is what
makes the logits match, and no gradient reaches it on either side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from skill.analysis.analyze import analyze_hf_model
from skill.analysis.report import AnalyzeInput
from skill.harness.case import ModelCase
from skill.harness.models import ModelPair, build_model_pair

# The half-split (DeepSeek-V3.2) and the interleaved (GLM-MoE-DSA) indexer RoPE.
FAMILIES = ("deepseek_v32", "glm_moe_dsa")
LENGTH = 16


def _pair(family: str, tmp_path: Path) -> ModelPair:
    pytest.importorskip(f"transformers.models.{family}")
    return build_model_pair(ModelCase(model_type=family), tmp_path)


def _causal_float(length: int) -> torch.Tensor:
    return torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None]


def _hidden(pair: ModelPair, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, LENGTH, pair.hf_config.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_analysis_measures_the_indexer(family: str) -> None:
    pytest.importorskip(f"transformers.models.{family}")
    report = analyze_hf_model(AnalyzeInput(source=family))
    mla = report.checklist.attention.mla
    assert mla is not None and mla.indexer is not None
    indexer = mla.indexer
    assert (indexer.topk_field, indexer.n_heads_field, indexer.head_dim_field) == (
        "index_topk",
        "index_n_heads",
        "index_head_dim",
    )
    assert indexer.rotary_interleaved is (family == "glm_moe_dsa")
    assert indexer.grad is False  # HF runs its indexer under torch.no_grad
    assert not report.unsupported


@pytest.mark.parametrize("family", FAMILIES)
def test_selection_matches_hf(family: str, tmp_path: Path) -> None:
    """Each query's kept keys: the port's mask against HF's indexer, on the same weights."""
    pair = _pair(family, tmp_path)
    hf_attention = pair.hf_model.model.layers[0].self_attn
    attention = pair.archon.model.layers["0"].attention
    x = _hidden(pair)
    positions = torch.arange(LENGTH)[None]
    with torch.no_grad():
        cos, sin = pair.hf_model.model.rotary_emb(x, positions)
        q_latent = hf_attention.q_a_layernorm(hf_attention.q_a_proj(x))
        hf_topk = hf_attention.indexer(x, q_latent, (cos, sin), _causal_float(LENGTH), positions)
        index = attention.indexer(x, q_latent, pair.archon.model.rope_cache, positions)
    kernel = sys.modules[type(attention.packed_attn).__module__]
    keep = kernel.sparse_index_mask(index[0][0], index[1][0], index[2][0], attention.packed_attn.topk, x.dtype)
    hf_sets = [{int(t) for t in row if int(t) <= s} for s, row in enumerate(hf_topk[0])]
    archon_sets = [set(keep[s].nonzero().flatten().tolist()) for s in range(LENGTH)]
    assert archon_sets == hf_sets
    topk = pair.hf_config.index_topk
    assert topk < LENGTH and all(len(chosen) == min(topk, s + 1) for s, chosen in enumerate(hf_sets))


def _logits(pair: ModelPair, tokens: torch.Tensor) -> torch.Tensor:
    cu_seqlens = torch.tensor([0, tokens.shape[1]], dtype=torch.int32)
    return pair.archon.model(tokens, torch.arange(tokens.shape[1])[None], cu_seqlens, tokens.shape[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mask_matters_and_no_gradient_reaches_the_indexer(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = _pair(family, tmp_path)
    tokens = torch.randint(0, pair.hf_config.vocab_size, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    hf_logits = pair.hf_model(input_ids=tokens).logits
    logits = _logits(pair, tokens)
    torch.testing.assert_close(logits, hf_logits)

    # Gradients: HF's indexer weights get none from the loss, and neither do the port's.
    hf_logits.square().mean().backward()
    logits.square().mean().backward()
    hf_indexer = pair.hf_model.model.layers[0].self_attn.indexer
    assert all(p.grad is None for p in hf_indexer.parameters())
    assert all(p.grad is None for p in pair.archon.model.layers["0"].attention.indexer.parameters())
    assert pair.archon.model.layers["0"].attention.wq_a.weight.grad is not None

    # Without the indexer's mask (every causal key kept) the port no longer matches HF.
    kernel = sys.modules[type(pair.archon.model.layers["0"].attention.packed_attn).__module__]

    def causal_only(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()

    monkeypatch.setattr(kernel, "sparse_index_mask", causal_only)
    with torch.no_grad():
        unmasked = _logits(pair, tokens)
    assert (unmasked - hf_logits.detach()).abs().max() > 1e-3


class _Unrectified:
    """``torch.nn.functional`` with an identity ``relu``: an indexer summing raw scores, as
    transformers 5.3.0's GlmMoeDsaIndexer does."""

    def __getattr__(self, name: str) -> object:
        return (lambda x: x) if name == "relu" else getattr(torch.nn.functional, name)


def test_a_stage_failure_against_another_indexer_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage tests skip, with the analysis's reason, a failure against an installed HF model
    the generated package was not made from; a generated package's own failure stands."""
    modeling = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
    from skill.harness.models import installed_model_refused

    case = ModelCase(model_type="glm_moe_dsa")
    assert installed_model_refused(case) is None  # the pinned model: a failure would be the port's
    monkeypatch.setattr(modeling, "F", _Unrectified())
    refused = installed_model_refused(case)
    assert refused is not None and "indexer (GlmMoeDsaIndexer)" in refused


def test_a_hand_port_failure_is_never_excused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand-edited package's analysis refuses what its recorded session wrote by hand: not a
    reason to skip its failure. (No committed package is hand-edited since ctrl's edits became
    feature modules; xglm, its analysis made to refuse a feature, is marked hand-edited here.)"""
    from skill.harness import models
    from skill.porting import hand_written

    refusing = analyze_hf_model(AnalyzeInput(source="xglm")).model_copy(
        update={"unsupported": ["unsupported: a feature its session wrote by hand"]}
    )
    monkeypatch.setattr("skill.analysis.analyze.analyze_hf_model", lambda request: refusing)
    case = ModelCase(model_type="xglm")
    assert models.installed_model_refused(case) is not None  # generated: the refusal excuses it
    monkeypatch.setattr(hand_written, "is_hand_edited", lambda text: True)
    assert models.installed_model_refused(case) is None
