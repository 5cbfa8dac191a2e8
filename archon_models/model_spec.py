"""The registry from HF ``model_type`` to the Archon implementation that handles it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from archon_models.base import BaseArchonModel, BaseModelArgs, BaseStateDictAdapter


class ParallelizeFn(Protocol):
    """Applies TP, EP, CP, activation checkpointing, compile and FSDP, in that order,
    according to the ``*_enabled`` flags of ``parallel_dims``."""

    def __call__(
        self,
        model: nn.Module,
        parallel_dims: Any,
        param_dtype: torch.dtype = torch.bfloat16,
        reduce_dtype: torch.dtype = torch.float32,
        loss_parallel: bool = True,
        cpu_offload: bool = False,
        reshard_after_forward_policy: str = "default",
        ac_config: Any | None = None,
        enable_compile: bool = True,
    ) -> nn.Module: ...


class PipeliningFn(Protocol):
    """Splits a model into pipeline stages.

    Returns ``(schedule_stages, model_parts, has_first_stage, has_last_stage)``.
    """

    def __call__(
        self,
        model: nn.Module,
        device: torch.device,
        parallel_dims: Any,
        archon_config: Any,
        parallelize_fn: ParallelizeFn,
    ) -> tuple[list[Any], list[nn.Module], bool, bool]: ...


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_class: type[BaseArchonModel]
    model_args_class: type[BaseModelArgs]
    state_dict_adapter_class: type[BaseStateDictAdapter]
    parallelize_fn: ParallelizeFn
    supported_model_types: frozenset[str]
    pipelining_fn: PipeliningFn | None = None


_MODEL_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    """Register ``spec`` under each of its model types; a type registered twice is an error."""
    taken = sorted(t for t in spec.supported_model_types if t in _MODEL_SPECS)
    if taken:
        owners = ", ".join(f"{t!r} by {_MODEL_SPECS[t].name}" for t in taken)
        raise ValueError(
            f"Cannot register {spec.name}: model_type already registered ({owners}). "
            "Each model_type belongs to exactly one ModelSpec."
        )
    for model_type in spec.supported_model_types:
        _MODEL_SPECS[model_type] = spec


def get_model_spec(model_type: str) -> ModelSpec:
    try:
        return _MODEL_SPECS[model_type]
    except KeyError:
        available = ", ".join(sorted(_MODEL_SPECS)) or "none"
        raise KeyError(
            f"No Archon ModelSpec registered for model_type {model_type!r}. Available: {available}."
        ) from None


def is_supported_model(model_type: str) -> bool:
    return model_type in _MODEL_SPECS


def get_supported_model_types() -> frozenset[str]:
    return frozenset(_MODEL_SPECS)
