"""How a DeepSeek-V3 model is laid out over devices.

Order: TP of the dense parts, MoE EP/TP, CP (Ulysses), activation checkpointing,
torch.compile, FSDP.

Multi-head latent attention under TP: the heads are split, the latents are not. The
block's input is gathered (sequence-parallel shard to replicated); the down
projections ``wq_a``/``wkv_a`` and the latent norms ``q_norm``/``kv_norm`` run
replicated on every rank (``ReplicateParallel``: replicated DTensor parameters, plain
tensors in and out); the up projections ``wq_b`` (or ``wq`` without a query latent)
and ``wkv_b`` are column-wise, so each rank computes its own heads; ``wo`` is row-wise
back to the sequence shard. The gradient that a replicated latent receives from one
rank's heads is only that rank's share: for ``wq_b``/``wkv_b`` the column-wise style's
input conversion already all-reduces it, and for the RoPE key ``k_pe`` (sliced off
``wkv_a``'s output and shared by every head) the attention's ``k_pe_broadcast``
identity is planned as ``ReplicateParallel(local_output_grad_placements=(Partial(),))``,
which all-reduces it in the backward pass.

MoE under TP: the block's input is gathered and handed to the MoE as a plain
tensor on every rank; each rank's MoE output is a partial sum (experts split over
TP, or tokens split over TP ranks before EP) that is reduce-scattered back to the
sequence shard. Every replicated module inside the MoE that feeds that partial
output (the router gate) therefore gets a *partial* gradient on each rank;
``ReplicateParallel(local_output_grad_placements=(Partial(),))`` declares it so, and
the backward all-reduces it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from archon_models.activation_checkpoint import apply_ac
from archon_models.expert_parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    ReordererSequenceParallel,
    TensorParallel,
)
from archon_models.moe import MoE
from archon_models.utils import (
    validate_cp_constraints,
    validate_ep_constraints,
    validate_tp_constraints,
)

if TYPE_CHECKING:
    from archon_models.activation_checkpoint import ActivationCheckpointConfig
    from archon_models.parallel_dims import ArchonParallelDims

logger = logging.getLogger(__name__)

__all__ = [
    "ReplicateParallel",
    "apply_cp",
    "apply_fsdp",
    "apply_moe_ep_tp",
    "apply_non_moe_tp",
    "parallelize_deepseek_v3",
]


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


class ReplicateParallel(ParallelStyle):
    """Run a module replicated on every TP rank, on plain tensors in and out.

    Parameters become replicated DTensors, so their gradients are reduced over the
    mesh according to the placement of the output gradient. The caller says what
    that gradient is: ``Partial()`` when the module's output only feeds a value that
    is itself a partial sum over ranks (then each rank's gradient is its share).
    """

    def __init__(self, local_output_grad_placements: tuple[Placement, ...] = (Replicate(),)):
        super().__init__()
        self.local_output_grad_placements = local_output_grad_placements

    def _prepare_input(self, module: nn.Module, inputs: tuple[Any, ...], device_mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def _prepare_output(self, module: nn.Module, output: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        if isinstance(output, DTensor):
            return output.to_local(grad_placements=self.local_output_grad_placements)
        return output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            input_fn=lambda mod, inputs, mesh: self._prepare_input(mod, inputs, mesh),
            output_fn=lambda mod, output, mesh: self._prepare_output(mod, output, mesh),
        )


def parallelize_deepseek_v3(
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
    """Apply TP, EP, CP, activation checkpointing, torch.compile and FSDP, in that order.

    Each is applied when ``parallel_dims`` enables it. ``loss_parallel=True`` leaves
    the logits sharded over the vocabulary; ``False`` replicates them.
    """
    tp_mesh = parallel_dims.get_mesh("tp") if parallel_dims.tp_enabled else None
    ep_mesh = parallel_dims.get_mesh("ep") if parallel_dims.ep_enabled else None

    if tp_mesh is not None:
        apply_non_moe_tp(model, tp_mesh, loss_parallel=loss_parallel)

    if tp_mesh is not None or ep_mesh is not None:
        apply_moe_ep_tp(
            model,
            tp_mesh,
            ep_mesh,
            etp=parallel_dims.etp,
            ep_tp_mesh=parallel_dims.get_mesh("ep_tp") if parallel_dims.etp_enabled else None,
        )

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
        _apply_compile(model)

    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        apply_fsdp(
            model,
            _fsdp_mesh(parallel_dims),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=cpu_offload,
            reshard_after_forward_policy=reshard_after_forward_policy,
            ep_degree=parallel_dims.ep,
            dp_mod_ep_mesh=parallel_dims.get_mesh("dp_shard_mod_ep") if parallel_dims.ep_enabled else None,
            gradient_divide_factor=parallel_dims.fsdp_gradient_divide_factor,
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


def _is_moe_block(block: nn.Module) -> bool:
    return bool(getattr(block, "moe_enabled", False)) and getattr(block, "moe", None) is not None


def apply_non_moe_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = True) -> None:
    """TP with sequence parallelism for everything but the MoE blocks' MLPs.

    Embedding row-wise with a sequence-sharded output; norms SequenceParallel; the
    MLA latents replicated and the head projections column-wise (module docstring),
    ``wo`` row-wise back to the sequence shard; dense MLPs w1/w3 column-wise and w2
    row-wise; the LM head column-wise over the vocabulary.
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

    partial_grad = ReplicateParallel(local_output_grad_placements=(Partial(),))
    for block in model.layers.values():
        attention = block.attention
        layer_plan: dict[str, Any] = {
            "attention_norm": SequenceParallel(),
            # Only the hidden states are gathered; rope cache, positions, cu_seqlens
            # and max_seqlen are the same plain tensors on every rank.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None),
            ),
            "attention.wkv_a": ReplicateParallel(),
            "attention.kv_norm": ReplicateParallel(),
            "attention.k_pe_broadcast": partial_grad,
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if attention.wq is not None:
            layer_plan["attention.wq"] = ColwiseParallel()
        else:
            layer_plan["attention.wq_a"] = ReplicateParallel()
            layer_plan["attention.q_norm"] = ReplicateParallel()
            layer_plan["attention.wq_b"] = ColwiseParallel()
        if not _is_moe_block(block) and getattr(block, "feed_forward", None) is not None:
            layer_plan.update(
                {
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                }
            )
        parallelize_module(block, tp_mesh, layer_plan)

    logger.info("Applied tensor parallelism (tp=%d) to the dense parts of DeepSeek-V3", tp_mesh.size())


def apply_moe_ep_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh | None,
    ep_mesh: DeviceMesh | None,
    etp: int = 1,
    ep_tp_mesh: DeviceMesh | None = None,
) -> None:
    """Expert parallelism and MoE tensor parallelism; a no-op for a dense model.

    | ep | tp | etp | experts              | expert weights          |
    |----|----|-----|----------------------|-------------------------|
    | 1  | >1 |  -  | TensorParallel       | Shard(1) / Shard(2)     |
    | >1 | 1  |  -  | ExpertParallel       | Shard(0)                |
    | >1 | >1 |  1  | ExpertParallel       | Shard(0); TP ranks join EP |
    | >1 | >1 | tp  | ExpertTensorParallel | [Shard(0), Shard(1/2)]  |
    """
    if tp_mesh is None and ep_mesh is None:
        return
    if ep_mesh is not None:
        validate_ep_constraints(model.model_args, ep_mesh.size())

    for block in model.layers.values():
        if not _is_moe_block(block):
            continue
        moe = block.moe

        if tp_mesh is not None:
            partial_grad = ReplicateParallel(local_output_grad_placements=(Partial(),))
            moe_plan: dict[str, Any] = {
                "moe": PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    output_layouts=(Partial(),),
                    desired_output_layouts=(Shard(1),),
                ),
                "moe.router.gate": partial_grad,
            }
            if moe.shared_experts is not None:
                moe_plan.update(
                    {
                        "moe.shared_experts.w1": ColwiseParallel(),
                        "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
                        "moe.shared_experts.w3": ColwiseParallel(),
                    }
                )
            if ep_mesh is not None and etp == 1:
                # TP ranks join EP: each reorders its own slice of the (replicated)
                # tokens so the EP all-to-all sends no token twice.
                moe_plan["moe.reorderer"] = ReordererSequenceParallel()
            parallelize_module(block, tp_mesh, moe_plan)

        if ep_mesh is None:
            experts_mesh, experts_plan = tp_mesh, TensorParallel()
        elif tp_mesh is None or etp == 1:
            experts_mesh, experts_plan = ep_mesh, ExpertParallel()
        else:
            if ep_tp_mesh is None:
                raise ValueError("ExpertTensorParallel (etp == tp > 1) needs the 2D ep_tp mesh.")
            experts_mesh, experts_plan = ep_tp_mesh, ExpertTensorParallel()
        parallelize_module(moe.experts, experts_mesh, experts_plan)

    applied = []
    if tp_mesh is not None:
        applied.append(f"MoE TP (tp={tp_mesh.size()})")
    if ep_mesh is not None:
        applied.append(f"EP (ep={ep_mesh.size()}, etp={etp})")
    logger.info("Applied %s to the MoE blocks of DeepSeek-V3", ", ".join(applied))


def apply_cp(model: nn.Module, cp_group: ProcessGroup, tp_size: int = 1) -> None:
    """Ulysses context parallelism: every attention all-to-alls over ``cp_group``.

    Slicing the packed inputs per CP rank is the caller's job (``ulysses_slice_inputs``).
    """
    cp_size = dist.get_world_size(cp_group)
    validate_cp_constraints(model.model_args, cp_size, tp_size)
    for block in model.layers.values():
        block.attention.set_cp_group(cp_group)
    logger.info("Applied Ulysses context parallelism (cp=%d) to DeepSeek-V3", cp_size)


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
    logger.info("Compiled %d DeepSeek-V3 transformer blocks (MoE-aware)", len(model.layers))


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
    ep_degree: int = 1,
    dp_mod_ep_mesh: DeviceMesh | None = None,
    gradient_divide_factor: int | None = None,
) -> None:
    """FSDP2: the embedding, each block, and the final norm + head as separate units, then the root.

    Under EP, expert weights are already split over ``ep`` ranks; they are FSDP
    sharded over the rest, ``dp_mod_ep_mesh``, as their own unit. Their gradients
    must still be averaged over the whole data-parallel degree, hence
    ``gradient_divide_factor``. When there are more shards than experts the experts
    are sharded on dim 1 instead of dim 0.
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
        if _is_moe_block(block) and ep_degree > 1 and dp_mod_ep_mesh is not None:
            experts = block.moe.experts
            shard_placement_fn = None
            if dp_mod_ep_mesh.size() * ep_degree > experts.num_experts:
                shard_placement_fn = lambda param: Shard(1)  # noqa: E731
            fully_shard(
                experts,
                **{**fsdp_config, "mesh": dp_mod_ep_mesh},
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=shard_placement_fn,
            )
            if gradient_divide_factor is not None:
                experts.set_gradient_divide_factor(gradient_divide_factor)
        fully_shard(block, **fsdp_config, reshard_after_forward=reshard_after_forward)

    final_layers = [m for m in (model.norm, model.output, getattr(model, "score", None)) if m is not None]
    if tied:
        fully_shard([model.tok_embeddings, *final_layers], **fsdp_config, reshard_after_forward=reshard_after_forward)
    elif final_layers:
        fully_shard(final_layers, **fsdp_config, reshard_after_forward=reshard_after_forward_policy == "always")
    fully_shard(model, **fsdp_config)
    logger.info(
        "Applied FSDP to DeepSeek-V3 (mesh %s)%s", dp_mesh.mesh_dim_names, " with CPU offload" if cpu_offload else ""
    )
