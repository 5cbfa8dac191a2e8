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


# The QK norms' own classes, where they compute another kind than the block norms (or span
# the full projection width, which tensor parallelism shards). Each is written in elementwise
# ops and means, in fp32 and cast back, so that on a DTensor sharded over the normalised
# features the means reduce across the ranks; torch's fused layer_norm and rms_norm would
# gather the width (or refuse the sharding) instead. The RMS kinds the block norms also use
# (OffsetRMSNorm, WeightlessRMSNorm) are written so already.


class QKRMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled by ``weight`` after casting back (as HF does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * out.type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def centred(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` (in fp32) less its mean, over its standard deviation: LayerNorm's normalisation.

    ``var_mean`` hands a sharded feature dimension's statistics back replicated, so the
    result keeps ``x``'s sharding (``x - x.mean(-1)`` would turn it into a full-width partial)."""
    x = x.float()
    var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + eps)


class QKLayerNorm(nn.Module):
    """LayerNorm with a weight and a bias, in fp32 and cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (centred(x, self.eps) * self.weight.float() + self.bias.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


class QKLayerNormNoBias(nn.Module):
    """LayerNorm with a weight and no bias, in fp32 and cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (centred(x, self.eps) * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class QKWeightlessLayerNorm(nn.Module):
    """LayerNorm with neither weight nor bias, in fp32 and cast back."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return centred(x, self.eps).type_as(x)

    def reset_parameters(self) -> None:
        """Nothing to reset: the norm has no parameters."""


class QKOffsetLayerNorm(nn.Module):
    """LayerNorm scaled by ``1 + weight`` plus ``bias``, in fp32 and cast back; the weight is
    stored as an offset from one, so it starts at zero."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (centred(x, self.eps) * (1.0 + self.weight.float()) + self.bias.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)
