"""Norm classes a family may need instead of the references' ``RMSNorm``."""

from __future__ import annotations

import torch
from torch import nn


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, all in fp32 and cast back at the end (as HF does).

    The weight is stored as an offset from one, so it starts at zero.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
