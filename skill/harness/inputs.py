"""Packed-sequence inputs, the Archon forward contract, built from document lengths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PackedInputs:
    """Documents concatenated into one row.

    ``tokens``/``positions`` are ``[1, T]`` int64, positions restarting at 0 in every
    document; ``cu_seqlens`` is int32 ``[n_docs + 1]``; ``max_seqlen`` the longest document.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    doc_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def documents(self) -> list[torch.Tensor]:
        """Each document's tokens as its own ``[1, L]`` batch (what HF runs alone)."""
        return list(torch.split(self.tokens, list(self.doc_lens), dim=1))

    def split(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Cut a ``[1, T, ...]`` output of the packed forward back into documents."""
        return list(torch.split(packed, list(self.doc_lens), dim=1))

    def to(self, device: torch.device | str) -> PackedInputs:
        return PackedInputs(
            tokens=self.tokens.to(device),
            positions=self.positions.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
            doc_lens=self.doc_lens,
        )


def untrained_token_ids(hf_config: Any) -> tuple[int, ...]:
    """Token ids HF never trains the embedding row of: ``pad_token_id``, the ``padding_idx``
    of the HF embedding, whose lookup gives that row no gradient. Archon's embeddings, like
    AReaL's, have no ``padding_idx``, so gradient parity is proven on inputs without them."""
    pad = getattr(hf_config, "pad_token_id", None)
    return (pad,) if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else ()


def make_packed_inputs(
    doc_lens: Sequence[int], vocab_size: int, seed: int = 0, avoid: Sequence[int] = ()
) -> PackedInputs:
    """Seeded random tokens for documents of the given lengths, packed; a token in ``avoid``
    becomes the next id not in it (the other tokens stay those of the seed)."""
    lens = tuple(int(n) for n in doc_lens)
    if not lens or min(lens) < 1:
        raise ValueError(f"doc_lens={lens}: every document needs at least one token.")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be positive.")
    generator = torch.Generator().manual_seed(seed)
    total = sum(lens)
    tokens = torch.randint(0, vocab_size, (1, total), generator=generator, dtype=torch.long)
    avoided = {int(t) for t in avoid if 0 <= int(t) < vocab_size}
    if len(avoided) >= vocab_size:
        raise ValueError(f"avoid={sorted(avoided)} leaves no token of a vocabulary of {vocab_size}.")
    for token in sorted(avoided):
        replacement = token
        while replacement in avoided:
            replacement = (replacement + 1) % vocab_size
        tokens[tokens == token] = replacement
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lens]).unsqueeze(0)
    bounds = torch.tensor((0, *lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    return PackedInputs(
        tokens=tokens,
        positions=positions,
        cu_seqlens=bounds,
        max_seqlen=max(lens),
        doc_lens=lens,
    )


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, doc_lens: Sequence[int]) -> torch.Tensor:
    """Mean next-token cross-entropy within each document of a packed ``[1, T, V]`` batch.

    The last token of a document predicts nothing, so no loss crosses a boundary. The loss
    is computed in fp32 for bf16 logits and in the logits' own dtype for fp32 and float64
    (a float64 truth rounded to fp32 here would carry fp32 rounding into every gradient).
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    losses = []
    for doc_logits, doc_tokens in zip(
        torch.split(logits, list(doc_lens), dim=1), torch.split(tokens, list(doc_lens), dim=1), strict=True
    ):
        losses.append(
            torch.nn.functional.cross_entropy(doc_logits[0, :-1].to(dtype), doc_tokens[0, 1:], reduction="sum")
        )
    count = sum(n - 1 for n in doc_lens)
    return torch.stack(losses).sum() / count
