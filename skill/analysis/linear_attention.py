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
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from skill.analysis import modules as mt
from skill.features import DELTANET_PROJECTIONS, FusedMixerWeight, LinearAttentionLayers

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


def _part_rows(tiny: PretrainedConfig, grouped: bool) -> dict[str, int]:
    """Rows of each part of the reference's projections, whole or per key-head group."""
    groups = tiny.linear_num_key_heads if grouped else 1
    value_heads = tiny.linear_num_value_heads // groups
    key_rows = tiny.linear_num_key_heads // groups * tiny.linear_key_head_dim
    value_rows = value_heads * tiny.linear_value_head_dim
    return {"q": key_rows, "k": key_rows, "v": value_rows, "z": value_rows, "b": value_heads, "a": value_heads}


def split_fused(weight: torch.Tensor, fused: FusedMixerWeight, tiny: PretrainedConfig) -> dict[str, torch.Tensor]:
    """A fused checkpoint weight -> each of its parts, whole (every key head's rows in turn)."""
    rows = _part_rows(tiny, fused.grouped)
    groups = tiny.linear_num_key_heads if fused.grouped else 1
    blocks = weight.reshape(groups, -1, *weight.shape[1:])
    pieces = torch.split(blocks, [rows[part] for part in fused.parts], dim=1)
    return {part: piece.reshape(-1, *weight.shape[1:]) for part, piece in zip(fused.parts, pieces, strict=True)}


def _candidates(name: str, rows: int, free: list[str], tiny: PretrainedConfig) -> list[FusedMixerWeight]:
    """Every way ``rows`` rows could stack whole reference projections of ``free``, in any order of
    their parts, whole or grouped by key head."""
    found: list[FusedMixerWeight] = []
    for count in range(2, len(free) + 1):
        for projections in itertools.combinations(free, count):
            parts = [part for projection in projections for part in DELTANET_PROJECTIONS[projection]]
            for grouped in (False, True):
                per_part = _part_rows(tiny, grouped)
                groups = tiny.linear_num_key_heads if grouped else 1
                if groups * sum(per_part[part] for part in parts) != rows:
                    continue
                for order in itertools.permutations(parts):
                    found.append(FusedMixerWeight(hf_name=name, parts=list(order), grouped=grouped))
    return found


def _reference_weights(
    theirs: dict[str, torch.Tensor], fused: Sequence[FusedMixerWeight], tiny: PretrainedConfig
) -> dict[str, torch.Tensor]:
    """The reference mixer's state dict from the HF mixer's, its fused weights split."""
    weights = {name: value for name, value in theirs.items() if name not in {f.hf_name for f in fused}}
    for weight in fused:
        parts = split_fused(theirs[weight.hf_name], weight, tiny)
        for projection in weight.projections:
            held = DELTANET_PROJECTIONS[projection]
            weights[f"{projection}.weight"] = torch.cat([parts[part] for part in held], dim=0)
    return weights


def _same_output(hf_mixer: nn.Module, reference: nn.Module, tiny: PretrainedConfig) -> tuple[float, float]:
    """Max abs difference of the two mixers' outputs on one random document, and their scale."""
    generator = torch.Generator().manual_seed(0)
    length = 12
    x = torch.randn(1, length, tiny.hidden_size, generator=generator)
    with torch.no_grad():
        expected = hf_mixer(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = reference(x, torch.tensor([0, length], dtype=torch.int32))
    return float((got - expected).abs().max()), float(expected.abs().max())


def _close(diff: float, scale: float) -> bool:
    return diff <= _ULPS * torch.finfo(torch.float32).eps * max(scale, 1e-6)


def _fused_layout(
    hf_mixer: nn.Module,
    reference: nn.Module,
    theirs: dict[str, torch.Tensor],
    missing: list[str],
    unexpected: list[str],
    tiny: PretrainedConfig,
) -> list[FusedMixerWeight] | None:
    """The fused weights of the HF mixer (``unexpected``: its weights the reference lacks;
    ``missing``: the reference's it lacks), by what loads into the reference and computes its
    outputs; ``None`` when no layout of the unexpected weights does."""
    free = [p for p in DELTANET_PROJECTIONS if f"{p}.weight" in missing]
    if not unexpected or not free or any(theirs[name].dim() != 2 for name in unexpected):
        return None
    options = [_candidates(name, theirs[name].shape[0], free, tiny) for name in unexpected]
    for layout in itertools.product(*options):
        held = [projection for weight in layout for projection in weight.projections]
        if sorted(held) != sorted(free):
            continue
        try:
            reference.load_state_dict(_reference_weights(theirs, layout, tiny))
        except RuntimeError:
            continue
        if _close(*_same_output(hf_mixer, reference, tiny)):
            return list(layout)
    return None


def _compare_mixer(hf_mixer: nn.Module, tiny: PretrainedConfig, class_name: str) -> list[FusedMixerWeight]:
    """Load the HF mixer's parameters into the reference's GatedDeltaNet and compare outputs: by
    name, or, where the HF mixer stacks several of the reference's projections in one weight, by
    the layout that computes the same (returned; empty when every weight loads by name)."""
    reference = _reference_mixer(tiny).to(torch.float32)
    theirs = dict(hf_mixer.state_dict())
    ours = reference.state_dict()
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    shapes = [n for n in sorted(set(ours) & set(theirs)) if ours[n].shape != theirs[n].shape]
    if shapes or ((missing or unexpected) and not all(n.endswith(".weight") for n in missing + unexpected)):
        raise HybridRefused(
            f"its {class_name} holds {sorted(theirs)}, not the qwen3_5 reference's Gated DeltaNet parameters "
            f"{sorted(ours)}" + (f" (shapes differ: {shapes})" if shapes else "")
        )
    if missing or unexpected:
        fused = _fused_layout(hf_mixer, reference, theirs, missing, unexpected, tiny)
        if fused is None:
            raise HybridRefused(
                f"its {class_name} holds {sorted(theirs)}, not the qwen3_5 reference's Gated DeltaNet parameters "
                f"{sorted(ours)}, and no stacking of the reference's projections in {unexpected} (whole or "
                "grouped by key head, in any order) computes its outputs"
            )
        return fused
    reference.load_state_dict(theirs)
    diff, scale = _same_output(hf_mixer, reference, tiny)
    if not _close(diff, scale):
        raise HybridRefused(
            f"its {class_name} has the qwen3_5 reference's Gated DeltaNet parameters but computes something else "
            f"(max abs diff {diff:.2e} on outputs of magnitude {scale:.2e})"
        )
    return []


def measure_hybrid(
    config: PretrainedConfig, tiny: PretrainedConfig, layers: nn.ModuleList, mixed: dict[int, tuple[str, nn.Module]]
) -> HybridStack:
    """The linear-attention layers of a hybrid (``mixed``: :func:`mixer_layers` of the tiny
    stack ``layers``), measured; raises :class:`HybridRefused` naming what the reference lacks."""
    names = {name for name, _ in mixed.values()}
    classes = sorted({type(module).__name__ for _, module in mixed.values()})
    if len(names) != 1 or len(classes) != 1:
        raise HybridRefused(f"its layers hold several kinds of non-attention mixer ({', '.join(classes)})")
    fused = _compare_mixer(mixed[min(mixed)][1], tiny, classes[0])
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
            fused=fused,
        ),
        attention_only=attention_only,
    )
