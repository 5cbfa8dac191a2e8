"""How a Qwen2 model is laid out over devices: TP, CP, activation checkpointing, compile, FSDP.

Qwen2 attention has q/k/v biases and no QK norm, so every projection hands local
tensors straight to the attention (``use_local_output=True``); ColwiseParallel
shards each bias with its weight.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from archon_models.activation_checkpoint import apply_ac
from archon_models.compile import apply_compile
from archon_models.utils import validate_cp_constraints, validate_tp_constraints

if TYPE_CHECKING:
    from archon_models.activation_checkpoint import ActivationCheckpointConfig
    from archon_models.parallel_dims import ArchonParallelDims

logger = logging.getLogger(__name__)

__all__ = ["apply_cp", "apply_fsdp", "apply_tp", "parallelize_qwen2"]


def _get_op_sac_save_list() -> set[Any]:
    """Ops whose outputs per-op selective checkpointing keeps: matmuls, attention, collectives."""
    return {
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_attention_math.default,
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_to_all_single.default,
        # The absolute max feeds low-precision scaling; cheap to keep.
        torch.ops.aten.max.default,
    }


def parallelize_qwen2(
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
    """Apply TP, CP, activation checkpointing, torch.compile and FSDP, in that order.

    Each is applied when ``parallel_dims`` enables it. TP must see plain modules and
    CP configures attention, so both come first; checkpoint wrappers go around the
    TP'd blocks; compile wraps the checkpointed blocks; FSDP goes last so it shards
    the final (DTensor) parameters. ``loss_parallel=True`` leaves the logits sharded
    over the vocabulary for a loss-parallel cross entropy; ``False`` replicates them.
    """
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), loss_parallel=loss_parallel)

    # TP gives the embedding and the head separate DTensor parameters; share again
    # before FSDP, which must see the tied parameter once, in one group.
    _tie_weights(model)

    if parallel_dims.cp_enabled:
        apply_cp(model, parallel_dims.get_group("cp"), tp_size=parallel_dims.tp)

    if ac_config is not None and ac_config.mode != "none":
        apply_ac(
            model,
            ac_config,
            model_compile_enabled=enable_compile,
            op_sac_save_list=_get_op_sac_save_list(),
        )

    if enable_compile:
        apply_compile(model)

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


def _tie_weights(model: nn.Module) -> None:
    tied = getattr(model.model_args, "enable_weight_tying", False)
    if tied and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight


def _is_tied(model: nn.Module) -> bool:
    return (
        model.tok_embeddings is not None
        and model.output is not None
        and model.output.weight is model.tok_embeddings.weight
    )


def _fsdp_mesh(parallel_dims: ArchonParallelDims) -> DeviceMesh:
    """``dp_shard_cp``, or the 2D ``(dp_replicate, dp_shard_cp)`` mesh for HSDP."""
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.world_mesh[("dp_replicate", "dp_shard_cp")]
    return parallel_dims.get_mesh("dp_shard_cp")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True) -> None:
    """Tensor parallelism with sequence parallelism between the blocks.

    The residual stream is sharded over the sequence (``Shard(1)``); norms run on
    that shard (SequenceParallel, so their weight gradients are summed over ranks);
    attention and the MLP all-gather it, split heads / hidden units column-wise and
    reduce-scatter back after the row-wise output projection.
    """
    validate_tp_constraints(model.model_args, tp_mesh.size())

    root_plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=True,
        )
    if getattr(model, "score", None) is not None:
        # A critic's score head is tiny: keep it replicated on the gathered sequence,
        # handed over as a plain tensor (its plain weight cannot meet a DTensor).
        root_plan["score"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    for block in model.layers.values():
        layer_plan = {
            "attention_norm": SequenceParallel(),
            # Only the hidden states are gathered; rope cache, positions, cu_seqlens
            # and max_seqlen are the same plain tensors on every rank.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None),
            ),
            "attention.wq": ColwiseParallel(use_local_output=True),
            "attention.wk": ColwiseParallel(use_local_output=True),
            "attention.wv": ColwiseParallel(use_local_output=True),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, layer_plan)

    logger.info("Applied tensor parallelism (tp=%d) to Qwen2", tp_mesh.size())


def apply_cp(model: nn.Module, cp_group: ProcessGroup, tp_size: int = 1) -> None:
    """Ulysses context parallelism: every attention all-to-alls over ``cp_group``.

    Slicing the packed inputs per CP rank is the caller's job (``ulysses_slice_inputs``).
    """
    cp_size = dist.get_world_size(cp_group)
    validate_cp_constraints(model.model_args, cp_size, tp_size)
    for block in model.layers.values():
        block.attention.set_cp_group(cp_group)
    logger.info("Applied Ulysses context parallelism (cp=%d) to Qwen2", cp_size)


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    match policy:
        case "always":
            return True
        case "never":
            return False
        case "default":
            # Under PP each micro-batch would re-gather the weights; keep them instead.
            return not pp_enabled
        case _:
            raise ValueError(f"Invalid reshard_after_forward_policy {policy!r}; use 'default', 'always' or 'never'.")


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    pp_enabled: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
) -> None:
    """FSDP2: the embedding, each block, and the final norm + head as separate units, then the root.

    The final norm and head are not resharded after forward by default: backward
    needs them first, right away.
    """
    reshard_after_forward = _reshard_after_forward(reshard_after_forward_policy, pp_enabled)
    fsdp_config: dict[str, Any] = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()

    # A tied embedding and head share one parameter, so they must be one FSDP unit.
    tied = _is_tied(model)
    if model.tok_embeddings is not None and not tied:
        fully_shard(model.tok_embeddings, **fsdp_config, reshard_after_forward=reshard_after_forward)
    for block in model.layers.values():
        fully_shard(block, **fsdp_config, reshard_after_forward=reshard_after_forward)

    final_layers = [m for m in (model.norm, model.output, getattr(model, "score", None)) if m is not None]
    if tied:
        fully_shard([model.tok_embeddings, *final_layers], **fsdp_config, reshard_after_forward=reshard_after_forward)
    elif final_layers:
        fully_shard(final_layers, **fsdp_config, reshard_after_forward=reshard_after_forward_policy == "always")
    fully_shard(model, **fsdp_config)
    logger.info("Applied FSDP to Qwen2 (mesh %s)%s", dp_mesh.mesh_dim_names, " with CPU offload" if cpu_offload else "")
