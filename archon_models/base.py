"""Contracts every Archon model package implements: args, model, state-dict adapter."""

from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class BaseModelArgs(ABC):
    """Fields shared by every model's args dataclass.

    ``attn_type`` picks the attention backend: ``"varlen"`` (flash varlen on CUDA,
    a per-document SDPA loop elsewhere) or ``"sdpa"`` (one SDPA call with a
    block-diagonal causal mask).
    """

    attn_type: str = "varlen"

    @staticmethod
    def _get_rope_theta(hf_config: Any, default: float = 10000.0) -> float:
        """``rope_theta`` from a transformers v4 config (attribute) or v5 (``rope_parameters``)."""
        rope_parameters = getattr(hf_config, "rope_parameters", None)
        if isinstance(rope_parameters, dict):
            if "rope_theta" in rope_parameters:
                return float(rope_parameters["rope_theta"])
            # Per-layer-type parameters ({"full_attention": {...}, ...}): take the first.
            for value in rope_parameters.values():
                if isinstance(value, dict) and "rope_theta" in value:
                    return float(value["rope_theta"])
        theta = getattr(hf_config, "rope_theta", None)
        if theta is not None:
            return float(theta)
        return float(default)

    @classmethod
    @abstractmethod
    def from_hf_config(cls, hf_config: Any, is_critic: bool = False, **kwargs: Any) -> BaseModelArgs:
        """Build the args from a HuggingFace ``PretrainedConfig``."""


class BaseArchonModel(nn.Module, ABC):
    """A decoder-only model over packed sequences.

    ``tokens`` and ``positions`` have shape ``[1, T]``; ``cu_seqlens`` (int32,
    ``[num_docs + 1]``) holds the cumulative document boundaries and ``max_seqlen``
    the longest document. No document attends to another.
    """

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        tree_attn_meta: Any | None = None,
    ) -> torch.Tensor: ...

    @abstractmethod
    def init_weights(self) -> None: ...

    @abstractmethod
    def init_buffers(self, buffer_device: torch.device | str) -> None: ...


SAFETENSORS_INDEX = "model.safetensors.index.json"


class BaseStateDictAdapter(ABC):
    """Converts between Archon state dicts and HuggingFace checkpoint state dicts.

    Subclasses fill ``from_hf_map`` (HF key, ``{}`` for the layer index, to Archon
    key, or ``None`` for a key to drop); ``to_hf_map`` is its inverse.
    """

    from_hf_map: ClassVar[dict[str, str | None]] = {}

    def __init__(self, model_config: Any, hf_assets_path: str | os.PathLike | None = None):
        self.model_config = model_config
        self.hf_assets_path = None if hf_assets_path is None else str(hf_assets_path)
        self.from_hf_map = dict(type(self).from_hf_map)
        self.to_hf_map = {v: k for k, v in self.from_hf_map.items() if v is not None}
        self.fqn_to_index_mapping: dict[str, int] | None = None
        if self.hf_assets_path is not None:
            self.fqn_to_index_mapping = self._load_safetensors_index(self.hf_assets_path)

    @staticmethod
    def _load_safetensors_index(hf_assets_path: str) -> dict[str, int] | None:
        """Map each HF key to its shard number from ``model.safetensors.index.json``.

        Shard files are named ``model-00001-of-00004.safetensors``; the number is
        the 1-based shard index. Returns ``None`` when there is no index file.
        """
        index_file = os.path.join(hf_assets_path, SAFETENSORS_INDEX)
        if not os.path.isfile(index_file):
            return None
        with open(index_file) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(
                    f"{index_file} is not a safetensors index (expected a JSON object with 'weight_map'): {e}"
                ) from e
        mapping: dict[str, int] = {}
        for key, filename in weight_map.items():
            stem = os.path.basename(filename).removesuffix(".safetensors")
            parts = stem.split("-")
            if len(parts) >= 3 and parts[-2] == "of" and parts[-3].isdigit():
                mapping[key] = int(parts[-3])
            else:
                mapping[key] = 1
        return mapping

    def _maybe_composite_hf_key(self, hf_key: str) -> str:
        """Hook for composite checkpoints (a text model inside a multimodal one)."""
        return hf_key

    def get_hf_storage_reader(self, path: str):
        """A DCP storage reader that reads HF safetensors checkpoints directly."""
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return HuggingFaceStorageReader(path)

    @abstractmethod
    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]: ...

    @abstractmethod
    def to_hf(self, archon_state_dict: dict[str, Any]) -> dict[str, Any]: ...

    @abstractmethod
    def convert_single_to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]: ...
