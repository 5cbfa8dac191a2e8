"""Pipeline parallelism for a model with top-level modules of its own around the blocks.

AReaL's ``pipeline_llm`` (and ``archon_models.pipeline_parallel``, which mirrors it) cuts a
model by module name: ``tok_embeddings`` and the first blocks on the first stage, the last
blocks with ``norm`` and ``output``/``score`` on the last. ``pipeline_module_split`` sets
every top-level module a stage is not given to ``None``, so a module of the embedding
stage (an embedding norm, a position table, an input projection) or of the head (an
output projection) would be gone from every stage. A package whose model has one passes
:func:`pipeline_model` as its spec's ``pipelining_fn``: the same stages as ``pipeline_llm``,
with those modules named on the first or the last stage. Only AReaL's public names are
used, so the package runs in AReaL's engine unchanged.

The engine writes ``FIRST_STAGE_MODULES`` / ``LAST_STAGE_MODULES`` with the package's
module names and renames :func:`pipeline_model` to ``pipeline_<package>``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from archon_models.parallel_dims import ArchonParallelDims
from archon_models.pipeline_parallel import generate_llm_fqn_per_model_part, pipeline_module_split

# Run before the first block: kept with tok_embeddings on the first stage.
FIRST_STAGE_MODULES: tuple[str, ...] = ()
# Run after the final norm: kept with norm and output/score on the last stage.
LAST_STAGE_MODULES: tuple[str, ...] = ()


def pipeline_model(
    model: nn.Module,
    device: torch.device,
    parallel_dims: ArchonParallelDims,
    archon_config: Any,
    parallelize_fn: Callable[..., nn.Module],
    **parallelize_kwargs: Any,
) -> tuple[list[PipelineStage], list[nn.Module], bool, bool]:
    """``pipeline_llm``'s stages, with :data:`FIRST_STAGE_MODULES` on the first stage and
    :data:`LAST_STAGE_MODULES` on the last; each part then parallelized.

    ``archon_config`` holds the ``pp_*`` fields of AReaL's ArchonEngineConfig. Returns
    ``(stages, model_parts, has_first_stage, has_last_stage)``.
    """
    args: Any = model.model_args
    pp_mesh = parallel_dims.get_mesh("pp")
    if pp_mesh is None:
        raise ValueError("pipeline parallelism needs a pp mesh: set ArchonParallelDims.pp > 1.")
    if args.enable_weight_tying:
        raise ValueError(
            "a model with tied embedding and LM head cannot be split over pipeline stages: the first and "
            "last stage would each train their own copy. Disable enable_weight_tying or use pp=1."
        )
    schedule = archon_config.pp_schedule
    stages_per_rank = 1 if issubclass(get_schedule_class(schedule), PipelineScheduleSingle) else 2
    first_less = archon_config.pp_first_stage_less_layers
    last_less = archon_config.pp_last_stage_less_layers
    if archon_config.pp_layers_per_stage is None:
        num_stages = parallel_dims.pp * stages_per_rank
    else:
        num_stages = math.ceil((args.n_layers + first_less + last_less) / archon_config.pp_layers_per_stage)
        if stages_per_rank == 1 and num_stages != parallel_dims.pp:
            raise ValueError(
                f"{schedule} runs one stage per rank, but pp_layers_per_stage={archon_config.pp_layers_per_stage} "
                f"gives {num_stages} stages for pp={parallel_dims.pp}."
            )
    module_names = generate_llm_fqn_per_model_part(
        num_stages, args.n_layers, first_less, last_less, is_critic=args.is_critic
    )
    module_names[0].extend(FIRST_STAGE_MODULES)
    module_names[-1].extend(LAST_STAGE_MODULES)
    stages, parts = pipeline_module_split(model, pp_mesh, schedule, device, module_names)
    for index, part in enumerate(parts):
        parts[index] = parallelize_fn(part, parallel_dims, **parallelize_kwargs)
        stages[index].submod = parts[index]
    return stages, parts, any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)
