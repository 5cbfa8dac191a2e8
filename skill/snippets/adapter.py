"""Helpers a family's ``state_dict_adapter.py`` needs for a fused checkpoint layout,
copied in by ``edit_adapter_map``."""

from __future__ import annotations

import torch


def _ungroup_qkv(value: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A fused q/k/v tensor whose rows are grouped by KV head (its query heads, its key,
    its value; GPT-NeoX, Bloom, Falcon) -> all query rows, then the key rows, then the
    value rows, as ``wq``, ``wk`` and ``wv`` stack. Weights and biases alike."""
    per_kv = n_heads // n_kv_heads
    rest = value.shape[1:]
    grouped = value.reshape(n_kv_heads, per_kv + 2, head_dim, *rest)
    q = grouped[:, :per_kv].reshape(n_heads * head_dim, *rest)
    k = grouped[:, per_kv].reshape(n_kv_heads * head_dim, *rest)
    v = grouped[:, per_kv + 1].reshape(n_kv_heads * head_dim, *rest)
    return torch.cat([q, k, v], dim=0)


def _group_qkv(value: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`_ungroup_qkv`: stacked q, k, v rows -> grouped by KV head."""
    per_kv = n_heads // n_kv_heads
    rest = value.shape[1:]
    q, k, v = torch.split(value, [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=0)
    q = q.reshape(n_kv_heads, per_kv, head_dim, *rest)
    k = k.reshape(n_kv_heads, 1, head_dim, *rest)
    v = v.reshape(n_kv_heads, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _unblock_qkv(
    value: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int, blocks: int, order: str
) -> torch.Tensor:
    """A fused q/k/v tensor of ``blocks`` equal blocks, each holding its share of the query,
    key and value heads in ``order`` (CodeGen: 4 blocks of query, value, key) -> all query
    rows, then the key rows, then the value rows, as ``wq``, ``wk`` and ``wv`` stack."""
    rest = value.shape[1:]
    shares = {
        "q": n_heads // blocks * head_dim,
        "k": n_kv_heads // blocks * head_dim,
        "v": n_kv_heads // blocks * head_dim,
    }
    parts = torch.split(value.reshape(blocks, -1, *rest), [shares[role] for role in order], dim=1)
    by_role = {role: part.reshape(-1, *rest) for role, part in zip(order, parts, strict=True)}
    return torch.cat([by_role["q"], by_role["k"], by_role["v"]], dim=0)


def _block_qkv(
    value: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int, blocks: int, order: str
) -> torch.Tensor:
    """The inverse of :func:`_unblock_qkv`: stacked q, k, v rows -> ``blocks`` blocks of ``order``."""
    rest = value.shape[1:]
    q, k, v = torch.split(value, [n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=0)
    by_role = {"q": q, "k": k, "v": v}
    parts = [by_role[role].reshape(blocks, -1, *rest) for role in order]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _drop_unit_axes(value: torch.Tensor, axes: int) -> torch.Tensor:
    """A tensor the checkpoint stores with ``axes`` leading axes of size 1 (ERNIE-4.5's
    ``[1, E]`` score-correction bias) -> the shape Archon holds (``[E]``)."""
    return value.reshape(value.shape[axes:]) if axes else value


def _add_unit_axes(value: torch.Tensor, axes: int) -> torch.Tensor:
    """The inverse of :func:`_drop_unit_axes`: Archon's ``[E]`` -> the checkpoint's ``[1, E]``."""
    return value.reshape((1,) * axes + tuple(value.shape)) if axes else value


def _pair_halves(value: torch.Tensor, block: int) -> torch.Tensor:
    """Rows in blocks of ``block`` (a head, or the query heads of one KV head), the first half
    of the blocks then the second (differential attention's head pairs ``i`` and ``i + n/2``)
    -> each pair's two blocks side by side. Weights and biases alike."""
    rest = value.shape[1:]
    return value.reshape(2, -1, block, *rest).transpose(0, 1).reshape(value.shape)


def _unpair_halves(value: torch.Tensor, block: int) -> torch.Tensor:
    """The inverse of :func:`_pair_halves`: pairs side by side -> the first halves, then the second."""
    rest = value.shape[1:]
    return value.reshape(-1, 2, block, *rest).transpose(0, 1).reshape(value.shape)


def _unstack_rows(value: torch.Tensor, groups: int, blocks: list[int], order: list[int]) -> torch.Tensor:
    """Rows stored as ``groups`` groups that each hold their share of several blocks in turn
    (Qwen3-Next's ``in_proj_qkvz``: per key head, its q, k, v and z rows) -> each block whole,
    the blocks in ``order`` (positions in ``blocks``), as the Archon projections stack them."""
    rest = value.shape[1:]
    pieces = torch.split(value.reshape(groups, sum(blocks), *rest), blocks, dim=1)
    return torch.cat([pieces[i].reshape(-1, *rest) for i in order], dim=0)


def _stack_rows(value: torch.Tensor, groups: int, blocks: list[int], order: list[int]) -> torch.Tensor:
    """The inverse of :func:`_unstack_rows`: whole blocks in ``order`` -> ``groups`` groups."""
    rest = value.shape[1:]
    whole = dict(zip(order, torch.split(value, [groups * blocks[i] for i in order], dim=0), strict=True))
    pieces = [whole[i].reshape(groups, blocks[i], *rest) for i in range(len(blocks))]
    return torch.cat(pieces, dim=1).reshape(-1, *rest)
