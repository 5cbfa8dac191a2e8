"""Checkpoint keys transformers' load drops: a family's ``_keys_to_ignore_on_load_unexpected``.

``from_pretrained`` leaves out of its unexpected keys every checkpoint key (read after the
family's checkpoint conversion mapping renamed it) that one of the model's ignore patterns
finds, and loads nothing for it. A.X-K1's released checkpoints store ``post_mlp_layernorm`` on
every layer, though only the MoE layers have one (``mlp.post_mlp_layernorm`` after the rename):
the dense layers' copies are dropped. A port that maps the key must drop the same copies.

Measured on the tiny model: a parameter the patterns find that some layers hold and others lack
is such a key; its checkpoint name is where ``save_pretrained`` writes it (renamed back). A
pattern for keys no layer of the model holds (multi-token-prediction layers, legacy buffers)
names no parameter and is left to the adapter's own rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

_INDEX = re.compile(r"\.(\d+)(?=\.)")


def _layer_template(name: str) -> str:
    return _INDEX.sub(".{}", name)


def ignore_patterns(model: nn.Module) -> list[str]:
    """The model's ignore patterns for unexpected checkpoint keys (the instance's, which holds its
    submodels' too), in a stable order."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return sorted(str(pattern) for pattern in patterns)


def ignored_checkpoint_keys(model: nn.Module, saved_key: Callable[[str], Any]) -> list[str]:
    """Checkpoint key templates (``{}`` for each index) HF's load drops where the model lacks
    them: of the parameters the model's ignore patterns find, those some layers hold and others
    lack, named as ``saved_key(parameter)`` (a :class:`~skill.analysis.saved_names.SavedLocation`
    or ``None``) says ``save_pretrained`` writes them."""
    patterns = [re.compile(pattern) for pattern in ignore_patterns(model)]
    if not patterns:
        return []
    names = [name for name, _ in model.named_parameters()]
    layers_holding: dict[str, set[str]] = {}  # parameter template -> the layers that hold it
    for name in names:
        index = _INDEX.search(name)
        if index is not None:
            layers_holding.setdefault(_layer_template(name), set()).add(index.group(1))
    layers = set().union(*layers_holding.values()) if layers_holding else set()
    found: set[str] = set()
    for name in names:
        if not any(pattern.search(name) for pattern in patterns):
            continue
        template = _layer_template(name)
        if template not in layers_holding or layers_holding[template] == layers:
            continue  # every layer holds it: nothing for the load to drop
        location = saved_key(name)
        if location is not None and location.whole:
            found.add(_layer_template(location.key))
    return sorted(found)
