"""Norm classes a family may need instead of the references' ``RMSNorm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class WeightlessRMSNorm(nn.Module):
    """RMSNorm without a learned weight: ``x * rsqrt(mean(x**2) + eps)``, in fp32 and cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        return (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def reset_parameters(self) -> None:
        """Nothing to reset: the norm has no parameters."""


class OffsetLayerNorm(nn.Module):
    """LayerNorm scaled by ``1 + weight`` (plus ``bias``), in the input's dtype (as HF's
    LayerNorm1P does).

    The weight is stored as an offset from one, so it starts at zero.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight + 1.0, self.bias, self.eps)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)
