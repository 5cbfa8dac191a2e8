"""Fixed (not learned) absolute-position tables the ``sinusoidal_positions`` edit copies
into a package: the table is a buffer computed from its shape, never a checkpoint tensor.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_positions(n_positions: int, dim: int, zero_row: int | None = None) -> torch.Tensor:
    """``[n_positions, dim]`` sinusoidal table as tensor2tensor (and fairseq) build it: row
    ``p`` is ``sin(p * f)`` over the first half of the features and ``cos(p * f)`` over the
    second, ``f_i = 10000 ** (-i / (dim // 2 - 1))``; an odd ``dim`` ends in a zero column,
    and row ``zero_row`` (the checkpoint's padding index), when given, is all zeros."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    frequencies = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(n_positions, dtype=torch.int64).float().unsqueeze(1) * frequencies.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2 == 1:
        table = torch.cat([table, torch.zeros(n_positions, 1)], dim=1)
    if zero_row is not None and 0 <= zero_row < n_positions:
        table[zero_row] = 0
    return table


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position rows, looked up like an embedding: position ``p`` (counted
    within its packed document) reads row ``p + offset`` of :func:`sinusoidal_positions`.

    The table is a non-persistent buffer (no checkpoint key): ``build`` recomputes it after
    the model is materialised from the meta device. As a module, tensor parallelism hands
    each rank the sequence shard of its rows, as it does for a learned table.
    """

    def __init__(self, n_positions: int, dim: int, offset: int = 0, zero_row: int | None = None):
        super().__init__()
        self.n_positions = n_positions
        self.dim = dim
        self.offset = offset
        self.zero_row = zero_row
        self.table: torch.Tensor
        self.register_buffer("table", self.build(), persistent=False)

    def build(self) -> torch.Tensor:
        return sinusoidal_positions(self.n_positions + self.offset, self.dim, self.zero_row)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` ``[1, T]`` -> ``[1, T, dim]`` rows of the table."""
        return self.table[positions + self.offset]
