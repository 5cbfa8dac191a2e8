"""Where ``save_pretrained`` writes each in-memory parameter, found by value, not by name.

transformers renames and fuses some families' tensors on their way to disk (its checkpoint
conversion mappings): SarvamMoE keeps ``self_attn.q_proj``/``k_proj``/``v_proj`` in memory
and writes one ``attention.query_key_value``; EXAONE writes ``model.layers.{i}.self_attn``
as ``transformer.h.{i}.attn.attention``. A copy of the tiny model whose every parameter
holds its own random values is saved once, and each parameter is looked up in what was
written: a whole saved tensor (renamed), or a block of rows of one (stacked along dim 0
with others).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers.utils import logging as hf_logging

from skill.scratch import scratch_dir

_SEED = 20_250_917


@dataclass(frozen=True)
class SavedLocation:
    """The saved tensor holding a parameter, and the rows (dim 0) it fills there."""

    key: str
    start: int
    rows: int
    whole: bool  # the saved tensor is the parameter, nothing else

    @property
    def module(self) -> str:
        """The saved key's module path (the key less its last segment)."""
        return self.key.rsplit(".", 1)[0]


def saved_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for ``model``: its checkpoint tensors by saved key."""
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with scratch_dir("names") as folder:
            model.save_pretrained(folder, safe_serialization=True)  # type: ignore[operator]
            state: dict[str, torch.Tensor] = {}
            for file in sorted(Path(folder).glob("*.safetensors")):
                state.update(load_file(str(file)))
            return state
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def saved_locations(model: nn.Module) -> dict[str, SavedLocation]:
    """In-memory parameter name -> where ``save_pretrained`` writes it.

    Parameters written in pieces (fused experts split into per-expert keys), transposed,
    or not at all (a tied head) are left out. The model itself is not changed.
    """
    tagged = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(_SEED)
    with torch.no_grad():
        for param in tagged.parameters():
            if param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype))
    state = saved_state(tagged)
    # The first value of every saved row -> (key, row): random values make it a fingerprint.
    rows_by_value: dict[float, list[tuple[str, int]]] = {}
    for key, tensor in state.items():
        if tensor.dim() == 0 or not tensor.numel() or not tensor.is_floating_point():
            continue
        for row, value in enumerate(tensor.reshape(tensor.shape[0], -1)[:, 0].tolist()):
            rows_by_value.setdefault(value, []).append((key, row))
    found: dict[str, SavedLocation] = {}
    for name, param in tagged.named_parameters():
        if param.dim() == 0 or not param.numel() or not param.is_floating_point():
            continue
        first = float(param.detach().reshape(param.shape[0], -1)[0, 0])
        for key, start in rows_by_value.get(first, []):
            saved = state[key]
            rows = param.shape[0]
            if tuple(saved.shape[1:]) != tuple(param.shape[1:]) or start + rows > saved.shape[0]:
                continue
            if torch.equal(saved[start : start + rows], param.detach().to(saved.dtype)):
                found[name] = SavedLocation(key, start, rows, whole=start == 0 and rows == saved.shape[0])
                break
    return found
