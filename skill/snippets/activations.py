"""Activations a family's feed-forward needs beyond ``torch.nn.functional``'s, copied in
by the ``activation`` edit (the table is ``skill/activations.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU approximated by a sigmoid: ``x * sigmoid(1.702 * x)`` (HF's QuickGELUActivation)."""
    return x * torch.sigmoid(1.702 * x)


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010): ``alpha_p * x**2 + beta * x`` for ``x > 0``, else
    ``alpha_n * (expm1(min(x, eps)) - x) + beta * x``, as HF's XIELUActivation computes it.

    The checkpoint stores the learned ``alpha_p``/``alpha_n`` before their softplus (one
    value each) and the constants ``beta`` and ``eps`` as buffers, all under ``act_fn``.
    """

    beta: torch.Tensor
    eps: torch.Tensor

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        self.init_values = (alpha_p_init, alpha_n_init, beta, eps)
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.register_buffer("beta", torch.tensor(beta))
        self.register_buffer("eps", torch.tensor(eps))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(
            x > 0,
            alpha_p * x * x + self.beta * x,
            (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x,
        )

    def reset_parameters(self) -> None:
        """The initial values; the alphas stored as softplus inverses (HF's parametrisation)."""
        alpha_p, alpha_n, beta, eps = self.init_values
        with torch.no_grad():
            # Computed on the CPU: this also runs under ``torch.device("meta")``.
            start = torch.tensor([alpha_p, alpha_n - beta], dtype=torch.float64, device="cpu")
            inverse = torch.log(torch.expm1(start)).tolist()
            self.alpha_p.fill_(inverse[0])
            self.alpha_n.fill_(inverse[1])
            self.beta.fill_(beta)
            self.eps.fill_(eps)
