"""Chunked local attention (Llama 4's ``attention_chunk_size``), measured on the attention weights.

Such a layer cuts each sequence into chunks of ``c`` tokens from its first one; a token attends
to the earlier tokens of its own chunk only. A config field is taken as the chunk length when a
tiny model (the field at its tiny value ``c``) run on ``3c + 2`` tokens shows, on some layer,
attention weights that are zero exactly outside ``key <= query`` and ``key // c == query // c``;
every other layer must show the plain causal pattern. Which layers chunk is read the same way: a
tiny model with a layer of each ``layer_types`` kind, so that the kind of the chunked layers is
measured, not taken from its name.
"""

from __future__ import annotations

import copy
import logging
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from skill.analysis import modules as mt
from skill.analysis import probes
from skill.features import ChunkedAttention
from skill.tiny_model import build_tiny_model

logger = logging.getLogger(__name__)

# Integer fields named like a chunk that no attention reads (transformers' feed-forward chunking).
_NOT_ATTENTION = frozenset({"chunk_size_feed_forward"})


def chunk_mask(length: int, chunk: int) -> torch.Tensor:
    """``[length, length]``: key ``j`` visible to query ``i`` in a chunked causal layer."""
    index = torch.arange(length)
    return (index[None, :] <= index[:, None]) & (index[None, :] // chunk == index[:, None] // chunk)


def _chunk_fields(config: PretrainedConfig) -> list[tuple[str, int]]:
    return sorted(
        (name, value)
        for name, value in vars(config).items()
        if "chunk" in name
        and name not in _NOT_ATTENTION
        and isinstance(value, int)
        and not isinstance(value, bool)
        and value >= 2
    )


def _with_every_kind(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with a layer of each of its ``layer_types`` kinds in the tiny stack."""
    kinds = list(getattr(config, "layer_types", None) or ())
    n_layers = int(getattr(config, "num_hidden_layers", len(kinds)))
    present, every = set(kinds[:n_layers]), sorted(set(kinds))
    if present == set(every) or len(every) > n_layers:
        return config
    moved = copy.deepcopy(config)
    moved.layer_types = [every[i % len(every)] for i in range(n_layers)]
    return moved


def _visible_keys(model: nn.Module, config: PretrainedConfig, length: int) -> list[torch.Tensor] | None:
    """Each layer's ``[length, length]`` pattern of non-zero attention weights (any head)."""
    anatomy = mt.anatomy(cast(PreTrainedModel, model), int(config.num_hidden_layers))
    if anatomy.attention_name is None:
        return None
    attentions = [layer.get_submodule(anatomy.attention_name) for layer in anatomy.layers]
    # A sink logit's column (gpt-oss) is no key.
    weights = probes.attention_weights(model, attentions, probes.tokens_for(config, length), sink_columns=1)
    if weights is None or not all(w.shape[-1] == length and w.shape[-2] == length for w in weights):
        return None
    return [(w[0] > 0).any(dim=0) for w in weights]


def measure_chunked_attention(
    tiny: PretrainedConfig, model: nn.Module, trust_remote_code: bool
) -> tuple[ChunkedAttention | None, str | None]:
    """The chunked attention of the tiny model ``model`` of config ``tiny`` and the evidence,
    or ``None`` and, when a chunk field is set that no measured pattern explains, why."""
    fields = _chunk_fields(tiny)
    if not fields:
        return None, None
    config = _with_every_kind(tiny)
    if config is not tiny:
        try:
            model = build_tiny_model(config, seed=0, trust_remote_code=trust_remote_code)
        except Exception as exc:  # config validators raise several exception types
            logger.debug("the chunk probe's model with every layer kind failed: %s", exc)
            return None, "the model with a layer of each kind could not be built"
    kinds = list(getattr(config, "layer_types", None) or ())
    for name, chunk in fields:
        length = 3 * chunk + 2
        masks = _visible_keys(model, config, length)
        if masks is None:
            return None, "the model returns no attention weights to read the mask from"
        chunked = chunk_mask(length, chunk)
        causal = chunk_mask(length, length)
        local = [i for i, mask in enumerate(masks) if torch.equal(mask, chunked)]
        if not local:
            continue
        full = [i for i, mask in enumerate(masks) if torch.equal(mask, causal)]
        if len(local) + len(full) != len(masks):
            return None, f"{name} chunks some layers, and others attend in a pattern neither chunked nor causal"
        if not full:
            return ChunkedAttention(size_field=name), f"chunked attention: {name} on every layer (mask probe)"
        local_kinds = {kinds[i] for i in local} if len(kinds) >= len(masks) else set()
        full_kinds = {kinds[i] for i in full} if len(kinds) >= len(masks) else set()
        if len(local_kinds) != 1 or local_kinds & full_kinds:
            return None, f"{name} chunks layers {local}, not chosen by their layer_types"
        (kind,) = local_kinds
        evidence = f"chunked attention: {name} on the layers layer_types marks {kind!r} (mask probe)"
        return ChunkedAttention(size_field=name, chunked_kind=kind), evidence
    return None, None
