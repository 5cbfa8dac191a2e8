"""Embeddings narrower than the blocks (OPT's ``word_embed_proj_dim``): the
``embedding_projection`` edit, its TP plan entries, and how both compose with the other
embedding-stage edits on either reference.

The detector is in ``test_analyze_measurements.py``; parity (with and without the
projections: the tiny default is 32 wide beside hidden 64, the override case 64), TP/FSDP
gradients and the checkpoint roundtrip in ``tests/archon/test_opt.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from skill.codemod.cst import Document
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import plan_for
from skill.porting.write_parallelize import _plan_embedding_norm, _plan_embedding_projection, _plan_position_table

REPO = Path(__file__).resolve().parents[2]
MODELS = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}
PARALLELIZE = {name: (REPO / f"archon_models/{name}/infra/parallelize.py").read_text() for name in ("qwen2", "qwen3")}
MODEL_CLASS = {"qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}


def _plan(**update: object):
    return plan_for("llama").model_copy(
        update={
            "embedding_projection_field": "word_embed_proj_dim",
            "positions": "learned",
            "position_offset": 2,
            "lm_head_bias": True,
            "embedding_norm_module": "model.embed_norm",
            **update,
        }
    )


@pytest.mark.parametrize("reference", sorted(MODELS))
def test_projection_composes_with_positions_norm_and_head_bias_in_any_order(reference: str) -> None:
    """One module whatever order the edits are named in: the embeddings and both heads at the
    config's width, project_in before the positions are added (HF: project_in(embeds) +
    pos_embeds), project_out after the final norm, the head's bias kept."""
    ctx = EditContext(camel="Toy", model_class=MODEL_CLASS[reference], profile=_plan())
    names = ["embedding_projection", "learned_positions", "embedding_norm", "lm_head_bias", "remove_rope"]
    orders = [tuple(names), tuple(reversed(names)), tuple(names[1:] + names[:1]), tuple(names[3:] + names[:3])]
    results = {order: apply_model_edits(MODELS[reference], ctx, list(order)) for order in orders}
    canonical = results[tuple(names)]
    for order, text in results.items():
        assert text == canonical, order
    compile(canonical, "<edited>", "exec")
    assert (
        "nn.Embedding(model_args.vocab_size, model_args.word_embed_proj_dim, padding_idx=model_args.pad_id)"
        in canonical
    )
    assert "self.output = nn.Linear(model_args.word_embed_proj_dim, model_args.vocab_size, bias=True)" in canonical
    assert "self.score = nn.Linear(model_args.word_embed_proj_dim, model_args.num_labels, bias=False)" in canonical
    assert "projected = model_args.word_embed_proj_dim != model_args.dim" in canonical
    forward = canonical.split(f"class {MODEL_CLASS[reference]}", 1)[1].split("def forward(", 1)[1]
    assert (
        forward.index("h = self.project_in(h)")
        < forward.index("self.pos_embeddings(positions + 2)")
        < forward.index("h = self.embedding_norm(h)")
        < forward.index("h = self.norm(h)")
        < forward.index("h = self.project_out(h)")
    )
    assert canonical.count("nn.init.trunc_normal_(projection.weight") == 1
    # Applied again, nothing changes.
    assert apply_model_edits(canonical, ctx, names) == canonical


@pytest.mark.parametrize("reference", sorted(PARALLELIZE))
def test_tp_plan_projection_entries_compose_with_the_other_embedding_entries(reference: str) -> None:
    """project_in after the token embedding (sequence shard, local output), project_out after
    the final norm, each only where the model has it, in any order with the position table
    and embedding norm entries (each once)."""
    steps = {"projection": _plan_embedding_projection, "positions": _plan_position_table, "norm": _plan_embedding_norm}
    texts = []
    for order in itertools.permutations(steps):
        doc = Document(PARALLELIZE[reference])
        for name in order:
            doc = steps[name](doc)
        text = doc.code
        texts.append(text)
        compile(text, "<plan>", "exec")
        for entry in ('root_plan["project_in"]', 'root_plan["project_out"]', 'root_plan["pos_embeddings"]'):
            assert text.count(entry) == 1, (order, entry)
        assert "if model.project_in is not None:" in text and "if model.project_out is not None:" in text
        assert 'root_plan["project_in"] = SequenceParallel(use_local_output=True)' in text
        assert text.index('root_plan["norm"]') < text.index('root_plan["project_out"]')
        assert _plan_embedding_projection(Document(text)).code == text
    # The position table's entry reads as before any other embedding entry was planned.
    alone = _plan_position_table(Document(PARALLELIZE[reference])).code
    assert 'root_plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))' in alone
