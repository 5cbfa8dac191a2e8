"""The packed-document attention backends against a naive per-document reference."""

from __future__ import annotations

import math

import pytest
import torch

from archon_models.attention import (
    SDPAWrapper,
    VarlenAttentionWrapper,
    create_block_causal_mask_2d,
    varlen_attn,
)

BACKENDS = [SDPAWrapper, VarlenAttentionWrapper]
DOC_LENS = [5, 1, 9, 3]
N_HEADS, HEAD_DIM = 4, 8


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _naive(q, k, v, lengths, scale):
    """Per-document causal softmax attention written out by hand, ``[1, H, T, D]``."""
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    out, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        scores = q[:, :, sl] @ k[:, :, sl].transpose(-1, -2) * scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out.append(scores.softmax(-1) @ v[:, :, sl])
        start += n
    return torch.cat(out, dim=2)


def _qkv(n_kv_heads: int, total: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N_HEADS, total, HEAD_DIM, generator=g, requires_grad=True)
    k = torch.randn(1, n_kv_heads, total, HEAD_DIM, generator=g, requires_grad=True)
    v = torch.randn(1, n_kv_heads, total, HEAD_DIM, generator=g, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_kv_heads", [N_HEADS, 2])
def test_backend_matches_naive_reference_forward_and_backward(backend, n_kv_heads):
    total = sum(DOC_LENS)
    scale = 0.3  # not 1/sqrt(D): proves the explicit scale reaches the kernel
    q, k, v = _qkv(n_kv_heads, total)
    out = backend()(q, k, v, scale=scale, cu_seqlens=_cu(DOC_LENS), max_seqlen=max(DOC_LENS))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _naive(q64, k64, v64, DOC_LENS, scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())

    torch.testing.assert_close(out, ref.float())
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want.float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_do_not_see_each_other(backend):
    total = sum(DOC_LENS)
    q, k, v = (t.detach() for t in _qkv(2, total))
    cu = _cu(DOC_LENS)
    base = backend()(q, k, v, cu_seqlens=cu, max_seqlen=max(DOC_LENS))
    # Rewrite the keys and values of document 2 only.
    start, end = int(cu[2]), int(cu[3])
    k2, v2 = k.clone(), v.clone()
    k2[:, :, start:end] = torch.randn_like(k2[:, :, start:end])
    v2[:, :, start:end] = torch.randn_like(v2[:, :, start:end])
    changed = backend()(q, k2, v2, cu_seqlens=cu, max_seqlen=max(DOC_LENS))
    outside = torch.ones(total, dtype=torch.bool)
    outside[start:end] = False
    torch.testing.assert_close(changed[:, :, outside], base[:, :, outside], rtol=0, atol=0)
    assert not torch.allclose(changed[:, :, start:end], base[:, :, start:end])


def test_block_causal_mask_layout():
    mask = create_block_causal_mask_2d(_cu([2, 3]), 6, "cpu", torch.float32)
    allowed = (mask == 0).int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],  # a padding token past cu_seqlens[-1] sees only itself
        ]
    )
    assert torch.equal(allowed, expected)
    assert mask.dtype == torch.float32 and torch.isinf(mask[0, 1])


def test_varlen_attn_token_major_api_with_kv_prefix_is_bottom_right_causal():
    """3-D API; a document whose keys are longer than its queries sees its whole prefix."""
    g = torch.Generator().manual_seed(1)
    q_lens, k_lens = [2, 3], [4, 3]
    query = torch.randn(sum(q_lens), N_HEADS, HEAD_DIM, generator=g)
    key = torch.randn(sum(k_lens), 2, HEAD_DIM, generator=g)
    value = torch.randn(sum(k_lens), 2, HEAD_DIM, generator=g)
    out = varlen_attn(query, key, value, _cu(q_lens), _cu(k_lens), 3, 4, is_causal=True)
    assert out.shape == query.shape

    scale = 1 / math.sqrt(HEAD_DIM)
    kk, vv = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
    q0, q1 = 0, 0
    for lq, lk in zip(q_lens, k_lens, strict=True):
        for i in range(lq):
            visible = lk - lq + i + 1
            scores = torch.einsum("hd,khd->hk", query[q0 + i], kk[q1 : q1 + visible]) * scale
            want = torch.einsum("hk,khd->hd", scores.softmax(-1), vv[q1 : q1 + visible])
            torch.testing.assert_close(out[q0 + i], want)
        q0, q1 = q0 + lq, q1 + lk


def test_bad_inputs_name_the_problem():
    q = torch.zeros(2, N_HEADS, 4, HEAD_DIM)
    with pytest.raises(ValueError, match="batch size 1"):
        VarlenAttentionWrapper()(q, q, q, cu_seqlens=_cu([4]), max_seqlen=4)
    with pytest.raises(ValueError, match="only 4 tokens"):
        VarlenAttentionWrapper()(q[:1], q[:1], q[:1], cu_seqlens=_cu([5]), max_seqlen=5)
    t = torch.zeros(4, 3, HEAD_DIM)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attn(torch.zeros(4, 4, HEAD_DIM), t, t, _cu([4]), _cu([4]), 4, 4)
