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


SPECIAL_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def special_token_ids(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The config's pad, bos and eos ids inside its vocabulary, by field (an eos list gives
    each of its ids). Real documents hold them: a bos opens each, an eos ends each, and
    padded batches hold the pad id, whose embedding row HF's ``padding_idx`` never trains."""
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    found: dict[str, tuple[int, ...]] = {}
    for field in SPECIAL_TOKEN_FIELDS:
        value = getattr(hf_config, field, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        ids = tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab)
        if ids:
            found[field] = ids
    return found


def _place_special_ids(tokens: torch.Tensor, lens: tuple[int, ...], special: dict[str, tuple[int, ...]]) -> None:
    """Write the special ids into each document, in place: the pad id(s) in its middle, then
    the bos id first and the eos id last (so a short document keeps both ends)."""
    start = 0
    for index, length in enumerate(lens):
        for field, position in (
            ("pad_token_id", length // 2),
            ("bos_token_id", 0),
            ("eos_token_id", length - 1),
        ):
            ids = special.get(field)
            if ids:
                tokens[0, start + position] = ids[index % len(ids)]
        start += length


def make_packed_inputs(
    doc_lens: Sequence[int], vocab_size: int, seed: int = 0, special: dict[str, tuple[int, ...]] | None = None
) -> PackedInputs:
    """Seeded random tokens for documents of the given lengths, packed; ``special`` (from
    :func:`special_token_ids`) places the pad, bos and eos ids in every document."""
    lens = tuple(int(n) for n in doc_lens)
    if not lens or min(lens) < 1:
        raise ValueError(f"doc_lens={lens}: every document needs at least one token.")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}: must be positive.")
    generator = torch.Generator().manual_seed(seed)
    total = sum(lens)
    tokens = torch.randint(0, vocab_size, (1, total), generator=generator, dtype=torch.long)
    if special:
        _place_special_ids(tokens, lens, special)
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
