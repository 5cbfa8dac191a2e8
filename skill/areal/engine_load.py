"""A package built and loaded by AReaL's own ``ArchonEngine`` code (AReaL 1.0.4).

``ArchonEngine.initialize`` creates the model on the meta device (``_create_model_structure``,
then ``.to(dtype)``), lays it out over the devices (``_apply_parallelism``: the spec's
``parallelize_fn``, which ties the LM head to the embedding) and materialises it
(``_materialize_and_load_weights``: ``to_empty``; then ``load_model_from_hf`` from a checkpoint,
or ``init_weights`` from scratch; then ``init_buffers``). :func:`build_as_engine` runs those
methods of AReaL's class, not a copy of their order, on the smallest stand-in for the engine
that they read (:class:`EngineStandIn`): AReaL's own ``TrainEngineConfig``, the spec, the HF
config, a one-process ``ArchonParallelDims`` and the spec's state-dict adapter. Only the two
lines of ``_create_device_model`` that build on the meta device are repeated here; the rest of
that method (device selection, the tokenizer) has nothing to do with the model.

``load_model_from_hf`` asks for the rank and ends on a barrier, so the build runs inside a gloo
group of one process, made here when the caller has none and destroyed afterwards (a process
that forks workers later must not hand them an initialised default group).

Runs in a Python that imports ``areal``; the package must already be placed under
``areal/experimental/models/archon/``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class EngineStandIn:
    """What ``ArchonEngine._create_model_structure``, ``_apply_parallelism`` and
    ``_materialize_and_load_weights`` (with ``load_model_from_hf``) read of the engine."""

    config: Any  # AReaL's TrainEngineConfig
    spec: Any
    model_config: Any  # the HF config
    parallel_dims: Any  # AReaL's ArchonParallelDims
    param_dtype: torch.dtype
    state_dict_adapter: Any
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("archon-port.engine-stand-in"))
    enable_tree_training: bool = False
    cpu_group: Any = None  # the default group: the one-process group of build_as_engine
    model: Any = None
    model_parts: list[Any] = field(default_factory=list)

    def get_device_stats(self) -> Any:
        from areal.experimental.engine.archon_engine import ArchonEngine

        return ArchonEngine.get_device_stats(self)


@contextmanager
def one_process_group() -> Iterator[None]:
    """A gloo default group of this process alone, unless one exists already."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def opted_into_balancing(spec: Any, load_balance_coeff: float) -> Any:
    """``spec`` whose args opt into balancing the score-correction bias, as a user who builds
    the args with ``from_hf_config(..., load_balance_coeff=...)`` does (AReaL's engine passes
    no such keyword)."""
    args = types.SimpleNamespace(
        from_hf_config=functools.partial(spec.model_args_class.from_hf_config, load_balance_coeff=load_balance_coeff)
    )
    return dataclasses.replace(spec, model_args_class=args)


def build_as_engine(
    spec: Any,
    hf_config: Any,
    checkpoint: str | Path | None,
    attn_type: str = "varlen",
    is_critic: bool = False,
    dtype: torch.dtype = torch.float32,
) -> EngineStandIn:
    """The model of ``spec`` for ``hf_config`` as ``ArchonEngine.initialize`` makes it on CPU, in
    one process: loaded from the HF ``checkpoint`` (``None``: initialised from scratch).
    The engine stand-in holds it (``model``) and the adapter that loaded it."""
    from areal.api.cli_args import ArchonEngineConfig, TrainEngineConfig
    from areal.experimental.engine.archon_engine import ArchonEngine
    from areal.experimental.models.archon.parallel_dims import ArchonParallelDims

    dtype_name = str(dtype).removeprefix("torch.")
    config = TrainEngineConfig(
        experiment_name="archon-port",
        trial_name="areal-tier",
        path="" if checkpoint is None else str(checkpoint),
        init_from_scratch=checkpoint is None,
        is_critic=is_critic,
        dtype=dtype_name,
        archon=ArchonEngineConfig(attn_type=attn_type),
    )
    engine = EngineStandIn(
        config=config,
        spec=spec,
        model_config=hf_config,
        parallel_dims=ArchonParallelDims(dp_shard=1, world_size=1, device_type="cpu"),
        param_dtype=dtype,
        state_dict_adapter=spec.state_dict_adapter_class(hf_config, hf_assets_path=config.path or None),
    )
    with one_process_group():
        # _create_device_model: the structure on the meta device, in the training dtype.
        with torch.device("meta"):
            model = ArchonEngine._create_model_structure(engine)
        engine.model = model.to(dtype)
        # No activation checkpointing and no compile: neither changes a parameter or a buffer.
        ArchonEngine._apply_parallelism(engine, ac_config=None, enable_compile=False)
        ArchonEngine._materialize_and_load_weights(engine)
    return engine
