"""The sparse-attention indexer inside multi-head latent attention (DeepSeek Sparse Attention),
measured on the real HF module.

An indexer is a child of the attention that holds four parts, told apart by their shapes:
a projection of MLA's query latent to ``n_heads * head_dim`` (``wq_b``), a projection of the
hidden state to one ``head_dim`` key (``wk``), a LayerNorm of that width (``k_norm``) and a
projection of the hidden state to one weight per head (``weights_proj``). Its config fields are
the fields whose values are those widths and, for the number of keys kept, the field that, moved,
moves the width of the module's selection. Then the module itself is run on random inputs
against the closed form

    score[s, t] = sum_h weights_proj(x_s)_h / sqrt(n_heads) * relu(q_{s,h} . k_t / sqrt(head_dim))

(the first ``qk_rope_head_dim`` of queries and key rotated, as two halves or as interleaved
pairs) and the top-k keys per query of that closed form, causal, must be the module's. Whether
HF's forward lets gradients reach the indexer's weights is measured on the tiny model.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from skill.features import SparseIndexer
from skill.tiny_model import build_tiny_model

logger = logging.getLogger(__name__)

PROBE_LENGTH = 12
PROBE_TOPK = 3


def _parts(child: nn.Module, hidden: int, q_lora: int) -> tuple[list[dict[str, str]], int, int] | None:
    """The indexer's four parts by shape (every assignment the shapes allow: at some sizes the
    key and the per-head weights are equally wide, and the closed form tells them apart), with
    its head count and head width; None when the child is no indexer."""
    linears = {n: m for n, m in child.named_children() if isinstance(m, nn.Linear)}
    norms = {n: m for n, m in child.named_children() if isinstance(m, nn.LayerNorm)}
    if len(linears) != 3 or len(norms) != 1 or sum(1 for _ in child.parameters()) != 5:
        return None
    ((norm_name, norm),) = norms.items()
    if norm.weight is None or norm.bias is None or len(norm.normalized_shape) != 1:
        return None
    if any(m.bias is not None for m in linears.values()):
        return None
    head_dim = int(norm.normalized_shape[0])
    queries = [n for n, m in linears.items() if m.in_features == q_lora and m.out_features % head_dim == 0]
    if len(queries) != 1:
        return None
    n_heads = linears[queries[0]].out_features // head_dim
    rest = [n for n in linears if n != queries[0]]
    candidates = [
        {"wq_b": queries[0], "wk": key, "k_norm": norm_name, "weights_proj": weights}
        for key, weights in (rest, rest[::-1])
        if linears[key].in_features == hidden
        and linears[key].out_features == head_dim
        and linears[weights].in_features == hidden
        and linears[weights].out_features == n_heads
    ]
    return (candidates, n_heads, head_dim) if candidates else None


def _int_fields(config: Any, value: int, exclude: set[str]) -> list[str]:
    return sorted(
        n
        for n, v in config.to_dict().items()
        if isinstance(v, int) and not isinstance(v, bool) and v == value and n not in exclude
    )


def _indexer_of(model: nn.Module, attention_name: str, child: str) -> nn.Module | None:
    for name, module in model.named_modules():
        if name == f"{attention_name}.{child}":
            return module
    return None


def _field_sets(ctx: Any, attention_name: str, child: str, field: str, width: Any) -> bool:
    """Whether moving ``field`` in the tiny config moves what ``width(indexer)`` reads."""
    indexer = _indexer_of(ctx.model, attention_name, child)
    if indexer is None:
        return False
    before = width(indexer)
    config = copy.deepcopy(ctx.tiny)
    setattr(config, field, int(getattr(config, field)) * 2)
    try:
        moved = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
    except Exception as exc:  # a config validator refusing the value: not this field
        logger.debug("moving %s failed: %s", field, exc)
        return False
    other = _indexer_of(moved, attention_name, child)
    return other is not None and width(other) == 2 * before


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE of ``x [.., d]`` by HF's ``cat(freqs, freqs)`` tables, as two halves or as pairs."""
    if interleaved:
        c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def closed_form_scores(
    indexer: nn.Module,
    parts: dict[str, str],
    x: torch.Tensor,
    q_latent: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    interleaved: bool,
) -> torch.Tensor:
    """``[S, S]`` index scores of one sequence (no mask) by the closed form above."""
    wq_b, wk, k_norm, weights_proj = (getattr(indexer, parts[r]) for r in ("wq_b", "wk", "k_norm", "weights_proj"))
    head_dim = k_norm.normalized_shape[0]
    seq = x.shape[0]
    q = wq_b(q_latent).view(seq, -1, head_dim)
    k = k_norm(wk(x))
    c, s = cos[:, None, :], sin[:, None, :]
    q = torch.cat([_rotate(q[..., :rope_dim], c, s, interleaved), q[..., rope_dim:]], dim=-1)
    k = torch.cat([_rotate(k[..., :rope_dim], cos, sin, interleaved), k[..., rope_dim:]], dim=-1)
    n_heads = q.shape[1]
    scores = torch.relu(torch.einsum("shd,td->sht", q, k) * head_dim**-0.5)
    weights = weights_proj(x) * n_heads**-0.5
    return torch.einsum("sh,sht->st", weights, scores)


def _selection(scores: torch.Tensor, topk: int) -> list[set[int]]:
    """Each query's top-k causal keys (all of them when it has at most k)."""
    chosen = []
    for s in range(scores.shape[0]):
        row = scores[s, : s + 1]
        chosen.append(set(row.topk(min(topk, s + 1)).indices.tolist()))
    return chosen


def _rotation(ctx: Any, indexer: nn.Module, parts: dict[str, str], attribute: str, topk: int) -> bool | None:
    """The rotation (interleaved or not) under which the closed form picks the module's keys; None
    when neither does or the module cannot be run so."""
    rope_dim = int(ctx.tiny.qk_rope_head_dim)
    q_lora = int(ctx.tiny.q_lora_rank)
    hidden = int(ctx.tiny.hidden_size)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE_LENGTH, hidden, generator=gen)
    q_latent = torch.randn(1, PROBE_LENGTH, q_lora, generator=gen)
    positions = torch.arange(PROBE_LENGTH, dtype=torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    freqs = torch.outer(positions, inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    causal = torch.full((PROBE_LENGTH, PROBE_LENGTH), torch.finfo(torch.float32).min).triu(1)[None]
    saved = getattr(indexer, attribute)
    try:
        setattr(indexer, attribute, topk)
        with torch.no_grad():
            out = indexer(x, q_latent, (cos[None], sin[None]), causal, positions.long()[None])
    except Exception as exc:  # another forward signature: not measured
        logger.debug("running the indexer failed: %s", exc)
        return None
    finally:
        setattr(indexer, attribute, saved)
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[-1] != topk:
        return None
    got = [{int(i) for i in row if int(i) <= s} for s, row in enumerate(out[0])]
    for interleaved in (False, True):
        with torch.no_grad():
            scores = closed_form_scores(indexer, parts, x[0], q_latent[0], cos, sin, rope_dim, interleaved)
        if _selection(scores, topk) == got:
            return interleaved
    return None


def _gradient_reaches(ctx: Any, attention_name: str, child: str) -> bool:
    """Whether a backward pass of the tiny model's loss leaves a gradient on the indexer."""
    model = ctx.model
    indexer = _indexer_of(model, attention_name, child)
    if indexer is None:
        return False
    tokens = torch.arange(PROBE_LENGTH)[None] % int(ctx.tiny.vocab_size)
    model.zero_grad(set_to_none=True)
    try:
        model(input_ids=tokens).logits.float().square().mean().backward()
        return any(p.grad is not None and bool(p.grad.abs().max() > 0) for p in indexer.parameters())
    finally:
        model.zero_grad(set_to_none=True)


def sparse_indexer(ctx: Any, attention: nn.Module, name: str, child: nn.Module) -> SparseIndexer | None:
    """The attention's child ``name`` measured as a sparse-attention indexer, or None."""
    hidden, q_lora, rope = (getattr(ctx.tiny, f, None) for f in ("hidden_size", "q_lora_rank", "qk_rope_head_dim"))
    if not (isinstance(hidden, int) and isinstance(q_lora, int) and isinstance(rope, int)):
        return None
    found = _parts(child, hidden, q_lora)
    if found is None:
        return None
    candidates, n_heads, head_dim = found
    parts = candidates[0]
    attention_name = next((n for n, m in ctx.model.named_modules() if m is attention), None)
    if attention_name is None or head_dim <= rope:
        return None
    taken = {"hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank"}
    taken |= {"qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "head_dim", "qk_head_dim"}

    def one(value: int, width: Any) -> str | None:
        fields = [f for f in _int_fields(ctx.tiny, value, taken) if _field_sets(ctx, attention_name, name, f, width)]
        return fields[0] if len(fields) == 1 else None

    heads_field = one(n_heads, lambda m: getattr(m, parts["weights_proj"]).out_features)
    dim_field = one(head_dim, lambda m: getattr(m, parts["k_norm"]).normalized_shape[0])
    attribute = _topk_attribute(child)
    if attribute is None:
        return None
    topk_field = one(int(getattr(child, attribute)), lambda m: getattr(m, attribute))
    if heads_field is None or dim_field is None or topk_field is None:
        return None
    measured = [(p, _rotation(ctx, child, p, attribute, PROBE_TOPK)) for p in candidates]
    matched = [(p, rotation) for p, rotation in measured if rotation is not None]
    if len(matched) != 1:
        return None
    parts, interleaved = matched[0]
    ctx.evidence.append(
        f"{name}: sparse-attention indexer, {n_heads} heads of {head_dim} ({heads_field}, {dim_field}), "
        f"{topk_field} keys per query, {'interleaved' if interleaved else 'half-split'} RoPE (closed form "
        "matched on the module)"
    )
    return SparseIndexer(
        module=name,
        topk_field=topk_field,
        n_heads_field=heads_field,
        head_dim_field=dim_field,
        rotary_interleaved=interleaved,
        parts=parts,
        grad=_gradient_reaches(ctx, attention_name, name),
    )


def _topk_attribute(child: nn.Module) -> str | None:
    """The module's one integer attribute naming a selection size (``index_topk``)."""
    held = [n for n, v in vars(child).items() if isinstance(v, int) and not isinstance(v, bool) and "top" in n]
    return held[0] if len(held) == 1 else None


__all__ = ["closed_form_scores", "sparse_indexer"]
