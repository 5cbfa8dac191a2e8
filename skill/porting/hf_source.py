"""The HF side of a port: a tiny config of the family and the keys its checkpoint holds."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from skill.tiny_model import saved_checkpoint_keys, tiny_config

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def load_config(source: str) -> PretrainedConfig:
    """The config of ``source``: a model_type transformers knows, a folder with
    ``config.json``, or a ``config.json`` file."""
    path = Path(source)
    if path.is_dir() or path.suffix == ".json":
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found; pass a model_type, a folder with config.json or the file itself.")
        data = json.loads(file.read_text())
        model_type = data.pop("model_type", None)
        if not model_type:
            raise ValueError(f"{file} has no 'model_type'; it is not a transformers config.")
        return AutoConfig.for_model(model_type, **data)
    try:
        return AutoConfig.for_model(source)
    except ValueError as e:
        raise ValueError(
            f"{source!r} is neither a model_type the installed transformers knows nor a path to a config; "
            "pass e.g. 'mistral' or a checkpoint folder."
        ) from e


@functools.lru_cache(maxsize=16)
def _tiny_keys(source: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(saved_checkpoint_keys(tiny_config(load_config(source))).items())


def checkpoint_keys(source: str) -> dict[str, tuple[int, ...]]:
    """Keys and shapes ``save_pretrained`` writes for a tiny instance of ``source``'s family."""
    return dict(_tiny_keys(source))


def generalise_key(key: str) -> str:
    """``model.layers.3.mlp.experts.7.w1.weight`` -> ``model.layers.{}.mlp.experts.{}.w1.weight``."""
    key = _LAYER_INDEX.sub(".layers.{}.", key)
    return _EXPERT_INDEX.sub(".experts.{}.", key)


def generalised_keys(keys: Any) -> list[str]:
    return sorted({generalise_key(k) for k in keys})
