"""Per-block ``torch.compile``.

Blocks are compiled one by one rather than the whole model: every block has the
same structure, so the compiled code is reused, and the embedding and output
layers (with their TP/FSDP hooks) stay outside the graphs. Apply after TP and
activation checkpointing, before FSDP.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["Compilable", "apply_compile"]


class Compilable(Protocol):
    """A model whose transformer blocks are in ``layers``."""

    layers: nn.ModuleDict


def apply_compile(model: Compilable) -> None:
    """Replace each block of ``model.layers`` by its compiled version, in place.

    ``fullgraph=False`` lets packed sequences with data-dependent document counts
    break the graph instead of failing.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(
            f"apply_compile needs model.layers to be an nn.ModuleDict; {type(model).__name__} has "
            f"{type(layers).__name__}."
        )
    for name, block in list(layers.items()):
        layers[name] = torch.compile(block, backend="inductor", fullgraph=False)
    logger.info("Compiled %d transformer blocks with torch.compile", len(layers))
