"""The gated delta rule and the causal convolution before it, over packed documents.

A Gated DeltaNet layer keeps, per value head, a ``[k_head_dim, v_head_dim]`` state ``S``.
Each token ``t`` (query ``q``, key ``k`` (both L2-normalised), value ``v``, decay
``g <= 0`` in log space, write strength ``beta`` in ``(0, 1)``) decays the state and
replaces what the state recalls for ``k`` by ``v``, as far as ``beta`` says::

    S = exp(g) * S
    S = S + k (beta * (v - S^T k))^T
    o = S^T q / sqrt(k_head_dim)

Every document starts from a zero state, and the convolution never reaches across a
document boundary: packing must not change a document's outputs.

Two implementations, one maths:

- on CUDA, when installed, the fused kernels AReaL's hybrid model uses:
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (flash-linear-attention; one
  launch over all documents through ``cu_seqlens``) and ``causal_conv1d.causal_conv1d_fn``
  (documents through ``seq_idx``);
- everywhere else, :func:`chunked_gated_delta_rule` below, in PyTorch, document by
  document: the chunked (WY) form of the recurrence, exact up to rounding, in fp32 whatever
  the activations' dtype, as HF's own fallback and fla's kernel compute it.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

try:  # flash-linear-attention (CUDA/Triton only)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:  # not installed, or no Triton on this machine
    fla_chunk_gated_delta_rule = None

try:  # Dao-AILab's causal-conv1d (CUDA only)
    from causal_conv1d import causal_conv1d_fn
except ImportError:
    causal_conv1d_fn = None

__all__ = [
    "CHUNK_SIZE",
    "causal_conv_silu",
    "chunked_gated_delta_rule",
    "document_ids",
    "gated_delta_rule",
    "l2_normalize",
]

# Tokens per chunk of the chunked form (fla's and HF's choice).
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dimension (fla's and HF's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int32: which document each packed position belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    docs = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(docs, lengths, output_size=total)


def _boundaries(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return [(start, end) for start, end in itertools.pairwise(bounds) if end > start]


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``silu`` of a causal depthwise convolution of ``x`` ``[bs, channels, T]``, per document.

    ``weight`` is ``[channels, kernel]`` (``nn.Conv1d``'s weight without its middle dim). Each
    document sees zeros before its first token, as if it were alone.
    """
    if x.is_cuda and causal_conv1d_fn is not None:
        seq_idx = document_ids(cu_seqlens, x.shape[-1]).unsqueeze(0).expand(x.shape[0], -1).contiguous()
        return causal_conv1d_fn(x, weight, bias=None, activation="silu", seq_idx=seq_idx)
    kernel = weight.shape[-1]
    pieces = []
    for start, end in _boundaries(cu_seqlens):
        doc = x[..., start:end].to(weight.dtype)
        out = F.conv1d(doc, weight.unsqueeze(1), padding=kernel - 1, groups=weight.shape[0])
        pieces.append(F.silu(out[..., : end - start]).to(x.dtype))
    return torch.cat(pieces, dim=-1)


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk_size: int = CHUNK_SIZE
) -> torch.Tensor:
    """The gated delta rule over one document from a zero state, ``chunk_size`` tokens at a time.

    ``q``/``k`` ``[bs, T, H, dk]`` (L2-normalised, ``q`` already scaled), ``v`` ``[bs, T, H, dv]``,
    ``g``/``beta`` ``[bs, T, H]``; returns ``[bs, T, H, dv]`` in fp32 (fp64 for fp64 inputs).

    Inside a chunk with cumulative log decay ``c`` (``c_i = g_1 + ... + g_i``) and incoming
    state ``S0``, the writes ``d_i = beta_i (v_i - S_{i-1}^T k_i)`` solve the unit lower
    triangular system ``(I + A) d = beta v - beta exp(c) K S0`` with
    ``A_ij = beta_i exp(c_i - c_j) k_i . k_j`` for ``j < i``; then
    ``o_i = exp(c_i) S0^T q_i + sum_{j <= i} exp(c_i - c_j) (q_i . k_j) d_j`` and the state
    leaving the chunk is ``exp(c_C) S0 + sum_j exp(c_C - c_j) k_j d_j^T``. Only the loop over
    chunks is sequential.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    # [bs, H, T, ...] in the working precision.
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    g, beta = (t.transpose(1, 2).to(dtype) for t in (g, beta))
    bs, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n_chunks = (length + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(bs, heads, n_chunks, chunk_size, *t.shape[3:])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    c = g.cumsum(dim=-1)  # [bs, H, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(c_i - c_j) for j <= i, 0 above the diagonal (masked before exp: no overflow).
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # Only the strictly lower triangle is read: the solves take a unit diagonal.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    writes = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * c.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()[..., None, None]

    state = q.new_zeros(bs, heads, dk, dv)
    out = []
    for i in range(n_chunks):
        d = writes[:, :, i] - reads[:, :, i] @ state
        out.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ d)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ d
    o = torch.stack(out, dim=2).reshape(bs, heads, n_chunks * chunk_size, dv)[:, :, :length]
    return o.transpose(1, 2)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule over packed documents, with L2-normalised ``q``/``k``.

    ``q``/``k`` ``[bs, T, H, dk]`` (already repeated to the value heads), ``v`` ``[bs, T, H, dv]``,
    ``g`` (log decay) and ``beta`` ``[bs, T, H]``; returns ``[bs, T, H, dv]`` in ``v``'s dtype.
    """
    if q.is_cuda and fla_chunk_gated_delta_rule is not None:
        out, _ = fla_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.to(torch.int64)
        )
        return out
    # In fp32 whatever the activations' dtype, as fla's kernel and HF's fallback compute it.
    out_dtype = v.dtype
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k = l2_normalize(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    pieces = [
        chunked_gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end])
        for start, end in _boundaries(cu_seqlens)
    ]
    return torch.cat(pieces, dim=1).to(out_dtype)
