"""How a Qwen3.5 (text, dense or MoE) model is laid out over devices: FSDP, activation
checkpointing and torch.compile (an MoE block piecewise around its experts, as qwen3's), as
AReaL's hybrid model does.

The Gated DeltaNet layers have no tensor- or context-parallel plan: their fused ``in_proj_qkv``
stacks queries, keys and values of every head along one dimension, which a row split would
cut across kinds, and their convolution and recurrence run along the whole sequence. AReaL's
hybrid model logs a warning and ignores a TP, CP or EP degree; here they are refused by name, so a
configuration is never silently run otherwise than asked.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from archon_models.activation_checkpoint import apply_ac
from archon_models.moe import MoE

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
            f"this package has no plan for {', '.join(refused).upper()}: its Gated DeltaNet layers are not "
            "tensor-, context- or expert-parallel. Use FSDP (dp_shard) and pipeline parallelism."
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


def _is_moe_block(block: nn.Module) -> bool:
    return bool(getattr(block, "moe_enabled", False)) and getattr(block, "moe", None) is not None


def _apply_compile(model: nn.Module) -> None:
    """Compile each block; in MoE blocks compile the submodules around the experts.

    FSDP/EP hooks on the experts cannot be traced, so an MoE block is compiled
    piecewise (attention, router, reorderer, shared experts) and its experts stay
    eager. Norms stay eager too: SequenceParallel's redistribution breaks graphs.
    """
    for name, block in list(model.layers.items()):
        if not _is_moe_block(block):
            model.layers[name] = torch.compile(block, backend="inductor", fullgraph=False)
            continue
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        for child_name, child in list(inner.named_children()):
            if child_name in ("attention_norm", "ffn_norm"):
                continue
            if isinstance(child, MoE):
                for moe_child_name, moe_child in list(child.named_children()):
                    if moe_child_name != "experts":
                        setattr(child, moe_child_name, torch.compile(moe_child, backend="inductor", fullgraph=False))
            else:
                setattr(inner, child_name, torch.compile(child, backend="inductor", fullgraph=False))
    logger.info("Compiled %d Qwen3.5 transformer blocks (MoE-aware)", len(model.layers))


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
    """FSDP2: the embedding, each block, and the final norm + head as separate units, then the root."""
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
    logger.info("Applied FSDP to Qwen3.5 (mesh %s)%s", dp_mesh.mesh_dim_names, " (CPU offload)" if cpu_offload else "")
