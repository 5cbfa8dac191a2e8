"""Hybrid stacks: layers whose token mixer is a Gated DeltaNet beside softmax-attention layers.

A hybrid family is measured in two parts, each by what it computes:

- the linear-attention layers: which layers hold a non-attention mixer, the per-layer config
  field that names them (``layer_types``), and the mixer itself, loaded into the qwen3_5
  reference's ``GatedDeltaNet`` by its own parameter names and run on the same input: equal
  outputs mean the reference computes it; any other mixer (other projections, another
  recurrence) is refused by name, with what differs;
- everything else (attention, MLP, norms, positions, scalars), by the ordinary analysis of the
  same family with every layer set to the attention kind: the config field is the family's
  own switch, so that model is the family's attention layers stacked.

The linear-attention layers must be the attention layers with their mixer swapped: the same
other children (norms, MLP) of the same classes, or the stack is refused by name.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from skill.analysis import modules as mt
from skill.features import LinearAttentionLayers

logger = logging.getLogger(__name__)

# The per-layer list fields a config names its layers' kinds in.
_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types")
# Mixer outputs within this many fp32 ulps of their scale are the same computation (the
# reference and HF order the chunked recurrence's sums differently).
_ULPS = 64


@dataclass
class HybridStack:
    """A hybrid's measured linear-attention layers and the config of its attention-only twin."""

    layers: LinearAttentionLayers
    attention_only: PretrainedConfig


class HybridRefused(ValueError):
    """A non-attention mixer or stack the reference does not compute: one line, naming it."""


def mixer_layers(layers: nn.ModuleList) -> dict[int, tuple[str, nn.Module]]:
    """Per layer holding a non-attention mixer (a child no attention whose class or convolution
    :func:`skill.analysis.modules.non_attention_mixers` names), that child's name and module."""
    found: dict[int, tuple[str, nn.Module]] = {}
    for index, layer in enumerate(layers):
        for name, child in layer.named_children():
            if mt.is_attention(child) or mt.is_norm(child):
                continue
            if mt.non_attention_mixers(nn.ModuleList([child])):
                found[index] = (name, child)
                break
    return found


def _kind_field(config: PretrainedConfig, mixed: set[int], n_layers: int) -> tuple[str, str, str]:
    """The per-layer field whose value tells the mixer layers from the others, and its two values."""
    for name in _KIND_FIELDS:
        kinds = getattr(config, name, None)
        if not isinstance(kinds, list) or len(kinds) != n_layers:
            continue
        linear = {kinds[i] for i in mixed}
        attention = {kinds[i] for i in range(n_layers) if i not in mixed}
        if len(linear) == 1 and len(attention) == 1 and linear != attention:
            return name, str(next(iter(linear))), str(next(iter(attention)))
    raise HybridRefused(
        f"no per-layer config field ({', '.join(_KIND_FIELDS)}) tells the linear-attention layers {sorted(mixed)} "
        "from the attention layers with one value each"
    )


def _same_besides_mixer(layers: nn.ModuleList, mixed: dict[int, tuple[str, nn.Module]]) -> None:
    """Refuse a stack whose mixer layers differ from its attention layers beyond the mixer."""
    attention_layer = next(layer for i, layer in enumerate(layers) if i not in mixed)
    index = min(mixed)
    mixer_name = mixed[index][0]

    def others(layer: nn.Module, skip: str | None) -> dict[str, str]:
        return {
            name: type(child).__name__
            for name, child in layer.named_children()
            if name != skip and not mt.is_attention(child)
        }

    theirs, ours = others(layers[index], mixer_name), others(attention_layer, None)
    if theirs != ours:
        raise HybridRefused(
            f"its linear-attention layers hold {sorted(theirs)} beside the mixer where the attention layers "
            f"hold {sorted(ours)}: the layers differ beyond their token mixer"
        )


# What the reference's GatedDeltaNet reads of a config.
_MIXER_FIELDS = (
    "hidden_size",
    "rms_norm_eps",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def _reference_mixer(tiny: PretrainedConfig) -> nn.Module:
    from archon_models.qwen3_5.model.args import Qwen3_5ModelArgs
    from archon_models.qwen3_5.model.model import GatedDeltaNet

    missing = [name for name in _MIXER_FIELDS if not isinstance(getattr(tiny, name, None), (int, float))]
    if missing:
        raise HybridRefused(f"its config lacks {missing}, the sizes of the qwen3_5 reference's Gated DeltaNet")
    args = Qwen3_5ModelArgs(
        dim=tiny.hidden_size,
        norm_eps=tiny.rms_norm_eps,
        n_layers=1,
        linear_conv_kernel_dim=tiny.linear_conv_kernel_dim,
        linear_key_head_dim=tiny.linear_key_head_dim,
        linear_value_head_dim=tiny.linear_value_head_dim,
        linear_num_key_heads=tiny.linear_num_key_heads,
        linear_num_value_heads=tiny.linear_num_value_heads,
    )
    return GatedDeltaNet(args)


def _compare_mixer(hf_mixer: nn.Module, tiny: PretrainedConfig, class_name: str) -> None:
    """Load the HF mixer's parameters into the reference's GatedDeltaNet by name and compare outputs."""
    reference = _reference_mixer(tiny).to(torch.float32)
    theirs = dict(hf_mixer.state_dict())
    ours = reference.state_dict()
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    shapes = [n for n in sorted(set(ours) & set(theirs)) if ours[n].shape != theirs[n].shape]
    if missing or unexpected or shapes:
        raise HybridRefused(
            f"its {class_name} holds {sorted(theirs)}, not the qwen3_5 reference's Gated DeltaNet parameters "
            f"{sorted(ours)}" + (f" (shapes differ: {shapes})" if shapes else "")
        )
    reference.load_state_dict(theirs)
    generator = torch.Generator().manual_seed(0)
    length = 12
    x = torch.randn(1, length, tiny.hidden_size, generator=generator)
    with torch.no_grad():
        expected = hf_mixer(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = reference(x, torch.tensor([0, length], dtype=torch.int32))
    scale = float(expected.abs().max())
    diff = float((got - expected).abs().max())
    if not diff <= _ULPS * torch.finfo(torch.float32).eps * max(scale, 1e-6):
        raise HybridRefused(
            f"its {class_name} has the qwen3_5 reference's Gated DeltaNet parameters but computes something else "
            f"(max abs diff {diff:.2e} on outputs of magnitude {scale:.2e})"
        )


def measure_hybrid(
    config: PretrainedConfig, tiny: PretrainedConfig, layers: nn.ModuleList, mixed: dict[int, tuple[str, nn.Module]]
) -> HybridStack:
    """The linear-attention layers of a hybrid (``mixed``: :func:`mixer_layers` of the tiny
    stack ``layers``), measured; raises :class:`HybridRefused` naming what the reference lacks."""
    names = {name for name, _ in mixed.values()}
    classes = sorted({type(module).__name__ for _, module in mixed.values()})
    if len(names) != 1 or len(classes) != 1:
        raise HybridRefused(f"its layers hold several kinds of non-attention mixer ({', '.join(classes)})")
    _compare_mixer(mixed[min(mixed)][1], tiny, classes[0])
    if len(mixed) == len(layers):
        raise HybridRefused(f"no layer of its tiny stack ({len(layers)} layers) is a softmax-attention layer")
    field, linear_kind, attention_kind = _kind_field(tiny, set(mixed), len(layers))
    _same_besides_mixer(layers, mixed)
    kinds: Sequence[object] = getattr(config, field)
    attention_only = copy.deepcopy(config)
    setattr(attention_only, field, [attention_kind] * len(kinds))
    return HybridStack(
        layers=LinearAttentionLayers(
            kind="gated_deltanet",
            kind_field=field,
            linear_kind=linear_kind,
            attention_kind=attention_kind,
            mixer_name=names.pop(),
            layers=[i for i, kind in enumerate(kinds) if kind == linear_kind],
        ),
        attention_only=attention_only,
    )
