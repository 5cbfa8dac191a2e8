"""Reordering routed tokens into padded, expert-major groups.

Two layouts meet here. After expert-parallel dispatch a rank holds the tokens it
received *rank-major*: the chunk from rank 0 (ordered by local expert), then the
chunk from rank 1, and so on. Grouped expert compute wants them *expert-major*, and
``torch._grouped_mm`` wants every group's row count to be a multiple of
``TOKEN_GROUP_ALIGN_SIZE_M``. ``_permute`` builds that layout (padding rows are
zeros), ``_unpermute`` restores the input layout. Both are plain PyTorch gathers, so
they run on any device and are differentiable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TOKEN_GROUP_ALIGN_SIZE_M = 8
"""Row alignment of each expert's group for ``torch._grouped_mm``: 16 bytes of bf16."""


def generate_permute_indices(
    tokens_per_expert_group: torch.Tensor,
    experts_per_rank: int,
    num_ranks: int,
    alignment: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices from the rank-major input to the padded expert-major layout.

    Args:
        tokens_per_expert_group: ``[num_ranks * experts_per_rank]`` row counts, entry
            ``r * experts_per_rank + e`` being the rows from rank ``r`` for local expert ``e``.
        experts_per_rank: local experts.
        num_ranks: source ranks (1 without expert parallelism).
        alignment: every expert's group is padded to a multiple of this (1: no padding).
            With ``alignment > 1`` empty experts also get ``alignment`` padding rows, as
            grouped GEMM kernels expect non-empty groups.

    Returns:
        ``permuted_indices`` (int64, one entry per output row; padding rows hold
        ``num_input_rows``, the index of an appended zero row) and the padded row
        count per local expert (int64, ``[experts_per_rank]``).
    """
    counts = tokens_per_expert_group.to(torch.int64)
    if counts.numel() != num_ranks * experts_per_rank:
        raise ValueError(
            f"tokens_per_expert_group has {counts.numel()} entries, expected "
            f"num_ranks * experts_per_rank = {num_ranks} * {experts_per_rank}"
        )
    device = counts.device
    total_in = int(counts.sum())
    per_rank = counts.view(num_ranks, experts_per_rank)

    in_starts = (torch.cumsum(counts, 0) - counts).view(num_ranks, experts_per_rank)
    per_expert = per_rank.sum(0)
    # Each expert's segment rounded up to a multiple of ``alignment`` (at least one block).
    padded = (per_expert.clamp_min(alignment) + alignment - 1) // alignment * alignment if alignment > 1 else per_expert
    expert_out_starts = torch.cumsum(padded, 0) - padded

    # Segments in expert-major order: (expert 0, rank 0), (expert 0, rank 1), ...
    seg_lens = per_rank.t().reshape(-1)
    seg_in_starts = in_starts.t().reshape(-1)
    offset_in_expert = (torch.cumsum(per_rank, 0) - per_rank).t().reshape(-1)
    seg_out_starts = expert_out_starts.repeat_interleave(num_ranks) + offset_in_expert

    seg_ids = torch.repeat_interleave(torch.arange(seg_lens.numel(), device=device), seg_lens)
    within = torch.arange(total_in, device=device) - (torch.cumsum(seg_lens, 0) - seg_lens)[seg_ids]

    permuted_indices = torch.full((int(padded.sum()),), total_in, dtype=torch.int64, device=device)
    permuted_indices[seg_out_starts[seg_ids] + within] = seg_in_starts[seg_ids] + within
    return permuted_indices, padded


def _permute(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    ep_degree: int,
    num_local_experts: int,
    alignment: int = TOKEN_GROUP_ALIGN_SIZE_M,
) -> tuple[torch.Size, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder rank-major rows ``x`` into padded expert-major groups.

    Returns ``(input_shape, permuted_x, permuted_indices, num_tokens_per_local_expert)``;
    pass ``input_shape`` and ``permuted_indices`` to :func:`_unpermute`.
    """
    with torch.no_grad():
        permuted_indices, aligned_counts = generate_permute_indices(
            num_tokens_per_expert, num_local_experts, ep_degree, alignment
        )
    x_with_zero_row = torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)
    return x.shape, x_with_zero_row[permuted_indices], permuted_indices, aligned_counts


def _unpermute(out: torch.Tensor, input_shape: torch.Size, permuted_indices: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_permute`: rows back to the input layout, padding dropped."""
    num_rows = input_shape[0]
    with torch.no_grad():
        real = permuted_indices < num_rows
        inverse = torch.empty(num_rows, dtype=torch.int64, device=permuted_indices.device)
        inverse[permuted_indices[real]] = torch.nonzero(real).view(-1)
    return out[inverse]


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def indices_padding_wrapper(func: ExpertsFn) -> ExpertsFn:
    """Wrap an experts function ``f(w1, w2, w3, x, num_tokens_per_expert)`` so that it
    sees aligned, padded groups, and return rows in the caller's layout.

    ``num_tokens_per_expert`` may hold ``ep_degree * num_local_experts`` entries
    (rank-major counts after expert-parallel dispatch) or one per local expert.
    """

    def wrapper(
        w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        num_local_experts = w1.shape[0]
        ep_degree = num_tokens_per_expert.shape[0] // num_local_experts
        input_shape, x, permuted_indices, aligned_counts = _permute(
            x, num_tokens_per_expert, ep_degree, num_local_experts
        )
        out = func(w1, w2, w3, x, aligned_counts)
        return _unpermute(out, input_shape, permuted_indices)

    return wrapper
