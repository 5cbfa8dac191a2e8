"""How a Qwen3.5 (text, dense or MoE) model is laid out over devices: FSDP, activation
checkpointing and torch.compile (an MoE block piecewise around its experts, as qwen3's), as
AReaL's Qwen3.5 does.

The Gated DeltaNet layers have no tensor- or context-parallel plan: their fused ``in_proj_qkv``
stacks queries, keys and values of every head along one dimension, which a row split would
cut across kinds, and their convolution and recurrence run along the whole sequence. AReaL's
Qwen3.5 logs a warning and ignores a TP, CP or EP degree; here they are refused by name, so a
configuration is never silently run otherwise than asked.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from archon_models.activation_checkpoint import apply_ac
from archon_models.qwen3.infra.parallelize import (
    _apply_compile,
    _fsdp_mesh,
    _get_op_sac_save_list,
    _tie_weights,
    apply_fsdp,
)

if TYPE_CHECKING:
    from archon_models.activation_checkpoint import ActivationCheckpointConfig
    from archon_models.parallel_dims import ArchonParallelDims

logger = logging.getLogger(__name__)

__all__ = ["apply_fsdp", "parallelize_qwen3_5"]


def parallelize_qwen3_5(
    model: nn.Module,
    parallel_dims: ArchonParallelDims,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    loss_parallel: bool = True,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    ac_config: ActivationCheckpointConfig | None = None,
    enable_compile: bool = True,
) -> nn.Module:
    """Apply activation checkpointing, torch.compile and FSDP, in that order.

    ``loss_parallel`` has no effect (without TP the logits are whole on every rank).
    Raises ``ValueError`` when ``parallel_dims`` enables TP, CP or EP.
    """
    refused = [name for name in ("tp", "cp", "ep") if getattr(parallel_dims, f"{name}_enabled")]
    if refused:
        raise ValueError(
            f"Qwen3.5 in Archon has no plan for {', '.join(refused).upper()}: its Gated DeltaNet layers "
            "are not tensor-, context- or expert-parallel. Use FSDP (dp_shard) and pipeline parallelism."
        )

    if ac_config is not None and ac_config.mode != "none":
        apply_ac(model, ac_config, model_compile_enabled=enable_compile, op_sac_save_list=_get_op_sac_save_list())

    if enable_compile:
        _apply_compile(model)

    _tie_weights(model)
    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        apply_fsdp(
            model,
            _fsdp_mesh(parallel_dims),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=cpu_offload,
            reshard_after_forward_policy=reshard_after_forward_policy,
        )
    return model
