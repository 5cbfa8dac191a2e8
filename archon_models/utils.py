"""Checks that a model's shapes can be split the way a parallel plan splits them.

They run before any module is touched, so a bad configuration fails with the
field to change instead of a shape error deep inside a collective.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ModelArgsProtocol",
    "validate_cp_constraints",
    "validate_ep_constraints",
    "validate_tp_constraints",
]


@runtime_checkable
class ModelArgsProtocol(Protocol):
    """Model args with an attention head configuration."""

    n_heads: int
    n_kv_heads: int | None


def _head_counts(model_args: ModelArgsProtocol) -> tuple[int, int]:
    n_heads = model_args.n_heads
    n_kv_heads = model_args.n_kv_heads if model_args.n_kv_heads is not None else n_heads
    return n_heads, n_kv_heads


def validate_tp_constraints(model_args: ModelArgsProtocol, tp_size: int) -> None:
    """TP splits attention by heads: ``n_heads`` and ``n_kv_heads`` must divide by ``tp_size``."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}.")
    n_heads, n_kv_heads = _head_counts(model_args)
    if n_heads % tp_size != 0:
        raise ValueError(
            f"n_heads ({n_heads}) must be divisible by tp_size ({tp_size}): tensor parallelism "
            f"gives each rank n_heads / tp_size query heads. Use a tp that divides {n_heads}."
        )
    if n_kv_heads % tp_size != 0:
        raise ValueError(
            f"n_kv_heads ({n_kv_heads}) must be divisible by tp_size ({tp_size}): tensor "
            f"parallelism gives each rank n_kv_heads / tp_size key/value heads. Use a tp that "
            f"divides {n_kv_heads}."
        )


def validate_cp_constraints(model_args: ModelArgsProtocol, cp_size: int, tp_size: int = 1) -> None:
    """Ulysses CP trades the sequence split for a head split among the heads a TP rank holds.

    Query heads after TP must divide by ``cp_size``. Key/value heads after TP must
    divide by ``cp_size``, or divide ``cp_size`` (the attention then repeats them to
    ``cp_size`` heads).
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}.")
    validate_tp_constraints(model_args, tp_size)
    n_heads, n_kv_heads = _head_counts(model_args)
    if n_heads % n_kv_heads != 0:
        raise ValueError(
            f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads}) for grouped-query attention."
        )
    q_heads = n_heads // tp_size
    kv_heads = n_kv_heads // tp_size

    if q_heads % cp_size != 0:
        raise ValueError(
            f"n_heads / tp_size = {n_heads} / {tp_size} = {q_heads} query heads per TP rank must be "
            f"divisible by cp_size ({cp_size}). Use a cp that divides {q_heads}."
        )
    if kv_heads >= cp_size:
        if kv_heads % cp_size != 0:
            raise ValueError(
                f"n_kv_heads / tp_size = {n_kv_heads} / {tp_size} = {kv_heads} key/value heads per "
                f"TP rank must be divisible by cp_size ({cp_size}). Use a cp that divides {kv_heads}."
            )
    elif cp_size % kv_heads != 0:
        # The attention repeats kv heads cp_size / kv_heads times. That count always
        # divides the GQA group size here, since q_heads = n_rep * kv_heads is a
        # multiple of cp_size.
        raise ValueError(
            f"cp_size ({cp_size}) must be a multiple of n_kv_heads / tp_size = {kv_heads} when it "
            f"exceeds it, so key/value heads can be repeated to cp_size."
        )


def _num_experts(model_args: Any) -> int:
    moe_args = getattr(model_args, "moe_args", None)
    num_experts = getattr(moe_args, "num_experts", None)
    if num_experts is None:
        num_experts = getattr(model_args, "num_experts", None)
    if num_experts is None:
        raise ValueError(
            f"{type(model_args).__name__} has no moe_args.num_experts: expert parallelism needs an "
            "MoE model. Set ep=1 for a dense model."
        )
    return int(num_experts)


def validate_ep_constraints(model_args: Any, ep_size: int) -> None:
    """EP gives each rank ``num_experts / ep_size`` whole experts."""
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}.")
    num_experts = _num_experts(model_args)
    if num_experts % ep_size != 0:
        raise ValueError(
            f"moe_args.num_experts ({num_experts}) must be divisible by ep_size ({ep_size}): expert "
            f"parallelism gives each rank num_experts / ep_size experts. Use an ep that divides "
            f"{num_experts}."
        )
