"""The qwen3_5 reference's gated delta rule and convolution against their definitions.

Stage 4 compares the whole model with HF on a few tiny documents; these tests pin the pieces
on their own: the chunked form against the token-by-token recurrence it rewrites (in
float64, across several chunks and a ragged last one), and the packed entry points against
each document run alone (no state or convolution tap crosses a boundary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from archon_models.qwen3_5.model.gated_delta import (
    causal_conv_silu,
    chunked_gated_delta_rule,
    document_ids,
    gated_delta_rule,
    l2_normalize,
)


def _recurrence(q, k, v, g, beta):
    """The gated delta rule one token at a time: decay, write the correction, read."""
    bs, length, heads, dk = k.shape
    state = torch.zeros(bs, heads, dk, v.shape[-1], dtype=v.dtype)
    out = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        write = beta[:, t, :, None] * (v[:, t] - recalled)
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, dim=1)


def _inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (1, length, heads)
    q = l2_normalize(torch.randn(*shape, dk, generator=gen, dtype=torch.float64)) * dk**-0.5
    k = l2_normalize(torch.randn(*shape, dk, generator=gen, dtype=torch.float64))
    v = torch.randn(*shape, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(*shape, generator=gen, dtype=torch.float64)
    beta = torch.rand(*shape, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def test_chunked_form_is_the_recurrence():
    q, k, v, g, beta = _inputs(length=150)
    expected = _recurrence(q, k, v, g, beta)
    for chunk_size in (16, 64, 256):  # several chunks and a ragged last one; one padded chunk
        got = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_packed_documents_start_from_a_zero_state():
    lengths = [70, 9, 4]
    cu_seqlens = torch.tensor([0, 70, 79, 83], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 83, 2, 8, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 83, 2, generator=gen), torch.rand(1, 83, 2, generator=gen)
    packed = gated_delta_rule(q, k, v, g, beta, cu_seqlens)
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        whole = torch.tensor([0, length], dtype=torch.int32)
        alone = gated_delta_rule(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], whole)
        torch.testing.assert_close(packed[:, piece], alone, rtol=0, atol=0)
        start += length
    # The first document alone is the recurrence on its normalised queries and keys.
    first = slice(0, 70)
    qn = l2_normalize(q[:, first].double()) * 8**-0.5
    kn = l2_normalize(k[:, first].double())
    expected = _recurrence(qn, kn, v[:, first].double(), g[:, first].double(), beta[:, first].double())
    torch.testing.assert_close(packed[:, first].double(), expected, rtol=0, atol=1e-5)


def test_convolution_never_reaches_across_documents():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 6, 20, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    cu_seqlens = torch.tensor([0, 3, 20], dtype=torch.int32)
    packed = causal_conv_silu(x, weight, cu_seqlens)
    for start, end in ((0, 3), (3, 20)):
        doc = x[..., start:end]
        alone = F.silu(F.conv1d(F.pad(doc, (3, 0)), weight.unsqueeze(1), groups=6))
        torch.testing.assert_close(packed[..., start:end], alone)
    assert document_ids(cu_seqlens, 20).tolist() == [0] * 3 + [1] * 17
