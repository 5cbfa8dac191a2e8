"""Conversions between Archon's routed-expert weights and checkpoints that fuse them.

Archon holds a layer's experts as ``w1`` (gate) and ``w3`` (up) ``[E, hidden, dim]`` and
``w2`` (down) ``[E, dim, hidden]``: slice ``e`` is expert ``e``'s ``nn.Linear`` weight
(out, in). Some checkpoints hold all experts of a projection in one 3D tensor, gate and
up stacked along the output axis: first all gate rows, then all up rows (``chunk(2)``),
or gate and up alternating (gate at even rows). The adapter of such a family inserts the
pair of functions for its order, renamed ``split_gate_up`` / ``merge_gate_up``.
"""

from __future__ import annotations

import torch


def split_concatenated_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2 * hidden, dim]`` -> gate, up ``[E, hidden, dim]``: the gate rows come first."""
    gate, up = fused.chunk(2, dim=1)
    return gate, up


def merge_concatenated_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up ``[E, hidden, dim]`` -> ``[E, 2 * hidden, dim]``, the gate rows first."""
    return torch.cat([gate, up], dim=1)


def split_interleaved_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2 * hidden, dim]`` -> gate, up ``[E, hidden, dim]``: gate at even rows, up at odd."""
    return fused[:, 0::2], fused[:, 1::2]


def merge_interleaved_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up ``[E, hidden, dim]`` -> ``[E, 2 * hidden, dim]`` with gate and up rows alternating."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)
