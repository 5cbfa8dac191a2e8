"""Pipeline parallelism over ``torch.distributed.pipelining``, as torchtitan does it.

The model is cut by module name: the first stage keeps ``tok_embeddings`` and its
share of ``layers``, middle stages only layers, the last stage its layers plus
``norm`` and ``output`` (``score`` for a critic). Every stage is a full copy of the
model with the modules it does not own set to ``None`` (and the layers it does not
own deleted from the ``ModuleDict``), so the model's forward must skip ``None``
modules: a stage without ``tok_embeddings`` receives hidden states in ``tokens``.

A model with another top-level module (an embedding norm, a position table) needs it
named on a stage: its spec's ``pipelining_fn`` adds it to the lists
:func:`generate_llm_fqn_per_model_part` returns. :func:`pipeline_module_split` refuses
a module no stage lists, where AReaL's sets it to ``None`` on every stage.

Packed inputs travel as keyword arguments to every stage: ``positions`` is split
into micro-batches with the tokens (one row each), ``cu_seqlens`` and
``max_seqlen`` are shared by all micro-batches.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
    get_schedule_class,
)

if TYPE_CHECKING:
    from archon_models.parallel_dims import ArchonParallelDims

logger = logging.getLogger(__name__)

__all__ = [
    "ArchonPipelineConfig",
    "build_pipeline_schedule",
    "generate_llm_fqn_per_model_part",
    "pipeline_llm",
    "pipeline_module_split",
]

_V_STYLE_SCHEDULES = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


@dataclass
class ArchonPipelineConfig:
    """The pipeline settings ``pipeline_llm`` reads (the ``pp_*`` fields of AReaL's ArchonEngineConfig).

    Attributes:
        pp_schedule: a ``torch.distributed.pipelining`` schedule name: ``"1F1B"``,
            ``"GPipe"``, ``"Interleaved1F1B"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``.
        pp_layers_per_stage: layers per virtual stage; ``None`` gives one stage per
            rank for single-stage schedules and two for multi-stage ones.
        pp_first_stage_less_layers: layers' worth of work the embedding costs.
        pp_last_stage_less_layers: layers' worth of work the norm and head cost.
    """

    pp_schedule: str = "1F1B"
    pp_layers_per_stage: int | None = None
    pp_first_stage_less_layers: int = 1
    pp_last_stage_less_layers: int = 1


def generate_llm_fqn_per_model_part(
    num_stages: int,
    num_layers: int,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
    is_critic: bool = False,
) -> list[list[str]]:
    """Module names of each stage, balancing layers with the embedding and head counted as layers.

    >>> generate_llm_fqn_per_model_part(2, 4)
    [['tok_embeddings', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'output']]
    """
    head = "score" if is_critic else "output"
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}.")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
    if num_stages == 1:
        return [["tok_embeddings", *(f"layers.{i}" for i in range(num_layers)), "norm", head]]

    effective = num_layers + first_stage_less_layers + last_stage_less_layers
    if num_stages > effective:
        raise ValueError(
            f"num_stages ({num_stages}) cannot exceed the effective layer count {effective} = "
            f"{num_layers} layers + {first_stage_less_layers} (embedding) + "
            f"{last_stage_less_layers} (norm and head). Use fewer stages."
        )
    per_stage, extra = divmod(effective, num_stages)
    if first_stage_less_layers > per_stage or last_stage_less_layers > per_stage:
        raise ValueError(
            f"first_stage_less_layers ({first_stage_less_layers}) and last_stage_less_layers "
            f"({last_stage_less_layers}) must not exceed the {per_stage} layers per stage."
        )

    stages: list[list[str]] = []
    next_layer = 0
    for stage in range(num_stages):
        budget = per_stage + (1 if stage < extra else 0)
        names: list[str] = []
        if stage == 0:
            names.append("tok_embeddings")
            budget -= first_stage_less_layers
        elif stage == num_stages - 1:
            budget -= last_stage_less_layers
        for _ in range(budget):
            if next_layer < num_layers:
                names.append(f"layers.{next_layer}")
                next_layer += 1
        if stage == num_stages - 1:
            names.extend(["norm", head])
        stages.append(names)
    return stages


def _stage_indices(pp_rank: int, pp_degree: int, num_stages: int, pp_schedule: str) -> tuple[int, ...]:
    """Stages of this rank: loop style (0, pp, 2pp, ...) or V style (rank, last - rank)."""
    if num_stages % pp_degree != 0:
        raise ValueError(f"num_stages ({num_stages}) must be divisible by the pp degree ({pp_degree}).")
    stages_per_rank = num_stages // pp_degree
    if get_schedule_class(pp_schedule) in _V_STYLE_SCHEDULES:
        if stages_per_rank != 2:
            raise ValueError(f"{pp_schedule} needs exactly 2 stages per rank, got {stages_per_rank}.")
        return (pp_rank, num_stages - 1 - pp_rank)
    return tuple(pp_rank + s * pp_degree for s in range(stages_per_rank))


def _on_no_stage(model: nn.Module, module_names_per_stage: list[list[str]]) -> list[str]:
    """Top-level modules (and entries of top-level containers) that no stage lists."""
    listed = {name for names in module_names_per_stage for name in names}
    missing: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            keys = child.keys() if isinstance(child, nn.ModuleDict) else (str(i) for i in range(len(child)))
            missing += [f"{name}.{key}" for key in keys if f"{name}.{key}" not in listed]
        elif name not in listed:
            missing.append(name)
    return missing


def _keep_only(model: nn.Module, module_names: list[str]) -> None:
    """Drop, in place, every top-level module and layer not in ``module_names``."""
    keep = set(module_names)
    for name, child in list(model.named_children()):
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            kept = {n.split(".", 1)[1] for n in keep if n.startswith(f"{name}.")}
            if isinstance(child, nn.ModuleDict):
                for key in list(child.keys()):
                    if key not in kept:
                        del child[key]
            else:
                setattr(model, name, nn.ModuleList([m for i, m in enumerate(child) if str(i) in kept]))
        elif name not in keep:
            setattr(model, name, None)


def pipeline_module_split(
    whole_model: nn.Module,
    pp_mesh: DeviceMesh,
    pp_schedule: str,
    device: torch.device,
    module_names_per_stage: list[list[str]],
) -> tuple[list[PipelineStage], list[nn.Module]]:
    """This rank's stages: deep copies of ``whole_model`` cut down to each stage's modules.

    Build ``whole_model`` on the meta device for real models (the copies are cheap
    and each rank materialises only its part); a model with real weights works too
    and keeps them, which is what tests comparing against one process want.
    """
    missing = _on_no_stage(whole_model, module_names_per_stage)
    if missing:
        # AReaL's split sets such a module to None on every stage, and the first forward that
        # needs it fails with "'NoneType' object is not callable" on one rank while its peers
        # wait in a collective: refused here, on every rank, before any stage is built.
        raise ValueError(
            f"{type(whole_model).__name__} has modules no pipeline stage lists: {', '.join(missing)}. "
            "Every stage would set them to None. Name each on the stage that runs it (a module used "
            "before the first layer on the first stage, one used after the last layer on the last): "
            "give the ModelSpec a pipelining_fn that adds them to generate_llm_fqn_per_model_part's lists."
        )
    pp_rank = pp_mesh.get_local_rank()
    num_stages = len(module_names_per_stage)
    stages: list[PipelineStage] = []
    parts: list[nn.Module] = []
    for stage_idx in _stage_indices(pp_rank, pp_mesh.size(), num_stages, pp_schedule):
        part = copy.deepcopy(whole_model)
        _keep_only(part, module_names_per_stage[stage_idx])
        stages.append(PipelineStage(part, stage_idx, num_stages, device, group=pp_mesh.get_group()))
        parts.append(part)
        logger.info("PP rank %d builds stage %d with %s", pp_rank, stage_idx, module_names_per_stage[stage_idx])
    return stages, parts


def _num_layers(model: nn.Module) -> int:
    args = getattr(model, "model_args", None)
    for name in ("n_layers", "num_hidden_layers"):
        if args is not None and getattr(args, name, None) is not None:
            return int(getattr(args, name))
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        return len(layers)
    raise ValueError(
        f"Cannot tell how many layers {type(model).__name__} has: give it model_args.n_layers or a `layers` ModuleDict."
    )


def pipeline_llm(
    model: nn.Module,
    device: torch.device,
    parallel_dims: ArchonParallelDims,
    archon_config: Any,
    parallelize_fn: Callable[..., nn.Module],
    **parallelize_kwargs: Any,
) -> tuple[list[PipelineStage], list[nn.Module], bool, bool]:
    """Split ``model`` into this rank's pipeline stages and parallelize each part.

    ``archon_config`` is anything with the fields of :class:`ArchonPipelineConfig`.
    Returns ``(stages, model_parts, has_first_stage, has_last_stage)``.
    """
    if not parallel_dims.pp_enabled:
        raise ValueError("pipeline_llm needs pipeline parallelism: set ArchonParallelDims.pp > 1.")
    if getattr(getattr(model, "model_args", None), "enable_weight_tying", False):
        raise ValueError(
            "pipeline_llm cannot split a model with tied embedding and LM head: the first and "
            "last stage would each train their own copy. Disable enable_weight_tying or use pp=1."
        )

    pp_mesh = parallel_dims.get_mesh("pp")
    pp_schedule = archon_config.pp_schedule
    layers_per_stage = archon_config.pp_layers_per_stage
    first_less = archon_config.pp_first_stage_less_layers
    last_less = archon_config.pp_last_stage_less_layers
    num_layers = _num_layers(model)
    pp_degree = parallel_dims.pp

    schedule_class = get_schedule_class(pp_schedule)
    single_stage = issubclass(schedule_class, PipelineScheduleSingle)
    if layers_per_stage is None:
        stages_per_rank = 1 if single_stage else 2
        num_virtual_stages = pp_degree * stages_per_rank
    else:
        num_virtual_stages = math.ceil((num_layers + first_less + last_less) / layers_per_stage)
        if num_virtual_stages % pp_degree != 0:
            raise ValueError(
                f"pp_layers_per_stage={layers_per_stage} gives {num_virtual_stages} stages for "
                f"{num_layers} layers (+{first_less} +{last_less}), not divisible by pp={pp_degree}."
            )
        stages_per_rank = num_virtual_stages // pp_degree
        if single_stage and stages_per_rank != 1:
            raise ValueError(
                f"{pp_schedule} runs one stage per rank, but pp_layers_per_stage={layers_per_stage} "
                f"gives {stages_per_rank}. Use Interleaved1F1B or a larger pp_layers_per_stage."
            )
        if not single_stage and stages_per_rank < 2:
            raise ValueError(
                f"{pp_schedule} needs at least 2 stages per rank, but pp_layers_per_stage="
                f"{layers_per_stage} gives {stages_per_rank}. Use 1F1B or a smaller pp_layers_per_stage."
            )

    is_critic = bool(getattr(getattr(model, "model_args", None), "is_critic", False))
    module_names = generate_llm_fqn_per_model_part(
        num_virtual_stages, num_layers, first_less, last_less, is_critic=is_critic
    )
    logger.info("PP schedule %s, %d stages: %s", pp_schedule, num_virtual_stages, module_names)

    stages, parts = pipeline_module_split(model, pp_mesh, pp_schedule, device, module_names)
    for i, part in enumerate(parts):
        parts[i] = parallelize_fn(part, parallel_dims, **parallelize_kwargs)
        stages[i].submod = parts[i]

    return stages, parts, any(s.is_first for s in stages), any(s.is_last for s in stages)


def build_pipeline_schedule(
    stages: list[PipelineStage],
    pp_schedule: str,
    n_microbatches: int,
    pp_degree: int = 1,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    kwargs_chunk_spec: dict[str, Any] | None = None,
) -> _PipelineSchedule:
    """A schedule over this rank's ``stages``; gradients are summed over micro-batches.

    By default the packed keyword inputs are chunked as the model expects:
    ``positions`` row by row with the tokens, ``cu_seqlens`` and ``max_seqlen``
    shared by every micro-batch.
    """
    schedule_class = get_schedule_class(pp_schedule)
    looped = issubclass(schedule_class, PipelineScheduleMulti)
    total_stages = len(stages) * pp_degree
    if n_microbatches < total_stages:
        logger.warning(
            "n_microbatches (%d) < number of stages (%d): the pipeline will idle", n_microbatches, total_stages
        )
    if kwargs_chunk_spec is None:
        kwargs_chunk_spec = {"positions": TensorChunkSpec(0), "cu_seqlens": _Replicate(), "max_seqlen": _Replicate()}
    return schedule_class(
        stages if looped else stages[0],
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        kwargs_chunk_spec=kwargs_chunk_spec,
        scale_grads=False,
    )
