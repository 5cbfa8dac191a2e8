"""Tiny, seeded instances of any transformers decoder-only architecture.

Every stage test, the analyser's probes and the porting engine need a model of the
real architecture that is small enough to build, run and save in well under a second.
This module is the one place that shrinks a transformers config: it walks the config's
fields and applies generic rules keyed by the *role* of a field (a width, a head count,
an expert count, a per-layer list, a token id), never by the family's name, so a family
transformers adds later shrinks by the same rules.

Public API:

* :func:`tiny_config` -- a tiny config from a ``model_type`` or a full-size config.
* :func:`build_tiny_model` -- a seeded ``AutoModelForCausalLM`` from a (tiny) config.
* :func:`saved_checkpoint_keys` -- the keys and shapes ``save_pretrained`` writes, read
  back from the safetensors files (what a published checkpoint holds, which can differ
  from in-memory parameter names).
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from skill.scratch import scratch_dir

logger = logging.getLogger(__name__)

# Target sizes. Heads x head_dim == hidden so families that derive head_dim agree with
# families that read it explicitly.
TINY_VOCAB = 256
TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_HEAD_DIM = 16
TINY_KV_HEADS_GQA = 2
TINY_INTERMEDIATE = 128
TINY_EXPERT_INTERMEDIATE = 32
TINY_EXPERTS = 4
TINY_TOP_K = 2
TINY_WINDOW = 8
# A sparse-attention indexer's keys per query: fewer than the stage tests' documents hold.
TINY_INDEX_TOPK = 4
TINY_LORA_RANK = 16
TINY_ROPE_HEAD_DIM = 8
TINY_LAYERS = 2
MAX_TINY_LAYERS = 8

# Canonical field names (after a config's ``attribute_map``) by role.
_HIDDEN = {"hidden_size"}
_HEADS = {"num_attention_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "num_query_groups"}
_HEAD_DIM = {"head_dim", "v_head_dim", "qk_head_dim", "attention_head_dim", "kv_channels", "dim_head"}
_LAYERS = {"num_hidden_layers", "num_layers", "n_layers"}
_VOCAB = {"vocab_size"}
_EXPERT_COUNT = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k"}
_SHARED_EXPERTS = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}
_EXPERT_GROUPS = {"n_group", "num_expert_group"}
_TOPK_GROUPS = {"topk_group"}
_LORA_RANKS = {"kv_lora_rank", "q_lora_rank", "o_lora_rank"}
_ROPE_HEAD_DIM = {"qk_rope_head_dim"}
_NOPE_HEAD_DIM = {"qk_nope_head_dim"}
_WINDOWS = {
    "sliding_window",
    "sliding_window_size",
    "attention_window_size",
    "window_size",
    "local_attention_window_len",
    "attention_chunk_size",
}
# Per-layer indices into the layer stack (kept when inside the tiny stack).
_LAYER_INDEX_LISTS = {"mlp_only_layers", "moe_layers", "full_attn_idxs", "hybrid_layer_ids", "ple_layer_ids"}
# Counts of leading layers with a different structure (dense before MoE, ...).
_LEADING_LAYER_COUNTS = {"first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"}
# Fields that are lengths or ids, never widths: left alone by the generic rules.
_PROTECTED = {
    "max_position_embeddings",
    "original_max_position_embeddings",
    "model_max_length",
    "max_seq_len",
    "n_positions",
    "n_ctx",
    "chunk_size_feed_forward",
    "seed",
    "max_window_layers",
    "decoder_sparse_step",
    "interleave_moe_layer_step",
    "moe_layer_interval",
    "no_rope_layer_interval",
    "global_attn_every_n_layers",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "moe_layer_end_index",
    "num_nextn_predict_layers",
    "num_logits_to_keep",
    "pretraining_tp",
    "type_vocab_size",
}
_TOKEN_ID_SUFFIX = "_token_id"
# Sizes some default configs leave as None although the model needs them.
_NONE_FILL: dict[str, int] = {
    "head_dim": TINY_HEAD_DIM,
    "num_key_value_heads": TINY_HEADS,
    **dict.fromkeys(_EXPERT_COUNT, TINY_EXPERTS),
    **dict.fromkeys(_TOP_K, TINY_TOP_K),
    **dict.fromkeys(_SHARED_EXPERTS, 1),
}
_WIDTH_SUFFIXES = ("_size", "_dim", "_rank", "_width")


class TinyModelError(ValueError):
    """A config that cannot be shrunk or instantiated as a causal LM."""


def _canonical_names(config: PretrainedConfig) -> dict[str, str]:
    """Map each stored field name to its canonical name (``n_embd`` -> ``hidden_size``)."""
    attribute_map = getattr(type(config), "attribute_map", {}) or {}
    return {stored: canonical for canonical, stored in attribute_map.items()}


def _resolve_config(model_type_or_config: str | PretrainedConfig | Mapping[str, Any]) -> PretrainedConfig:
    if isinstance(model_type_or_config, PretrainedConfig):
        return model_type_or_config
    if isinstance(model_type_or_config, Mapping):
        data = dict(model_type_or_config)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise TinyModelError("config dict has no 'model_type'; add the family's model_type to it")
        return AutoConfig.for_model(model_type, **data)
    try:
        return AutoConfig.for_model(model_type_or_config)
    except ValueError as exc:
        raise TinyModelError(
            f"unknown model_type {model_type_or_config!r}: the installed transformers has no config class "
            "for it; pass a model_type transformers knows or a config object"
        ) from exc


def _expand_run_length(value: Any) -> list[Any] | None:
    """The per-layer list a run-length field encodes, or None when ``value`` is not one.

    GPT-Neo's ``attention_types`` is ``[[["global", "local"], 12]]``: each entry a pattern
    and how often it repeats, expanding to one kind per layer.
    """
    if not isinstance(value, list) or not value:
        return None
    expanded: list[Any] = []
    for entry in value:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            return None
        pattern, repeats = entry
        if not (isinstance(pattern, list) and pattern and isinstance(repeats, int) and repeats > 0):
            return None
        if not all(isinstance(kind, (str, int)) and not isinstance(kind, bool) for kind in pattern):
            return None
        expanded.extend(list(pattern) * repeats)
    return expanded


def _layer_count(config_dict: dict[str, Any], canonical: dict[str, str], n_layers: int) -> int:
    """The smallest layer count that shows every distinct per-layer kind of the family.

    A per-layer list (``layer_types``, ``mlp_layer_types``, ...) is cut to a prefix that
    contains each distinct value once, so a sliding/full pattern or a dense/MoE pattern
    survives the shrink; leading dense layers keep one of their own.
    """
    needed = TINY_LAYERS
    for name, value in config_dict.items():
        expanded = _expand_run_length(value)
        if expanded is not None and len(expanded) == n_layers:
            value = expanded
        if isinstance(value, list) and len(value) == n_layers and n_layers > 0:
            if not all(isinstance(v, (str, int, bool)) for v in value):
                continue
            seen: set[Any] = set()
            for index, item in enumerate(value):
                if item not in seen:
                    seen.add(item)
                    needed = max(needed, index + 1)
        elif canonical.get(name, name) in _LEADING_LAYER_COUNTS and isinstance(value, int) and value > 0:
            needed = max(needed, 2)
    if config_dict.get("sliding_window_pattern") and isinstance(config_dict["sliding_window_pattern"], int):
        needed = max(needed, int(config_dict["sliding_window_pattern"]))
    for interval_name in ("decoder_sparse_step", "interleave_moe_layer_step", "no_rope_layer_interval"):
        interval = config_dict.get(interval_name)
        if isinstance(interval, int) and interval > 1:
            needed = max(needed, interval)
    return max(1, min(needed, MAX_TINY_LAYERS, n_layers if n_layers > 0 else needed))


def _shrink_token_id(value: Any, vocab: int) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if 0 <= value < vocab else vocab - 1 - (value % 8)
    if isinstance(value, list):
        return [_shrink_token_id(v, vocab) for v in value]
    return value


def _resize_rope_lists(rope: Any, scale: float) -> Any:
    """Resize per-frequency lists (longrope ``short_factor``/``long_factor``) to the tiny rotary dim."""
    if isinstance(rope, dict):
        out = {}
        for key, value in rope.items():
            if isinstance(value, dict):
                out[key] = _resize_rope_lists(value, scale)
            elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                if key.endswith(("_factor", "factors")):
                    new_len = max(1, round(len(value) * scale))
                    out[key] = [value[i % len(value)] for i in range(new_len)]
                else:
                    out[key] = value
            else:
                out[key] = value
        return out
    return rope


def _tiny_value(
    canonical_name: str,
    value: Any,
    *,
    original: dict[str, Any],
    head_dim: int | None,
    n_layers: int,
    new_layers: int,
) -> Any:
    """The tiny value of one field, by the role its canonical name says it plays."""
    name = canonical_name
    heads = original.get("num_attention_heads")
    if value is None:
        # Some default configs leave a required size unset for the checkpoint to fill:
        # give it the tiny value (MHA for KV heads, the derived width for head_dim).
        return _NONE_FILL.get(name)
    if isinstance(value, bool):
        return value
    if name in _LAYERS:
        return new_layers
    if name in _HIDDEN and isinstance(value, int):
        return TINY_HIDDEN
    if name in _HEADS and isinstance(value, int):
        return TINY_HEADS
    if name in _KV_HEADS and isinstance(value, int):
        if value == 1:
            return 1
        return TINY_HEADS if heads is not None and value >= heads else TINY_KV_HEADS_GQA
    if name in _HEAD_DIM and isinstance(value, int):
        # A head width that is the rotary slice (MLA families set head_dim to
        # qk_rope_head_dim) shrinks with the slice.
        if value == original.get("qk_rope_head_dim") and name != "qk_head_dim":
            return TINY_ROPE_HEAD_DIM
        return TINY_HEAD_DIM
    if "rotary" in name and name.endswith("_dim") and isinstance(value, int) and head_dim:
        # A rotary slice of each head (rotary_dim) keeps its fraction of the head.
        return max(2, int(TINY_HEAD_DIM * value / head_dim) // 2 * 2)
    if name in _VOCAB or ("vocab" in name and isinstance(value, int) and value > TINY_VOCAB):
        return TINY_VOCAB if isinstance(value, int) else value
    if name in _EXPERT_COUNT and isinstance(value, int):
        # A one-expert default (HunYuan-MoE's) routes nothing and splits over no EP ranks.
        return TINY_EXPERTS if value == 1 else min(value, TINY_EXPERTS) if value > 0 else value
    if name in _TOP_K and isinstance(value, int):
        return min(value, TINY_TOP_K)
    if "expert" in name and ("num" in name or name.startswith("n_")) and isinstance(value, int) and value > 0:
        # Other expert counts (zero/identity experts, ...).
        return min(value, TINY_EXPERTS) if name not in _SHARED_EXPERTS else min(value, 1)
    if name in _SHARED_EXPERTS and isinstance(value, int):
        return min(value, 1)
    if name in _EXPERT_GROUPS and isinstance(value, int):
        return min(value, 2)
    if name in _TOPK_GROUPS and isinstance(value, int):
        return min(value, 1)
    if name in _LORA_RANKS and isinstance(value, int):
        return TINY_LORA_RANK
    if name in _ROPE_HEAD_DIM and isinstance(value, int):
        return TINY_ROPE_HEAD_DIM
    if name in _NOPE_HEAD_DIM and isinstance(value, int):
        return TINY_HEAD_DIM - TINY_ROPE_HEAD_DIM
    if name == "index_topk" and isinstance(value, int) and value > 0:
        return min(value, TINY_INDEX_TOPK)
    if name == "index_head_dim" and isinstance(value, int):
        return TINY_HEAD_DIM
    if name.endswith("_head_dim") and isinstance(value, int) and value > TINY_HEAD_DIM:
        # Other per-head widths (a linear-attention layer's key and value heads).
        return TINY_HEAD_DIM
    if name.startswith("linear_num_") and name.endswith("_heads") and isinstance(value, int) and value > 0:
        # A linear-attention layer's head counts keep their ratio (Qwen3.5's 16 key heads
        # serve 32 value heads): the largest becomes TINY_HEADS.
        largest = max(v for k, v in original.items() if k.startswith("linear_num_") and k.endswith("_heads"))
        return max(1, TINY_HEADS * value // largest)
    if name in _WINDOWS and isinstance(value, int) and value > 0:
        return min(value, TINY_WINDOW)
    if name in _LEADING_LAYER_COUNTS and isinstance(value, int):
        return min(value, max(new_layers - 1, 0))
    if name == "max_window_layers" and isinstance(value, int):
        return min(value, new_layers)
    if name in _LAYER_INDEX_LISTS and isinstance(value, list):
        return [i for i in value if isinstance(i, int) and i < new_layers]
    if name.endswith(_TOKEN_ID_SUFFIX):
        return _shrink_token_id(value, TINY_VOCAB)
    if name in _PROTECTED:
        return value
    expanded = _expand_run_length(value)
    if expanded is not None and len(expanded) == n_layers and n_layers > 0:
        # A run-length per-layer list keeps its encoding: the prefix, as one run.
        return [[[expanded[i] for i in range(new_layers)], 1]]
    if (
        isinstance(value, list)
        and len(value) == n_layers > 0
        and "heads" in name
        and isinstance(heads, int)
        and all(_is_int(v) and v == heads for v in value)
    ):
        # One query-head count per layer, each the config's (Laguna's
        # num_attention_heads_per_layer): the tiny head count on every tiny layer.
        return [TINY_HEADS] * new_layers
    if isinstance(value, list) and len(value) == n_layers and n_layers > 0:
        # Per-layer lists: keep the prefix (and shrink widths inside it).
        prefix = [value[i % len(value)] for i in range(new_layers)]
        if all(isinstance(v, int) and not isinstance(v, bool) and v > TINY_HIDDEN for v in prefix):
            return [_width(name, v) for v in prefix]
        return prefix
    if isinstance(value, int):
        if "intermediate" in name or "ffn" in name or name.endswith("hidden_size"):
            return _width(name, value)
        if head_dim is not None and value == head_dim and value > TINY_HEAD_DIM:
            # Fields tied to the head width (e.g. a query pre-attention scalar).
            return TINY_HEAD_DIM
        if name.endswith(_WIDTH_SUFFIXES) and value > TINY_INTERMEDIATE:
            return TINY_EXPERT_INTERMEDIATE
    return value


def _width(name: str, value: int) -> int:
    if any(part in name for part in ("moe", "expert", "shared")):
        return min(value, TINY_EXPERT_INTERMEDIATE)
    return min(value, TINY_INTERMEDIATE)


def _original_head_dim(config: PretrainedConfig) -> int | None:
    for name in ("head_dim", "qk_head_dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _rotary_dim(config: PretrainedConfig) -> int | None:
    value = getattr(config, "qk_rope_head_dim", None)
    if isinstance(value, int) and value > 0:
        return value
    return _original_head_dim(config)


# Scalar fields that are neutral (1.0) in many default configs; a parity test against a
# port that ignores them would pass unless they move. Matched by role words in the name.
_NEUTRAL_SCALAR_WORDS = ("multiplier", "logits_scaling", "logit_scale", "scale_emb", "scale_depth")
PERTURBED_SCALAR = 1.25


def _perturbed_scalars(config: PretrainedConfig) -> dict[str, float]:
    perturbed = {}
    for name, value in config.to_dict().items():
        if isinstance(value, float) and value == 1.0 and any(word in name for word in _NEUTRAL_SCALAR_WORDS):
            perturbed[name] = PERTURBED_SCALAR
    return perturbed


def tiny_config(
    model_type_or_config: str | PretrainedConfig | Mapping[str, Any],
    perturb_scalars: bool = False,
    **overrides: Any,
) -> PretrainedConfig:
    """A tiny config of the same class and features as the given one.

    Args:
        model_type_or_config: a ``model_type`` the installed transformers knows
            (``"mistral"``), a config object (for instance loaded from a checkpoint's
            ``config.json``, whose non-default features are kept), or a config dict with
            a ``model_type`` key.
        perturb_scalars: move neutral scalar multipliers (float fields such as
            ``embedding_multiplier`` or ``logits_scaling`` equal to 1.0) to 1.25, so a
            parity test fails for a port that ignores them. Explicit overrides win.
        **overrides: fields set after shrinking, by their canonical or stored name (for
            example ``num_hidden_layers=3`` or ``tie_word_embeddings=True``).

    Returns:
        A new config object; the input is not modified. Sizes follow generic rules:
        hidden 64, 4 heads of 16, GQA kept as 2 KV heads (MQA as 1), intermediate 128,
        expert widths 32, at most 4 experts and top-2, sliding windows of 8, token ids
        inside a 256-token vocabulary, and just enough layers to show each distinct
        per-layer kind (layer types, dense/MoE pattern), at most 8.

    Raises:
        TinyModelError: for an unknown ``model_type`` or a config the rules cannot shrink.
    """
    config = _resolve_config(model_type_or_config)
    if perturb_scalars:
        overrides = {**_perturbed_scalars(config), **overrides}
    try:
        return _shrink(config, overrides)
    except TinyModelError:
        raise
    except Exception as exc:  # attribute access on exotic configs raises its own types
        raise TinyModelError(
            f"cannot shrink {type(config).__name__}: {exc}; pass the sizes as overrides or a simpler config"
        ) from exc


def _shrink(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    config_class = type(config)
    canonical = _canonical_names(config)
    original = config.to_dict()
    original_canonical = {canonical.get(k, k): v for k, v in original.items()}
    n_layers = original_canonical.get("num_hidden_layers")
    n_layers = n_layers if isinstance(n_layers, int) else 0
    new_layers = _layer_count(original, canonical, n_layers)
    for key, value in overrides.items():
        if canonical.get(key, key) in _LAYERS and isinstance(value, int):
            # An explicit layer count also sizes the per-layer lists.
            new_layers = value
    head_dim = _original_head_dim(config)
    rotary = _rotary_dim(config)

    shrunk: dict[str, Any] = {}
    for stored_name, value in original.items():
        name = canonical.get(stored_name, stored_name)
        if isinstance(value, dict) and stored_name != "rope_parameters":
            shrunk[stored_name] = value
            continue
        if stored_name == "rope_parameters":
            new_rotary = TINY_ROPE_HEAD_DIM if getattr(config, "qk_rope_head_dim", None) else TINY_HEAD_DIM
            scale = new_rotary / rotary if rotary else 1.0
            shrunk[stored_name] = _resize_rope_lists(value, scale)
            continue
        shrunk[stored_name] = _tiny_value(
            name,
            value,
            original=original_canonical,
            head_dim=head_dim,
            n_layers=n_layers,
            new_layers=new_layers,
        )
    # Head widths of MLA must add up: qk_head_dim = nope + rope.
    if "qk_nope_head_dim" in shrunk and "qk_rope_head_dim" in shrunk and "qk_head_dim" in shrunk:
        shrunk["qk_head_dim"] = shrunk["qk_nope_head_dim"] + shrunk["qk_rope_head_dim"]
    shrunk["dtype"] = "float32"
    for key, value in overrides.items():
        stored = getattr(config_class, "attribute_map", {}).get(key, key)
        shrunk[stored] = value
    shrunk.pop("transformers_version", None)
    try:
        tiny = config_class.from_dict(shrunk)
    except Exception as exc:  # config validators raise several exception types
        raise TinyModelError(
            f"cannot build a tiny {config_class.__name__}: {exc}; pass overrides that satisfy its validation"
        ) from exc
    unshrunk = [
        stored
        for stored, value in shrunk.items()
        if stored not in overrides
        and _is_int(value)
        and value == original.get(stored)
        and value > TINY_INTERMEDIATE
        and canonical.get(stored, stored) not in _PROTECTED
        and not stored.endswith(_TOKEN_ID_SUFFIX)
    ]
    for stored in unshrunk:
        tiny = _shrink_if_width(tiny, stored, _width(canonical.get(stored, stored), shrunk[stored]))
    return tiny


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _projection_widths(config: PretrainedConfig) -> set[int] | None:
    """The widths of every projection (2-D ``nn.Linear`` or transformers ``Conv1D`` weight) of
    ``config``'s causal LM, built on the meta device; ``None`` when it cannot be built there
    without remote code."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # model constructors raise several exception types
        logger.debug("cannot build %s on the meta device: %s", type(config).__name__, exc)
        return None
    widths: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Embedding) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            widths.update(int(d) for d in weight.shape)
    return widths


def _shrink_if_width(tiny: PretrainedConfig, stored: str, small: int) -> PretrainedConfig:
    """``tiny`` with the field ``stored`` shrunk to ``small`` when the field is a projection width
    the role names do not catch (CTRL's ``dff``), measured: at its value it is the width of some
    projection, and moving it to ``small`` makes that width ``small``. Any other field (an index
    top-k, a scalar base, a count of buckets) stays as it was."""
    value = getattr(tiny, stored)
    before = _projection_widths(tiny)
    if before is None or value not in before:
        return tiny
    moved = copy.deepcopy(tiny)
    setattr(moved, stored, small)
    after = _projection_widths(moved)
    if after is None or value in after or small not in after:
        return tiny
    logger.debug("%s=%s sets a projection width: shrunk to %s", stored, value, small)
    return moved


def build_tiny_model(
    config: PretrainedConfig,
    seed: int = 0,
    attn_implementation: str = "eager",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """A seeded causal-LM instance of ``config`` (pass a tiny config) in eval mode, in fp32 on
    the CPU unless ``dtype``/``device`` say otherwise (the GPU bench builds full-size models
    where they run, without an fp32 copy on the host).

    ``eager`` attention is the default because it is the reference path every family
    implements (soft-capping, sinks and custom masks included). ``trust_remote_code``
    is needed for a config whose class comes from a checkpoint folder's own code.
    """
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=attn_implementation, dtype=dtype, trust_remote_code=trust_remote_code
            )
    except Exception as exc:  # model constructors raise several exception types
        raise TinyModelError(
            f"cannot instantiate {type(config).__name__} as a causal LM: {exc}; "
            "check the config (tiny_config overrides) or the model_type"
        ) from exc
    model.eval()
    return model


def read_safetensors_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor in the ``*.safetensors`` files of a folder, sorted by key."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return dict(sorted(shapes.items()))


def saved_checkpoint_keys(
    config_or_model: PretrainedConfig | PreTrainedModel, seed: int = 0, trust_remote_code: bool = False
) -> dict[str, tuple[int, ...]]:
    """The keys and shapes ``save_pretrained`` writes for a tiny instance, sorted by key.

    Accepts a (tiny) config, from which a seeded model is built, or a model. The files
    go to a temporary directory that is removed before returning.
    """
    model = (
        build_tiny_model(config_or_model, seed, trust_remote_code=trust_remote_code)
        if isinstance(config_or_model, PretrainedConfig)
        else config_or_model
    )
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with scratch_dir("tiny") as folder:
            model.save_pretrained(folder, safe_serialization=True)
            return read_safetensors_shapes(folder)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def config_summary(config: PretrainedConfig) -> str:
    """A one-line JSON of the sizes that matter, for logs and error messages."""
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    )
    return json.dumps({k: getattr(config, k, None) for k in keys})


def parameter_count(model: torch.nn.Module) -> int:
    """Number of parameters, to keep an eye on tiny models that are not tiny."""
    return int(sum(math.prod(p.shape) for p in model.parameters()))
