"""Key helpers shared by the adapter and completeness stages."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from archon_models.base import BaseStateDictAdapter

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")

# Wrapper prefixes activation checkpointing and per-block torch.compile insert after
# ``layers.<i>``; convert_single_to_hf must see through them (weight sync of a wrapped model).
WRAPPER_PREFIXES = ("._checkpoint_wrapped_module", "._orig_mod", "._orig_mod._checkpoint_wrapped_module")


def abstract_key(key: str) -> str:
    """``model.layers.3.mlp.experts.7.w`` -> ``model.layers.{}.mlp.experts.{}.w``."""
    return _INDEX.sub(".{}", key)


def key_indices(key: str) -> list[str]:
    return _INDEX.findall(key)


def mapped_archon_key(adapter: BaseStateDictAdapter, hf_key: str) -> str | None:
    """The Archon key ``from_hf_map`` names for ``hf_key`` (indices filled in order), if any."""
    target = adapter.from_hf_map.get(abstract_key(hf_key))
    if target is None:
        return None
    for index in key_indices(hf_key)[: target.count("{}")]:
        target = target.replace("{}", index, 1)
    return target


def is_explicit_drop(adapter: BaseStateDictAdapter, hf_key: str) -> bool:
    """True when ``from_hf_map`` maps the key (or its pattern) to ``None`` on purpose."""
    for candidate in (hf_key, abstract_key(hf_key)):
        if candidate in adapter.from_hf_map and adapter.from_hf_map[candidate] is None:
            return True
    return False


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameter names that are the same tensor as an earlier one (tied embeddings)."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first_name.setdefault(id(param), name)
        if owner != name:
            aliases[name] = owner
    return aliases


def wrapped_names(name: str) -> list[str]:
    """``name`` as it appears under each wrapper (empty for keys outside ``layers.<i>``)."""
    match = re.match(r"^(layers\.\d+)\.(.+)$", name)
    if match is None:
        return []
    return [f"{match.group(1)}{prefix}.{match.group(2)}" for prefix in WRAPPER_PREFIXES]


def distinct_state_dict(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The model's state dict with every parameter refilled by seeded noise.

    Freshly initialised norms are all ones, so a roundtrip that swaps two norms would
    still compare equal; distinct values make every misplaced tensor visible.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stacking_dim(adapter: Any, hf_key: str) -> int:
    """The dim a fused key's parts stack along on disk: 0, or 1 for a key the adapter
    declares stored ``(in, out)`` (``transposed_hf_keys``: GPT-2's Conv1D c_attn)."""
    transposed = getattr(adapter, "transposed_hf_keys", None) or ()
    template = re.sub(r"\.(\d+)(?=\.)", ".{}", hf_key)
    return 1 if template in transposed else 0


def join_single(adapter: Any, hf_key: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The checkpoint tensor ``hf_key`` from what ``convert_single_to_hf`` gave for it, one
    piece per Archon parameter in state-dict order: the adapter's own ``join_single_to_hf``
    where it fuses otherwise than along one dim (experts' gate/up), else the slices
    concatenated along :func:`stacking_dim`."""
    join = getattr(adapter, "join_single_to_hf", None)
    if join is not None:
        return join(hf_key, pieces)
    if len(pieces) == 1:
        return pieces[0]
    dim = stacking_dim(adapter, hf_key)
    # An adapter that re-stacks its fused keys itself (rows grouped per KV head) is given
    # the pieces in order, as its to_hf gives them.
    restack = getattr(adapter, "_concat_fused", None)
    if restack is not None and dim == 0:
        return restack(hf_key, dict(enumerate(pieces)))
    return torch.cat(pieces, dim=dim)
