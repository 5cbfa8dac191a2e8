"""Feed-forward classes a family may need instead of the references' SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PlainFeedForward(nn.Module):
    """Two-layer MLP ``w2(act(w1(x)))``; ``w1`` is HF's up projection (c_fc, fc1), ``w2``
    its down projection (c_proj, fc2)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std)
        for linear in (self.w1, self.w2):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
