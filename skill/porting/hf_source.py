"""The HF side of a port: a tiny config of the family and the keys its checkpoint holds."""

from __future__ import annotations

import functools
import re
from typing import Any

from transformers import PretrainedConfig

from skill.tiny_model import saved_checkpoint_keys, tiny_config

# ".12." inside a key: a layer or expert index.
_INDEX = re.compile(r"\.(\d+)(?=\.)")


def load_config(source: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of ``source``: a model_type transformers knows, a folder with
    ``config.json`` (its own code with ``trust_remote_code``), or a ``config.json`` file.
    The analyser's resolver, so every step reads a source the same way."""
    from skill.analysis.inputs import resolve_source

    return resolve_source(source, trust_remote_code).config


@functools.lru_cache(maxsize=16)
def _tiny_keys(source: str, trust_remote_code: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    config = tiny_config(load_config(source, trust_remote_code))
    return tuple(saved_checkpoint_keys(config, trust_remote_code=trust_remote_code).items())


def checkpoint_keys(source: str, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """Keys and shapes ``save_pretrained`` writes for a tiny instance of ``source``'s family."""
    return dict(_tiny_keys(source, trust_remote_code))


def generalise_key(key: str) -> str:
    """``model.layers.3.mlp.experts.7.w1.weight`` -> ``model.layers.{}.mlp.experts.{}.w1.weight``;
    every index, whatever the stack is called (``transformer.h.3.``), as the adapters' own
    ``_abstract`` reads keys."""
    return _INDEX.sub(".{}", key)


def generalised_keys(keys: Any) -> list[str]:
    return sorted({generalise_key(k) for k in keys})
