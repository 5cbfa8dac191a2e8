"""Chunked local attention (Llama 4's ``attention_chunk_size``): the analysis measures it on the
attention weights, and the port's kernel sees each chunk of a document as a document of its own.
The fuzz ports (tests/skill/test_fuzz_families.py: seed 7 on every layer, and the layers of one
kind) prove the whole path against HF."""

from __future__ import annotations

import random

import torch

from skill.analysis.chunked import chunk_mask
from skill.features import ChunkedAttention
from skill.snippets.attention import chunk_documents


def _visible(bounds: torch.Tensor, total: int) -> torch.Tensor:
    """``[total, total]``: causal attention inside the documents ``bounds`` delimits (a token past
    the last bound is a document of its own, as the kernels treat padding)."""
    document = torch.searchsorted(bounds, torch.arange(total), right=True)
    index = torch.arange(total)
    return (document[:, None] == document[None, :]) & (index[None, :] <= index[:, None])


def test_causal_attention_over_the_chunks_is_chunked_attention_over_the_documents():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(0, 20) for _ in range(rng.randint(1, 5))]
        chunk = rng.randint(1, 9)
        bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
        total = int(bounds[-1]) + rng.randint(0, 3)  # padding after the last document
        chunks, longest = chunk_documents(bounds, max(lengths), chunk)
        assert chunks.dtype == bounds.dtype and longest == min(max(lengths), chunk)
        want = _visible(bounds, total)
        start = torch.repeat_interleave(bounds[:-1].long(), torch.diff(bounds).long())
        inside = torch.arange(int(bounds[-1])) - start  # each token's position in its document
        same_chunk = inside[:, None] // chunk == inside[None, :] // chunk
        want[: len(inside), : len(inside)] &= same_chunk
        assert torch.equal(_visible(chunks, total), want), (lengths, chunk)
        assert max(torch.diff(chunks).tolist(), default=0) <= longest


def test_the_chunk_mask_is_causal_inside_chunks():
    mask = chunk_mask(7, 3)
    assert mask[5].tolist() == [False, False, False, True, True, True, False]
    assert torch.equal(chunk_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())


def test_llama4_chunks_the_layers_layer_types_marks_chunked():
    from skill.porting.plan import report_for

    report = report_for("llama4_text")
    assert report.checklist.attention.chunked == ChunkedAttention(
        size_field="attention_chunk_size", chunked_kind="chunked_attention"
    )
    assert not [name for name in report.unsupported if "chunk" in name]
    # A family without chunks has no such fact, and its report reads as before.
    llama = report_for("llama")
    assert llama.checklist.attention.chunked is None
    assert "chunked" not in llama.checklist.attention.model_dump(exclude_none=False)
