"""Activation checkpointing of transformer blocks, as torchtitan applies it.

``full`` recomputes every block in backward. ``selective`` either recomputes every
N-th block (``selective_ac_option="N"``) or, per op (``"op"``), saves the outputs of
the expensive ops in ``op_sac_save_list`` (matmuls, attention, collectives) and
recomputes the cheap ones. ``memory_budget`` hands the trade-off to the compiler
(needs torch.compile). Blocks are wrapped with PyTorch's ``checkpoint_wrapper``;
the wrapper's ``._checkpoint_wrapped_module`` prefix is what state-dict adapters
strip.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._functorch.config
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

logger = logging.getLogger(__name__)

__all__ = ["ActivationCheckpointConfig", "apply_ac"]

_MODES = ("none", "full", "selective", "memory_budget")


@dataclass
class ActivationCheckpointConfig:
    """How to checkpoint activations.

    Attributes:
        mode: ``"none"``, ``"full"``, ``"selective"`` or ``"memory_budget"``.
        selective_ac_option: ``"op"`` for per-op selection, or a positive integer
            string N to checkpoint every N-th block.
        per_op_sac_force_recompute_mm_shapes_by_fqns: ``nn.Linear`` modules (by FQN
            substring) whose matmuls are always recomputed under per-op selection
            (the MoE router gate: cheap, and saving it breaks the every-other-mm rule).
        early_stop: stop recomputation once all needed activations exist.
        memory_budget: for ``memory_budget`` mode, 0.0 minimum memory to 1.0 no recompute.
        visualize_memory_budget_pareto: dump the compiler's runtime/memory Pareto plots.
        preserve_rng_state: replay the RNG state in recomputation (needed with dropout).
        determinism_check: ``"default"`` (check recomputed shapes/dtypes) or ``"none"``.
        debug: record the recomputed ops (slow).
    """

    mode: str = "selective"
    selective_ac_option: str = "op"
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])
    early_stop: bool = False
    memory_budget: float = 0.5
    visualize_memory_budget_pareto: bool = False
    preserve_rng_state: bool = False
    determinism_check: str = "default"
    debug: bool = False

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"Invalid activation checkpointing mode {self.mode!r}; choose one of {_MODES}.")
        if self.mode == "selective":
            option = self.selective_ac_option
            if option != "op" and not (option.isdigit() and int(option) >= 1):
                raise ValueError(
                    f"Invalid selective_ac_option {option!r}: use 'op' for per-op selection or a "
                    "positive integer string such as '2' to checkpoint every 2nd block."
                )
        if self.mode == "memory_budget" and not 0.0 <= self.memory_budget <= 1.0:
            raise ValueError(f"memory_budget must be within [0, 1], got {self.memory_budget}.")


def _checkpoint_wrapper(module: nn.Module, ac_config: ActivationCheckpointConfig, **kwargs: Any) -> nn.Module:
    return ptd_checkpoint_wrapper(
        module,
        preserve_rng_state=ac_config.preserve_rng_state,
        determinism_check=ac_config.determinism_check,
        early_stop=ac_config.early_stop,
        debug=ac_config.debug,
        **kwargs,
    )


def _force_recompute_mm_shapes(
    module: nn.Module, ac_config: ActivationCheckpointConfig, base_fqn: str | None
) -> set[tuple[int, int]]:
    """Right-hand-side shapes of the matmuls of the named linears (always recomputed)."""
    shapes: set[tuple[int, int]] = set()
    filters = ac_config.per_op_sac_force_recompute_mm_shapes_by_fqns
    if not filters:
        return shapes
    for name, submodule in module.named_modules():
        fqn = f"{base_fqn}.{name}" if base_fqn else name
        if not any(f in fqn for f in filters):
            continue
        if not isinstance(submodule, nn.Linear):
            raise ValueError(
                f"per_op_sac_force_recompute_mm_shapes_by_fqns entry matched {fqn!r}, a "
                f"{type(submodule).__name__}; it must name nn.Linear modules."
            )
        out_features, in_features = submodule.weight.shape
        shapes.add((in_features, out_features))
    return shapes


def _apply_op_sac(
    module: nn.Module,
    ac_config: ActivationCheckpointConfig,
    base_fqn: str | None,
    op_sac_save_list: set[Any],
) -> nn.Module:
    recompute_shapes = _force_recompute_mm_shapes(module, ac_config, base_fqn)

    def policy_for(counts: dict[str, int]):
        def policy(ctx, func, *args, **kwargs):
            # Offloads to CPU are saved, not replayed.
            if (
                func == torch.ops.aten._to_copy.default
                and args[0].device.type != "cpu"
                and str(kwargs.get("device", "")) == "cpu"
            ):
                return CheckpointPolicy.MUST_SAVE
            key = "recompute_mm" if ctx.is_recompute else "forward_mm"
            if func == torch.ops.aten.mm.default:
                if tuple(args[1].shape) in recompute_shapes:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                counts[key] += 1
            # Save the listed ops, but recompute every second matmul: half the matmul
            # memory for a quarter of the matmul compute.
            save = func in op_sac_save_list and not (func == torch.ops.aten.mm.default and counts[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    def context_fn():
        return create_selective_checkpoint_contexts(policy_for(defaultdict(int)))

    return _checkpoint_wrapper(module, ac_config, context_fn=context_fn)


def _wrap_block(
    block: nn.Module,
    index: int,
    ac_config: ActivationCheckpointConfig,
    base_fqn: str,
    op_sac_save_list: set[Any] | None,
) -> nn.Module:
    if ac_config.mode == "full":
        return _checkpoint_wrapper(block, ac_config)
    if ac_config.selective_ac_option == "op":
        return _apply_op_sac(block, ac_config, base_fqn, op_sac_save_list or set())
    every = int(ac_config.selective_ac_option)
    # Blocks are counted from 1, so "2" checkpoints the 2nd, 4th, ... block.
    return _checkpoint_wrapper(block, ac_config) if (index + 1) % every == 0 else block


def apply_ac(
    model: nn.Module,
    ac_config: ActivationCheckpointConfig,
    *,
    model_compile_enabled: bool = False,
    op_sac_save_list: set[Any] | None = None,
    base_folder: str = "",
) -> None:
    """Wrap each block of ``model.layers`` (a ``ModuleDict``) in place as ``ac_config`` says.

    ``op_sac_save_list`` is model specific (the ops worth saving), so each model's
    ``parallelize`` passes its own. Must run after TP/CP and before compile and FSDP.
    """
    if ac_config.mode == "none":
        logger.debug("Activation checkpointing disabled")
        return
    if ac_config.mode == "memory_budget":
        if not model_compile_enabled:
            raise ValueError(
                "Activation checkpointing mode 'memory_budget' is a compiler pass: enable "
                "torch.compile (enable_compile=True) or pick mode 'full' or 'selective'."
            )
        if ac_config.visualize_memory_budget_pareto:
            pareto_dir = os.path.join(base_folder, "memory_budget_pareto")
            os.makedirs(pareto_dir, exist_ok=True)
            torch._functorch.config.memory_budget_pareto_dir = pareto_dir
            torch._functorch.config.visualize_memory_budget_pareto = True
        torch._functorch.config.activation_memory_budget = ac_config.memory_budget
        logger.info("Activation memory budget set to %s", ac_config.memory_budget)
        return

    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(
            f"apply_ac needs model.layers to be an nn.ModuleDict of transformer blocks; "
            f"{type(model).__name__} has {type(layers).__name__}."
        )
    for index, (layer_id, block) in enumerate(list(layers.named_children())):
        wrapped = _wrap_block(block, index, ac_config, f"layers.{layer_id}", op_sac_save_list)
        layers.register_module(layer_id, wrapped)
    logger.info(
        "Applied %s activation checkpointing to %d blocks",
        ac_config.mode if ac_config.mode == "full" else f"selective ({ac_config.selective_ac_option})",
        len(layers),
    )
