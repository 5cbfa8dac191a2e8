"""Stage 3: every Archon parameter has a checkpoint key and every checkpoint key a parameter.

The Archon model is built on the meta device (no memory), the checkpoint keys and shapes
come from the safetensors headers ``save_pretrained`` wrote for a tiny model. A check
that found no keys fails: completeness is never proven vacuously.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from skill.harness.case import ModelCase
from skill.harness.keys import is_explicit_drop, join_single, stacking_dim, tied_aliases
from skill.harness.models import (
    ArchonModel,
    build_archon_model,
    build_hf_config,
    build_hf_model,
    save_hf_checkpoint,
)
from skill.harness.results import StageRecorder, StageResult, run_stage
from skill.tiny_model import read_safetensors_shapes


def _shapes(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(tensor.shape) for key, tensor in pairs}


def stacked_shape(shapes: list[tuple[int, ...]], dim: int = 0) -> tuple[int, ...] | None:
    """The shape of ``shapes`` concatenated along ``dim`` (one shape: itself), or None when
    they cannot be concatenated (different ranks or other dimensions)."""
    if len(shapes) == 1:
        return shapes[0]
    first = shapes[0]
    if len(first) <= dim:
        return None
    rest = [s[:dim] + s[dim + 1 :] for s in shapes]
    if any(len(s) != len(first) or r != rest[0] for s, r in zip(shapes, rest, strict=True)):
        return None
    return (*first[:dim], sum(s[dim] for s in shapes), *first[dim + 1 :])


def _describe(parts: list[tuple[str, tuple[int, ...]]]) -> str:
    if len(parts) == 1:
        return str(parts[0][1])
    return " + ".join(f"{name} {shape}" for name, shape in parts) + " stacked"


def check_completeness(rec: StageRecorder, archon: ArchonModel, disk: dict[str, tuple[int, ...]]) -> None:
    """Parameter <-> key coverage, shapes, and explicit drops, from meta tensors only."""
    model, adapter = archon.model, archon.adapter
    params = dict(model.named_parameters(remove_duplicate=False))
    # Saved buffers (a router's expert_bias) are checkpoint tensors like the parameters.
    params.update({k: v for k, v in model.state_dict(keep_vars=True).items() if k not in params})
    aliases = tied_aliases(model)
    rec.check(
        "Archon parameters found",
        bool(params),
        f"{len(params)} parameters on {next(iter(params.values())).device}"
        if params
        else "the model has no parameters",
    )
    rec.check(
        "checkpoint keys found",
        bool(disk),
        f"{len(disk)} keys" if disk else "save_pretrained wrote no tensors",
    )
    if not params or not disk:
        return

    # Persistent buffers are checkpoint state too (a router's score-correction bias).
    saved = dict(params)
    saved.update((name, t) for name, t in model.state_dict(keep_vars=True).items() if name not in saved)

    # Checkpoint key -> the shapes of the parameters that fill it, in parameter order.
    # A normal key has one; a fused key (q/k/v, gate/up) one per stacked parameter.
    contributions: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    unmapped: list[str] = []
    off_disk: list[str] = []
    for name, param in saved.items():
        pairs = adapter.convert_single_to_hf(name, param)
        if not pairs:
            # A tied output projection is the embedding; converting it may name nothing.
            if name not in aliases:
                unmapped.append(name)
            continue
        shapes = _shapes(pairs)
        stray = sorted(set(shapes) - set(disk))
        # A tied output projection names the lm_head key the checkpoint omits.
        if stray and name not in aliases:
            off_disk.append(f"{name} -> {stray}")
        for key, shape in shapes.items():
            if key in disk:
                contributions.setdefault(key, []).append((name, shape))
    rec.check(
        "every Archon parameter maps to a checkpoint key",
        not unmapped and not off_disk,
        f"no HF key for {unmapped[:5]}; keys not in the checkpoint: {off_disk[:5]}"
        if unmapped or off_disk
        else f"{len(params)} parameters, {len(saved) - len(params)} persistent buffers",
    )

    produced = {
        key: stacked_shape([shape for _, shape in parts], stacking_dim(adapter, key))
        if not hasattr(adapter, "join_single_to_hf")
        else tuple(join_single(adapter, key, [params[name] for name, _ in parts]).shape)
        for key, parts in contributions.items()
    }
    orphans = sorted(k for k in set(disk) - set(produced) if not is_explicit_drop(adapter, k))
    dropped = sorted(k for k in set(disk) - set(produced) if is_explicit_drop(adapter, k))
    rec.check(
        "every checkpoint key comes from a parameter or an explicit None drop",
        not orphans,
        f"{len(orphans)} keys no parameter produces and from_hf_map does not drop: {orphans[:5]}"
        if orphans
        else f"{len(produced)} mapped, {len(dropped)} dropped on purpose {dropped[:3]}",
    )

    wrong = sorted(
        f"{k}: Archon {_describe(contributions[k])} vs checkpoint {disk[k]}" for k in produced if produced[k] != disk[k]
    )
    rec.check(
        "shapes equal",
        not wrong,
        "; ".join(wrong[:5]) if wrong else f"{len(produced)} keys",
    )

    meta_state = model.state_dict()
    full = _shapes(list(adapter.to_hf(meta_state).items()))
    missing = sorted(set(disk) - set(full) - set(dropped))
    extra = sorted(set(full) - set(disk))
    rec.check(
        "to_hf of the meta state dict gives exactly the checkpoint's keys",
        not missing and not extra and all(full[k] == disk[k] for k in full if k in disk),
        f"missing {missing[:5]}, not in the checkpoint {extra[:5]}" if missing or extra else f"{len(full)} keys",
    )


def run_completeness_stage(
    case: ModelCase, workdir: str | Path | None = None, raise_on_failure: bool = True
) -> StageResult:
    """Stage 3 against the keys ``save_pretrained`` writes for the case's tiny model."""

    def body(rec: StageRecorder) -> None:
        hf_config = build_hf_config(case)
        with tempfile.TemporaryDirectory(prefix="archon-stage3-", dir=workdir) as tmp:
            disk = read_safetensors_shapes(save_hf_checkpoint(build_hf_model(case, hf_config), tmp))
            # The adapter on the checkpoint's folder, as AReaL's engine builds it (hf_assets_path).
            archon = build_archon_model(hf_config, device="meta", hf_assets_path=tmp)
        on_meta = all(p.device.type == "meta" for p in archon.model.parameters())
        rec.check(
            "the model builds on the meta device",
            on_meta,
            "" if on_meta else "some parameters were allocated",
        )
        check_completeness(rec, archon, disk)

    return run_stage(case, 3, body, raise_on_failure)
