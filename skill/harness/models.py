"""Build the two sides every stage compares: a tiny seeded HF model and its Archon port.

The HF side goes through real files (``save_pretrained`` -> safetensors), because the
keys a published checkpoint holds can differ from the in-memory parameter names
(transformers 5 fuses MoE experts in memory and saves them per expert). The Archon side
is loaded from those files through the registered spec's adapter, exactly as a
training job would.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

import archon_models
from archon_models.base import BaseArchonModel, BaseModelArgs, BaseStateDictAdapter
from archon_models.model_spec import ModelSpec
from skill.harness.case import ModelCase
from skill.tiny_model import build_tiny_model, tiny_config

logger = logging.getLogger(__name__)

# Added to every HF weight before saving. Fresh HF weights hold all-ones norms and
# all-zero biases, so a mapping that swaps q_norm and k_norm, or two biases, would not
# change a single logit; with noise every tensor is distinct.
WEIGHT_NOISE_STD = 0.05


def build_hf_config(case: ModelCase) -> PretrainedConfig:
    """The tiny config of ``case.model_type`` (or of the case's source folder) with the
    case's overrides applied."""
    # A copy: config classes standardise what they are given in place (transformers 5.3
    # merges its own keys into a rope_parameters dict), which must not change the case.
    overrides = copy.deepcopy(case.config_overrides)
    if case.source is not None:
        from skill.analysis.inputs import resolve_source

        return tiny_config(resolve_source(case.source, case.trust_remote_code).config, **overrides)
    return tiny_config(case.model_type, **overrides)


def unknown_model_type(model_type: str) -> str | None:
    """Why a test of ``model_type`` cannot run here: the installed transformers has no config
    class for it (pyproject.toml accepts transformers from 5.3.0, older than some families);
    ``None`` when it has one."""
    import transformers
    from transformers import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return None
    return f"model_type {model_type!r} is unknown to the installed transformers {transformers.__version__}"


def unhonoured_overrides(case: ModelCase) -> list[str]:
    """The case's overrides that the installed transformers' config does not keep as given.

    A config class changes a value it does not understand: transformers 5.3's Olmo3
    config, whose model shares one RoPE across layer types, merges a per-layer-type
    ``rope_parameters`` with its own flat keys and warns that the layer-type keys are
    unrecognised. A case built on such an override proves nothing about the port under
    that transformers, so the caller skips it there. Values are compared after a JSON
    round trip (tuples and lists alike).
    """
    config = build_hf_config(case)
    changed = []
    for key, wanted in case.config_overrides.items():
        kept = getattr(config, key, None)
        if json.loads(json.dumps(kept, default=repr)) != json.loads(json.dumps(wanted, default=repr)):
            changed.append(f"{key}={wanted!r} became {kept!r}")
    return changed


def installed_model_refused(case: ModelCase) -> str | None:
    """A stage failure's skip reason when the installed transformers' own model of ``case`` is
    not the one its generated package was made from, naming what the analysis, run on that
    model, refuses. None when it refuses nothing, for a hand-edited package (whose features the
    analysis refuses by design) and for a remote-code case (which brings its own modeling code
    to every transformers).

    A package ``add`` generated had nothing refused under the pinned transformers. transformers
    5.3.0's GlmMoeDsa indexer sums unrectified scores over half-split RoPE where 5.23.0's, and
    the published GLM-5 checkpoints (``indexer_rope_interleave: true``), rotate interleaved
    pairs and rectify; the analysis measures that module against the indexer's closed form and
    refuses it. A stage failing against such a model says nothing about the port.
    """
    import inspect

    import transformers

    from skill.analysis.analyze import analyze_hf_model
    from skill.analysis.report import AnalyzeInput
    from skill.porting.hand_written import is_hand_edited

    if case.source is not None:
        return None
    model_file = inspect.getsourcefile(get_spec(case.model_type).model_class)
    if model_file is None or is_hand_edited(Path(model_file).read_text()):
        return None
    unsupported = analyze_hf_model(AnalyzeInput(source=case.model_type)).unsupported
    if not unsupported:
        return None
    refused = "; ".join(item.removeprefix("unsupported: ") for item in unsupported)
    return (
        f"transformers {transformers.__version__}'s own {case.model_type} is not the model this package was "
        f"generated from; the analysis of it refuses: {refused}"
    )


def build_hf_model(case: ModelCase, hf_config: PretrainedConfig | None = None) -> PreTrainedModel:
    """A seeded tiny HF causal LM (fp32, eager attention, eval) whose weights are all distinct."""
    config = hf_config if hf_config is not None else build_hf_config(case)
    model = build_tiny_model(config, seed=case.seed, trust_remote_code=case.trust_remote_code)
    generator = torch.Generator().manual_seed(case.seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.add_(noise * WEIGHT_NOISE_STD)
        # Saved, zero-initialised bias buffers (a router's score-correction bias) too: a port
        # that drops one, or adds it where HF does not, must change which experts are chosen.
        saved = model.state_dict()
        for name, buffer in model.named_buffers():
            if name in saved and name.endswith("bias") and buffer.is_floating_point():
                noise = torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype)
                buffer.add_(noise * WEIGHT_NOISE_STD)
    return model


def save_hf_checkpoint(model: PreTrainedModel, directory: str | Path, max_shard_size: int | str | None = None) -> Path:
    """``save_pretrained`` into ``directory`` (safetensors; sharded when ``max_shard_size`` is set)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(directory), **kwargs)
    return directory


def copy_remote_code(case: ModelCase, directory: str | Path) -> list[Path]:
    """Copy the source folder's Python files (its ``configuration_*.py``, ``modeling_*.py``
    and what they import) next to a checkpoint written for ``case``, so that
    ``from_pretrained(directory, trust_remote_code=True)`` finds the family's code.
    Nothing for a case without remote code."""
    if case.source is None or not case.trust_remote_code:
        return []
    folder = Path(case.source).expanduser()
    folder = folder.parent if folder.is_file() else folder
    copied = []
    for file in sorted(folder.glob("*.py")):
        target = Path(directory) / file.name
        if not target.exists():
            shutil.copyfile(file, target)
            copied.append(target)
    return copied


def read_hf_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, by key."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}; save the model with save_pretrained first")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def hf_gradients_as_saved(model: PreTrainedModel, directory: str | Path) -> dict[str, torch.Tensor]:
    """The gradients of ``model`` under the keys its checkpoint uses.

    Saving a copy whose parameters hold the gradients reuses transformers' own
    in-memory -> on-disk conversion, so gradients are compared under the same keys
    (and per-expert layout) as the weights, whatever the family renames or splits.
    Persistent buffers are saved as zeros: they are not trained.
    """
    grads = {name: p.grad for name, p in model.named_parameters()}
    shadow = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in shadow.named_parameters():
            grad = grads[name]
            param.copy_(torch.zeros_like(param) if grad is None else grad)
        # A saved buffer (a router's score-correction bias) gets no gradient.
        for buffer in shadow.buffers():
            if buffer.is_floating_point():
                buffer.zero_()
    save_hf_checkpoint(shadow, directory)
    return read_hf_checkpoint(directory)


def load_hf_model(
    checkpoint: str | Path, dtype: torch.dtype, device: torch.device | str, trust_remote_code: bool = False
) -> PreTrainedModel:
    """HF ``from_pretrained`` of a checkpoint folder in ``dtype`` on ``device``, eager attention
    (the reference path every family implements), eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=dtype, attn_implementation="eager", trust_remote_code=trust_remote_code
    )
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper around to() drops the bound self from its type
    return model.eval()


def get_spec(model_type: str) -> ModelSpec:
    """The registered spec (``archon_models`` import registers every package)."""
    return archon_models.get_model_spec(model_type)


@dataclass
class ArchonModel:
    """An Archon model with the pieces that built it."""

    spec: ModelSpec
    args: BaseModelArgs
    model: BaseArchonModel
    adapter: BaseStateDictAdapter


def build_archon_model(
    hf_config: PretrainedConfig,
    attn_type: str = "sdpa",
    device: torch.device | str = "cpu",
    hf_assets_path: str | Path | None = None,
) -> ArchonModel:
    """An Archon model of ``hf_config`` on ``device`` (``"meta"`` allocates nothing)."""
    spec = get_spec(hf_config.model_type)
    args = spec.model_args_class.from_hf_config(hf_config, attn_type=attn_type)
    with torch.device(device):
        model = spec.model_class(args)
    adapter = spec.state_dict_adapter_class(hf_config, None if hf_assets_path is None else str(hf_assets_path))
    return ArchonModel(spec=spec, args=args, model=model, adapter=adapter)


def load_archon_state(archon: ArchonModel, archon_state: dict[str, torch.Tensor]) -> None:
    """Load a converted state dict; every parameter must be provided, nothing extra.

    Non-persistent buffers (the RoPE cache) are computed, not loaded, so only
    parameters and persistent buffers are required.
    """
    expected = set(archon.model.state_dict())
    missing = sorted(expected - set(archon_state))
    unexpected = sorted(set(archon_state) - expected)
    if missing or unexpected:
        raise KeyError(
            f"adapter.from_hf produced a state dict that does not fit {type(archon.model).__name__}: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}; fix from_hf_map in the state_dict_adapter"
        )
    archon.model.load_state_dict(archon_state, strict=True)


def load_archon_model(
    hf_config: PretrainedConfig,
    checkpoint_dir: str | Path,
    attn_type: str = "sdpa",
) -> ArchonModel:
    """Archon model whose weights come from the HF safetensors files through ``from_hf``."""
    archon = build_archon_model(hf_config, attn_type=attn_type, hf_assets_path=checkpoint_dir)
    load_archon_state(archon, archon.adapter.from_hf(read_hf_checkpoint(checkpoint_dir)))
    return archon


def shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that hold one Parameter (tied embeddings), each group in
    registration order."""
    holders: dict[int, list[str]] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append(f"{module_name}.{name}" if module_name else name)
    return [names for names in holders.values() if len(names) > 1]


def tie_parameters(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group hold its first name's Parameter."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, param)


def load_archon_model_on(
    hf_config: PretrainedConfig,
    checkpoint_dir: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    attn_type: str = "varlen",
) -> ArchonModel:
    """The Archon model of the checkpoint on ``device`` in ``dtype``, materialised where it runs.

    Built on the meta device (no host copy, no initialisation) and given storage on
    ``device`` with ``to_empty``, as AReaL's engine materialises a model (tied weights are
    tied again: ``to_empty`` unties them); then the weights are loaded through the adapter
    and cast to ``dtype``. The computed buffers (the RoPE cache) are then recomputed by
    ``init_buffers`` in the precision the package chooses (fp32, as HF computes cos/sin), and
    the loaded ones (a router's score-correction bias) are put back from the checkpoint, in
    the dtype ``init_buffers`` gave them.
    """
    archon = build_archon_model(hf_config, attn_type=attn_type, device="meta", hf_assets_path=checkpoint_dir)
    model = archon.model
    shared = shared_parameters(model)
    model.to_empty(device=device)
    # to_empty gives every module its own new Parameter: tied weights come back untied.
    tie_parameters(model, shared)
    model.init_buffers(buffer_device=device)
    load_archon_state(archon, archon.adapter.from_hf(read_hf_checkpoint(checkpoint_dir)))
    parameters = dict(model.named_parameters())
    loaded_buffers = {k: v.clone() for k, v in model.state_dict().items() if k not in parameters}
    model.to(dtype=dtype)
    model.init_buffers(buffer_device=device)
    if loaded_buffers:
        model.load_state_dict(loaded_buffers, strict=False)
    return archon


@dataclass
class ModelPair:
    """A tiny HF model, its checkpoint on disk, and the Archon model loaded from it."""

    hf_config: PretrainedConfig
    hf_model: PreTrainedModel
    checkpoint_dir: Path
    archon: ArchonModel


def build_model_pair(case: ModelCase, workdir: str | Path, attn_type: str = "sdpa") -> ModelPair:
    """Build, save and load: the setup of the parity, checkpoint and distributed stages."""
    hf_config = build_hf_config(case)
    hf_model = build_hf_model(case, hf_config)
    checkpoint_dir = save_hf_checkpoint(hf_model, Path(workdir) / "hf_checkpoint")
    archon = load_archon_model(hf_config, checkpoint_dir, attn_type=attn_type)
    logger.info("built %s pair in %s", case.id, checkpoint_dir)
    return ModelPair(hf_config=hf_config, hf_model=hf_model, checkpoint_dir=checkpoint_dir, archon=archon)
