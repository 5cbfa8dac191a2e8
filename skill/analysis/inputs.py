"""Resolving what the caller points at, and refusing what is not a decoder-only LM.

A source is a ``model_type`` known to the installed transformers, a folder holding a
``config.json`` (optionally weights and, for remote-code models, ``modeling_*.py``), or
a path to a ``config.json``. Nothing is fetched: the network is never touched.
Remote code runs only when the caller passes ``trust_remote_code=True``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Sub-config names that make a config multimodal (a vision tower, an audio encoder, ...).
_MODALITY_MARKERS = ("vision", "audio", "image", "speech", "video", "visual", "patcher", "codec", "depth_decoder")


class AnalysisError(ValueError):
    """Bad input for the analyser: the message names the problem and what to do."""


@dataclass
class ResolvedSource:
    """A config the analyser may work on, and where it came from."""

    config: PretrainedConfig
    kind: str  # "model_type", "folder" or "config_file"
    folder: Path | None = None
    remote_code_files: list[Path] = field(default_factory=list)
    weight_index: dict[str, str] = field(default_factory=dict)


def _read_config_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise AnalysisError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix the file or point at another config"
        ) from exc
    except OSError as exc:
        raise AnalysisError(f"cannot read {path}: {exc.strerror}; check the path and its permissions") from exc
    if not isinstance(data, dict):
        raise AnalysisError(f"{path} holds a JSON {type(data).__name__}, not an object; a config.json is an object")
    if not data.get("model_type"):
        raise AnalysisError(f"{path} has no 'model_type'; add the family's model_type (e.g. \"mistral\") to the config")
    return data


def _config_from_file(path: Path, trust_remote_code: bool) -> tuple[PretrainedConfig, list[Path]]:
    data = _read_config_json(path)
    folder = path.parent
    remote_files = sorted(folder.glob("modeling_*.py")) + sorted(folder.glob("configuration_*.py"))
    auto_map = data.get("auto_map") or {}
    model_type = data["model_type"]
    if auto_map or model_type not in CONFIG_MAPPING_NAMES:
        if not remote_files and model_type not in CONFIG_MAPPING_NAMES:
            raise AnalysisError(
                f"unknown model_type {model_type!r} in {path}: the installed transformers has no such family and the "
                "folder has no configuration_*.py / modeling_*.py; upgrade transformers or add the remote code files"
            )
        if auto_map and not trust_remote_code:
            raise AnalysisError(
                f"{path} needs remote code ({', '.join(p.name for p in remote_files) or 'auto_map'}); "
                "read it, then pass trust_remote_code=True (CLI: --trust-remote-code) to execute it"
            )
    try:
        config = AutoConfig.from_pretrained(
            str(folder) if path.name == CONFIG_FILE else str(path),
            trust_remote_code=trust_remote_code,
            local_files_only=True,
        )
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise AnalysisError(f"{path} does not load as a {model_type!r} config: {exc}; fix the offending field") from exc
    return config, remote_files if auto_map else []


def _weight_index(folder: Path) -> dict[str, str]:
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return {}
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise AnalysisError(f"{index} is not valid JSON ({exc.msg}); fix or remove it") from exc
    return dict(sorted((data.get("weight_map") or {}).items()))


def resolve_source(source: str, trust_remote_code: bool = False) -> ResolvedSource:
    """Load the config ``source`` names, without network and without unasked remote code."""
    path = Path(source).expanduser()
    if path.is_dir():
        config_path = path / CONFIG_FILE
        if not config_path.is_file():
            raise AnalysisError(
                f"folder {path} has no {CONFIG_FILE}; point at a checkpoint folder that has one, "
                "a config.json file, or a model_type such as 'mistral'"
            )
        config, remote = _config_from_file(config_path, trust_remote_code)
        return ResolvedSource(config, "folder", path, remote, _weight_index(path))
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise AnalysisError(f"{path} does not exist; pass an existing config.json, a folder, or a model_type")
        config, remote = _config_from_file(path, trust_remote_code)
        return ResolvedSource(config, "config_file", path.parent, remote, _weight_index(path.parent))
    if "/" in source or "\\" in source:
        raise AnalysisError(
            f"{source!r} is neither an existing folder nor a file, and model ids are not fetched (no network); "
            "download the checkpoint's config.json yourself and pass its path"
        )
    if source not in CONFIG_MAPPING_NAMES:
        close = sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if source.replace("-", "_") in t.replace("-", "_"))
        hint = f" (close: {', '.join(close[:5])})" if close else ""
        raise AnalysisError(
            f"unknown model_type {source!r}{hint}; pass a model_type of the installed transformers "
            "or a folder with a config.json"
        )
    try:
        config = AutoConfig.for_model(source)
    except Exception as exc:  # config validators raise several exception types
        raise AnalysisError(
            f"transformers rejects the default config of {source!r} ({exc}); "
            "analyse a checkpoint's config.json of that family instead"
        ) from exc
    return ResolvedSource(config, "model_type")


def _text_sub_config_name(config: PretrainedConfig) -> str | None:
    for name in getattr(config, "sub_configs", {}) or {}:
        if "text" in name or name in ("language_config", "llm_config"):
            sub = getattr(config, name, None)
            if isinstance(sub, PretrainedConfig):
                return name
    return None


def check_decoder_only(config: PretrainedConfig, mixers_measured: bool = False) -> None:
    """Refuse encoders, encoder-decoders and multimodal configs, naming what to do instead.

    A config that shows non-attention token mixers (:func:`non_attention_config_fields`) is
    refused here too, unless ``mixers_measured``: the analysis then decides from the module
    tree (:mod:`skill.analysis.linear_attention` measures the mixers of a hybrid).
    """
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise AnalysisError(
            f"{model_type!r} is an encoder-decoder model; Archon ports decoder-only LMs. Pick a decoder-only family"
        )
    sub_configs = list(getattr(config, "sub_configs", {}) or {})
    modal = [name for name in sub_configs if any(marker in name for marker in _MODALITY_MARKERS)]
    if modal or (sub_configs and _text_sub_config_name(config) is not None):
        text_name = _text_sub_config_name(config)
        text = getattr(config, text_name, None) if text_name else None
        advice = (
            f"analyse its text model instead: model_type {text.model_type!r} (config.{text_name})"
            if isinstance(text, PretrainedConfig)
            else "analyse its language-model config on its own"
        )
        raise AnalysisError(
            f"{model_type!r} is multimodal (sub-configs: {', '.join(sub_configs)}); "
            f"Archon ports text decoders; {advice}"
        )
    # Other sub-configs (attention or FFN settings grouped in their own object) belong to
    # the one decoder stack and are analysed with it.
    if getattr(config, "is_heterogeneous", False):
        raise AnalysisError(
            f"{model_type!r} has layers of different shapes (per_layer_config); the analyser reads one layer as "
            "representative, so port this family by hand from its modeling source"
        )
    mixers = non_attention_config_fields(config)
    if mixers and not mixers_measured:
        raise hybrid_refusal(model_type, f"config: {', '.join(mixers[:4])}")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise AnalysisError(
            f"{model_type!r} is an encoder (transformers maps it to a masked-LM head; its causal-LM head is the "
            "encoder run with a causal mask); Archon ports decoder-only LMs, pick a decoder-only family"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "auto_map", None):
        raise AnalysisError(
            f"{model_type!r} has no causal-LM class in the installed transformers, so it is not a decoder-only LM; "
            "pick a family listed by `archon-port analyze --list`"
        )


def hybrid_refusal(model_type: str, what: str) -> AnalysisError:
    """The one line refusing a token mixer the references do not compute."""
    return AnalysisError(
        f"{model_type!r} is a hybrid, state-space or recurrent model ({what}); Archon ports softmax-attention "
        "decoders, and hybrids whose other layers are the qwen3_5 reference's Gated DeltaNet. Pick an "
        "attention-only family"
    )


_SSM_FIELD_WORDS = (
    "mamba",
    "ssm",
    "linear_attn",
    "linear_num",
    "linear_key",
    "linear_value",
    "conv_kernel",
    "time_step",
)


def non_attention_config_fields(config: PretrainedConfig) -> list[str]:
    """Config evidence of token mixers other than softmax attention.

    State-space and linear-attention sizes (``mamba_d_state``, ``linear_num_key_heads``,
    ...) or per-layer kinds that are not attention (``"mamba"``, ``"linear_attention"``,
    ``"conv"``) in a ``layer_types``-like list.
    """
    found = []
    for name, value in sorted(config.to_dict().items()):
        if value is None or value is False:
            continue
        if any(word in name for word in _SSM_FIELD_WORDS) or name.startswith("conv_"):
            found.append(name)
        elif name in ("layer_types", "layers_block_type", "block_types", "attention_types") and isinstance(value, list):
            kinds = sorted({str(v) for v in value if isinstance(v, str)})
            odd = [k for k in kinds if "attention" not in k or "linear" in k]
            if odd:
                found.append(f"{name}: {', '.join(odd)}")
    return found


def decoder_only_candidates() -> list[str]:
    """Causal-LM model types of the installed transformers that are not encoders, sorted.

    Multimodal, encoder-decoder, hybrid and recurrent types are filtered by
    :func:`check_decoder_only` and the module tree, not here.
    """
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def variant_types(model_type: str) -> list[str]:
    """The model types one package should cover: the same stem with ``_moe``/``_text`` suffixes.

    Found by name morphology over the installed transformers' causal-LM types (the
    convention transformers follows for dense/MoE and text-only variants), never from a
    table of families.
    """
    stem = model_type
    for suffix in ("_text", "_moe"):
        stem = stem.removesuffix(suffix)
    candidates = {stem, f"{stem}_moe", f"{stem}_text", f"{stem}_moe_text"}
    return sorted(t for t in candidates if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
