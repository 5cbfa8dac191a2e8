"""Ulysses sequence parallelism: context parallelism by all-to-all.

Each CP rank holds a contiguous slice of the packed sequence. Around attention,
an all-to-all trades it for the whole sequence and ``heads / cp`` of the heads
(``gather_seq_scatter_heads``), attention runs per document on the whole sequence
with the global ``cu_seqlens``, and the inverse all-to-all
(``gather_heads_scatter_seq``) returns to the sequence slice. Everything else in
the model is per token, so it runs on the slice unchanged.

The collectives are PyTorch's autograd-aware functional collectives (the backward
of an all-to-all is the all-to-all with the dimensions swapped; of an all-gather,
a reduce-scatter). They run on NCCL and on gloo (CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = [
    "gather_heads_scatter_seq",
    "gather_seq_scatter_heads",
    "ulysses_gather_output",
    "ulysses_slice_inputs",
]


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup) -> Tensor:
    """Split ``x`` along ``scatter_dim`` over the ranks, concatenate what arrives along ``gather_dim``."""
    world = dist.get_world_size(group)
    if x.size(scatter_dim) % world != 0:
        raise ValueError(
            f"Cannot scatter dimension {scatter_dim} of size {x.size(scatter_dim)} over {world} "
            "ranks: it must be divisible by the CP size."
        )
    send = torch.stack(x.chunk(world, dim=scatter_dim), dim=0).contiguous()
    received = funcol.all_to_all_single_autograd(send, None, None, group)
    return torch.cat(funcol.wait_tensor(received).unbind(0), dim=gather_dim)


def _pad(x: Tensor, dim: int, padding: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = padding
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def gather_seq_scatter_heads(
    x: Tensor,
    seq_dim: int,
    head_dim: int,
    unpadded_dim_size: int = 0,
    group: ProcessGroup | None = None,
) -> Tensor:
    """``[.., seq/cp, .., heads, ..]`` to ``[.., seq, .., heads/cp, ..]``.

    ``unpadded_dim_size`` is the true full sequence length; the padding that made it
    divisible by the CP size is cut off after the gather.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    x = _all_to_all(x, scatter_dim=head_dim, gather_dim=seq_dim, group=group)
    if unpadded_dim_size and unpadded_dim_size < x.size(seq_dim):
        x = x.narrow(seq_dim, 0, unpadded_dim_size)
    return x


def gather_heads_scatter_seq(
    x: Tensor,
    head_dim: int,
    seq_dim: int,
    group: ProcessGroup | None = None,
) -> Tensor:
    """``[.., seq, .., heads/cp, ..]`` to ``[.., seq/cp, .., heads, ..]``, padding seq to a multiple of cp."""
    if group is None:
        return x
    world = dist.get_world_size(group)
    if world == 1:
        return x
    remainder = x.size(seq_dim) % world
    if remainder:
        x = _pad(x, seq_dim, world - remainder)
    return _all_to_all(x, scatter_dim=seq_dim, gather_dim=head_dim, group=group)


def _slice_last_dim(tensor: Tensor, cp_rank: int, cp_size: int) -> Tensor:
    total = tensor.shape[-1]
    if total % cp_size != 0:
        raise ValueError(
            f"Sequence length {total} is not divisible by cp_size {cp_size}. Pad the packed batch to "
            "a multiple of ArchonParallelDims.seq_len_divisor before slicing."
        )
    chunk = total // cp_size
    return tensor[..., cp_rank * chunk : (cp_rank + 1) * chunk].contiguous()


def ulysses_slice_inputs(
    inputs: dict[str, Any],
    labels: Tensor,
    cp_rank: int,
    cp_size: int,
) -> tuple[dict[str, Any], Tensor]:
    """This rank's contiguous slice of ``input_ids``, ``position_ids`` (if present) and ``labels``.

    ``cu_seqlens`` and ``max_seqlen`` stay global: attention sees the whole sequence.
    """
    if cp_size <= 1:
        return inputs, labels
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, cp_size={cp_size}).")
    if "input_ids" not in inputs:
        raise KeyError(f"ulysses_slice_inputs needs inputs['input_ids']; got keys {sorted(inputs)}.")
    sliced = dict(inputs)
    sliced["input_ids"] = _slice_last_dim(inputs["input_ids"], cp_rank, cp_size)
    if inputs.get("position_ids") is not None:
        sliced["position_ids"] = _slice_last_dim(inputs["position_ids"], cp_rank, cp_size)
    return sliced, _slice_last_dim(labels, cp_rank, cp_size)


def ulysses_gather_output(output: Tensor, cp_group: ProcessGroup | None, seq_dim: int = 0) -> Tensor:
    """Concatenate every CP rank's slice of ``output`` along ``seq_dim`` (differentiable).

    The default ``seq_dim=0`` suits per-token outputs of shape ``[T/cp, ...]``; pass
    ``seq_dim=1`` for ``[1, T/cp, vocab]`` logits.
    """
    if cp_group is None or dist.get_world_size(cp_group) <= 1:
        return output
    gathered = funcol.all_gather_single(output.contiguous(), gather_dim=seq_dim, group=cp_group)
    return funcol.wait_tensor(gathered)
