"""Activations a family's feed-forward needs beyond ``torch.nn.functional``'s, copied in
by the ``activation`` edit (the table is ``skill/activations.py``)."""

from __future__ import annotations

import torch


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU approximated by a sigmoid: ``x * sigmoid(1.702 * x)`` (HF's QuickGELUActivation)."""
    return x * torch.sigmoid(1.702 * x)
