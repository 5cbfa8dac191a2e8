"""Filling the checklist from the config, the module tree, probes and the source scan.

Each section has one function. Every rule reads a role (a field whose name says
"softcap", a projection whose width is ``2 * n_heads * head_dim``, a norm whose output
is centred), never a family name, so a family added to transformers next month is read
by the same rules. Where sources disagree, the evidence list says which one won.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import sys
import typing
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from skill.activations import ACTIVATIONS, match_activation
from skill.analysis import modules as mt
from skill.analysis import probes
from skill.analysis.chunked import measure_chunked_attention
from skill.analysis.config_fields import mapped_field
from skill.analysis.differential import measure_differential
from skill.analysis.expert_input import scores_before_experts
from skill.analysis.indexer import sparse_indexer
from skill.analysis.places import (
    ATTENTION_OUTPUT,
    BLOCK_NORMS_BUILT,
    FFN_DOWN,
    FINAL_NORM_BUILT,
    MOE_BRANCH_ADD,
    SINUSOIDAL_TABLE_BUILT,
    ContractInput,
    moe_output_norm_place,
    norm_place,
    norm_width,
)
from skill.analysis.saved_names import SavedLocation, saved_locations
from skill.analysis.source_scan import SourceFacts
from skill.features import (
    MLA,
    AttentionFeatures,
    ConfigScalar,
    DifferentialAttention,
    ExpertLayout,
    FFNFeatures,
    FFNKind,
    FusedQKVLayout,
    GateUpOrder,
    HandEditPlace,
    MoEFeatures,
    NamedFact,
    NormFeatures,
    NormKind,
    NormPlacement,
    OutputGateKind,
    PositionFeatures,
    PositionKind,
    QKNormKind,
    QKNormPlacement,
    QueryPositionScale,
    RotaryDirection,
    RotaryStyle,
    RouterScoring,
    ScalarFeatures,
    SlidingWindow,
    SlidingWindowKind,
    SparseIndexer,
    WeightOrientation,
)
from skill.snippets.attention import alibi_slopes
from skill.snippets.positions import sinusoidal_positions
from skill.tiny_model import build_tiny_model

logger = logging.getLogger(__name__)

_Q = re.compile(r"(^|[._])(q|query|wq)(_proj)?$|q_proj$|q_b_proj$")
_K = re.compile(r"(^|[._])(k|key|wk)(_proj)?$|k_proj$")
_V = re.compile(r"(^|[._])(v|value|wv)(_proj)?$|v_proj$")
_O = re.compile(r"(o_proj|out_proj|dense|c_proj|wo|o|out)$")
_WINDOW_FIELDS = ("sliding_window", "sliding_window_size", "attention_window_size", "window_size")
_ACTIVATION_FIELDS = ("hidden_act", "hidden_activation", "activation_function", "activation", "mlp_hidden_act")


@dataclass
class Context:
    """Everything the detectors read, built once per analysis."""

    config: PretrainedConfig  # full size, as given
    tiny: PretrainedConfig
    model: nn.Module  # tiny instance
    anatomy: mt.LayerAnatomy
    source: SourceFacts | None
    saved_keys: dict[str, tuple[int, ...]]
    layer_prefix: str
    deep_model: nn.Module | None  # tiny widths, full depth, seeded weights on the CPU
    trust_remote_code: bool = False
    evidence: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    # An ``other`` feature -> where its hand edit goes in the Archon contract (measured).
    places: dict[str, HandEditPlace] = field(default_factory=dict)
    # An ``other`` feature -> its kind and what was measured, for a feature module that ports
    # it (skill.feature_modules claims it by the key).
    facts: dict[str, NamedFact] = field(default_factory=dict)
    # A norm inside a layer's module that an edit writes -> its Archon module inside the layer
    # (``attention.sub_norm``), for the checkpoint's module map.
    contract_norms: dict[nn.Module, str] = field(default_factory=dict)
    # Parameters (dotted, inside a layer) an edit writes on some layers only: no per-layer
    # difference (``attention.dense_bias``, the last layer's output-projection bias).
    per_layer_parameters: set[str] = field(default_factory=set)
    _scalars: dict[str, ScalarField] | None = None
    _locations: dict[str, SavedLocation] | None = None

    def saved_location(self, parameter: str) -> SavedLocation | None:
        """Where ``save_pretrained`` writes the tiny model's ``parameter`` (found by value once,
        see :func:`skill.analysis.saved_names.saved_locations`)."""
        if self._locations is None:
            self._locations = saved_locations(self.model)
        return self._locations.get(parameter)

    def scalar_fields(self) -> dict[str, ScalarField]:
        """Config scalars the forward reads, by role (measured once, see :func:`config_scalars`)."""
        if self._scalars is None:
            self._scalars = config_scalars(self)
        return self._scalars

    def scalar_role(self, role: str) -> ScalarField | None:
        return next((f for f in self.scalar_fields().values() if f.role == role), None)

    def layer_stack(self) -> tuple[nn.Module, nn.ModuleList, bool]:
        """The full-depth stack when it could be built, else the tiny one: (model, layers, full)."""
        if self.deep_model is not None:
            try:
                _, layers = mt.find_layers(self.deep_model, int(self.config.num_hidden_layers))
                return self.deep_model, layers, True
            except LookupError:
                pass
        return self.model, self.anatomy.layers, False

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.config, name, default)

    def tiny_head_dim(self) -> int:
        value = getattr(self.tiny, "head_dim", None)
        if isinstance(value, int) and value > 0:
            return value
        return self.tiny.hidden_size // self.tiny.num_attention_heads

    def tiny_kv_heads(self) -> int:
        return _kv_heads(self.tiny) or self.tiny.num_attention_heads


_KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads")


def _kv_heads(config: PretrainedConfig) -> int | None:
    for name in _KV_HEAD_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _fields_matching(config: PretrainedConfig, *words: str) -> dict[str, Any]:
    """Config fields whose name contains every word, with a set (non-None) value."""
    return {
        name: value
        for name, value in sorted(config.to_dict().items())
        if all(w in name for w in words) and value is not None and not isinstance(value, dict)
    }


# ------------------------------------------------------------- config scalars

# Scalar config fields whose name says they scale or clamp something. A default of 1.0
# (or None) hides them from the tiny model; a published checkpoint sets them.
_SCALAR_ROLE_WORDS = ("mult", "scal", "clip")
# Fields with those words that size or initialise the model rather than scale its forward.
_NOT_FORWARD_SCALARS = ("size", "dim", "multiple", "rope", "init", "loss", "coef", "aux", "dropout", "eps", "std")


@dataclass(frozen=True)
class ScalarField:
    """A scalar config field the forward reads, and the role the probes found for it.

    role: ``embedding``, ``logit``, ``attention_scaling`` (found by the factor they move),
    ``residual``, ``clip_qkv``, ``routed_scaling`` (by the field's name, once the forward is
    shown to read it) or ``unknown``; ``relation`` is ``factor = relation(field)``.
    """

    name: str
    role: str
    relation: str | None = None


def _candidate_scalars(config: PretrainedConfig) -> dict[str, Any]:
    return {
        name: value
        for name, value in sorted(config.to_dict().items())
        if any(w in name for w in _SCALAR_ROLE_WORDS)
        and not any(w in name for w in _NOT_FORWARD_SCALARS)
        and (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)))
    }


def _attention_scaling_of(model: nn.Module, n_layers: int) -> float | None:
    try:
        _, layers = mt.find_layers(model, n_layers)
    except LookupError:
        return None
    for module in layers[0].modules():
        value = getattr(module, "scaling", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and mt.is_attention(module):
            return float(value)
    return None


def _moved(old: float | None, new: float | None) -> bool:
    return _moved_pair(old, new) is not None


def _moved_pair(old: float | None, new: float | None) -> tuple[float, float] | None:
    """``(old, new)`` when both were measured and they differ, else ``None``."""
    if old is None or new is None or math.isclose(old, new, rel_tol=1e-4):
        return None
    return old, new


def final_logit_softcap(config: PretrainedConfig) -> float | None:
    """The cap of the logits' final soft-capping (a ``final...softcap...`` field), if set."""
    caps = _fields_matching(config, "final", "softcap")
    return next((float(v) for v in caps.values() if isinstance(v, (int, float)) and not isinstance(v, bool)), None)


def config_scalars(ctx: Context) -> dict[str, ScalarField]:
    """Scalar fields (multipliers, scales, clamps) the forward reads, found by moving each one.

    Each candidate field is moved in the tiny config (1.0 to 1.37, None to a small clamp)
    and a model with the same seed is built; when the logits change, the forward reads the
    field, whatever its default. Its role is the factor that moved with it: the attention
    module's ``scaling``, the embedding factor, the logit factor; failing those, the
    field's name (residual, clip, routed scaling). A field whose role none of that finds
    is named in ``other``.
    """
    tiny = ctx.tiny
    n_layers = int(tiny.num_hidden_layers)
    tokens = probes.tokens_for(tiny, 6)
    base_logits = probes.logits(ctx.model, tokens)
    base_embedding = probes.probe_embedding_scale(ctx.model, ctx.anatomy, tiny)
    cap = final_logit_softcap(tiny)
    base_logit = probes.probe_logit_multiplier(ctx.model, ctx.anatomy, tiny, cap)
    base_residual = probes.probe_residual_multiplier(ctx.model, ctx.anatomy, tiny)
    base_scaling = _attention_scaling_of(ctx.model, n_layers)
    found: dict[str, ScalarField] = {}
    for name, value in _candidate_scalars(tiny).items():
        moved = _moved_model(ctx, name, value, tokens, base_logits)
        if moved is None:
            continue
        model, new_value = moved
        role, relation = "unknown", None
        try:
            anatomy = mt.anatomy(model, n_layers)
        except LookupError:
            continue
        scaling = _attention_scaling_of(model, n_layers)
        embedding = probes.probe_embedding_scale(model, anatomy, tiny)
        logit = probes.probe_logit_multiplier(model, anatomy, tiny, cap)
        residual = probes.probe_residual_multiplier(model, anatomy, tiny)
        lowered = name.lower()
        if "clip" in lowered:
            role = "clip_qkv"
        elif "rout" in lowered:
            role = "routed_scaling"
        elif shift := _moved_pair(base_scaling, scaling):
            role, relation = "attention_scaling", probes.relation_of(value, new_value, *shift)
        elif shift := _moved_pair(base_embedding, embedding):
            role, relation = "embedding", probes.relation_of(value, new_value, *shift)
        elif shift := _moved_pair(base_logit, logit):
            role, relation = "logit", probes.relation_of(value, new_value, *shift)
        elif shift := _moved_pair(base_residual, residual):
            # The factor on both residual branches moved with the field (granite's
            # residual_multiplier, MiniCPM's scale_depth).
            role, relation = "residual", probes.relation_of(value, new_value, *shift)
        elif "residual" in lowered:
            role = "residual"
        found[name] = ScalarField(name, role, relation)
        ctx.evidence.append(
            f"config scalar {name}={value!r}: moving it changes the logits; role {role}"
            + (f" (factor = {relation.replace('x', name)})" if relation else "")
        )
        if role == "unknown":
            ctx.other.append(f"config scalar {name} changes the forward in a way the checklist cannot name")
    return found


def _nested_config(config: PretrainedConfig, parent: str) -> Any:
    return getattr(config, parent, None)


def _nested_value(config: PretrainedConfig, parent: str, key: str) -> Any:
    sub = _nested_config(config, parent)
    return sub.get(key) if isinstance(sub, dict) else getattr(sub, key, None)


def nested_forward_fields(ctx: Context) -> list[str]:
    """Scalar fields of nested configs (MPT's ``attn_config``) that the forward reads, found
    by moving each one as :func:`config_scalars` moves the top-level ones. No edit reads a
    nested field: one the family leaves unset (None) is pinned there (the port refuses a
    config that sets it); one set is named in ``other``."""
    tokens = probes.tokens_for(ctx.tiny, 6)
    base = probes.logits(ctx.model, tokens)
    pinned: list[str] = []
    for parent, sub in sorted(ctx.tiny.to_dict().items()):
        if not isinstance(sub, dict) or any(w in parent for w in _NOT_FORWARD_SCALARS):
            continue  # (RoPE parameters are measured as positions)
        for key, value in sorted((k, v) for k, v in sub.items() if isinstance(k, str)):
            if not any(w in key for w in _SCALAR_ROLE_WORDS) or any(w in key for w in _NOT_FORWARD_SCALARS):
                continue
            if not (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))):
                continue
            if not _nested_moves_logits(ctx, parent, key, value, tokens, base):
                continue
            full = _nested_value(ctx.config, parent, key)
            if full is None:
                ctx.evidence.append(f"nested config field {parent}.{key}: the forward reads it; unset here (probe)")
                pinned.append(f"{parent}.{key}")
            else:
                ctx.other.append(
                    f"nested config field {parent}.{key}={full!r} the forward reads (no edit reads nested fields)"
                )
    return pinned


def forward_switches(ctx: Context) -> dict[str, bool]:
    """Boolean config fields whose other value changes the logits, with the family's value.

    Each boolean top-level field of the tiny config is flipped, a model is built with the
    tiny model's (perturbed) weights wherever names and shapes agree, and run once; when the
    logits move, the forward reads the switch (OPT's
    ``do_layer_norm_before``, XGLM's ``scale_embedding``). Left out: ``PretrainedConfig``'s
    own bookkeeping (``return_dict``, ``output_attentions``, ...) and the fields Archon args
    map (``tie_word_embeddings``, ``attention_bias``): the port reads those. A port
    reproduces the measured value only, so it pins every switch found to it."""
    tokens = probes.tokens_for(ctx.tiny, 6)
    # Every weight moved off its initial value (HF starts biases at zero and norm weights at
    # one, which would hide a switch that drops them), then shared with each flipped model.
    generator = torch.Generator().manual_seed(0)
    base_model = copy.deepcopy(ctx.model)
    with torch.no_grad():
        for param in base_model.parameters():
            if param.is_floating_point():
                param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    base = probes.logits(base_model, tokens)
    base_state = base_model.state_dict()
    bookkeeping = set(PretrainedConfig().to_dict())
    found: dict[str, bool] = {}
    for name, value in sorted(ctx.tiny.to_dict().items()):
        if not isinstance(value, bool) or name in bookkeeping or mapped_field(ctx.tiny, name) is not None:
            continue
        full = getattr(ctx.config, name, value)
        if not isinstance(full, bool):
            continue
        config = copy.deepcopy(ctx.tiny)
        try:
            setattr(config, name, not value)
            model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
            # The base model's weights wherever the names and shapes agree: a switch that
            # only adds parameters the forward never uses (add_cross_attention) moves nothing.
            own = model.state_dict()
            shared = {k: v for k, v in base_state.items() if k in own and own[k].shape == v.shape}
            model.load_state_dict(shared, strict=False)
            with torch.no_grad():  # parameters only the flipped value has: moved off their init too
                for key, param in model.named_parameters():
                    if key not in shared and param.is_floating_point():
                        param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
            out = probes.logits(model, tokens)
        except Exception as exc:  # config validators and forwards raise several exception types
            logger.debug("flipping %s failed: %s", name, exc)
            continue
        if out.shape == base.shape and torch.allclose(out, base, atol=1e-6, rtol=1e-5):
            continue
        ctx.evidence.append(f"config switch {name}={full}: flipping it changes the logits (probe)")
        found[name] = full
    return found


def _allows_none(config_class: type, name: str) -> bool:
    """Whether the config class's annotation of ``name`` accepts ``None``."""
    try:
        hints = typing.get_type_hints(config_class)
    except (NameError, TypeError):
        hints = dict(getattr(config_class, "__annotations__", {}))
    hint = hints.get(name)
    return hint is not None and ("None" in str(hint) or "Optional" in str(hint))


def nullable_fields(ctx: Context) -> list[str]:
    """Config fields whose class allows ``None``, set here, with which HF's forward differs:
    ``None`` is no ordinary value there (no cap, no window, no query latent). Each field is
    set to ``None`` in the tiny config (the class's own checks run; a field it refills is
    left out), a model with the same seed is built and run and compared with the config's
    value and with one a few tokens feel (a window of 2, a cap of 0.5); a boolean field whose
    ``None`` acts as ``False`` is no special value. A port proves each with a generated case
    or refuses ``None`` naming it."""
    tiny = ctx.tiny
    bookkeeping = set(PretrainedConfig().to_dict())
    tokens = probes.tokens_for(tiny, 6)
    base = probes.logits(ctx.model, tokens)

    def logits_with(name: str, value: Any) -> torch.Tensor | None:
        try:
            config = type(tiny).from_dict({**tiny.to_dict(), name: value})
            if getattr(config, name, "unset") != value:
                return None  # the class refills it (a derived default): not kept
            return probes.logits(build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code), tokens)
        except Exception as exc:  # config validators and forwards raise several exception types
            logger.debug("%s=%r failed: %s", name, value, exc)
            return None

    found: list[str] = []
    for name, value in sorted(tiny.to_dict().items()):
        if value is None or name in bookkeeping or name == "rope_parameters" or name.endswith("_token_id"):
            continue
        if not _allows_none(type(tiny), name):
            continue
        without = logits_with(name, None)
        if without is None:
            continue
        others: list[torch.Tensor | None]
        if isinstance(value, bool):
            # None is special unless it acts as False.
            others = [logits_with(name, False)]
        else:
            # The config's value, and one that bites on a few tokens (a window of 2, a cap of
            # 0.5), so a field a tiny model does not feel at its default still shows.
            biting = 2 if isinstance(value, int) else 0.5 if isinstance(value, float) else None
            others = [base, logits_with(name, biting) if biting is not None else None]
        if not any(
            other is not None
            and (other.shape != without.shape or not torch.allclose(other, without, atol=1e-6, rtol=1e-5))
            for other in others
        ):
            continue
        ctx.evidence.append(f"config field {name}: the class allows None, and HF's forward differs with it (probe)")
        found.append(name)
    return found


def _nested_moves_logits(
    ctx: Context, parent: str, key: str, value: Any, tokens: torch.Tensor, base_logits: torch.Tensor
) -> bool:
    for new_value in probes.perturbed_values(value):
        config = copy.deepcopy(ctx.tiny)
        sub = _nested_config(config, parent)
        try:
            if isinstance(sub, dict):
                sub[key] = new_value
            else:
                setattr(sub, key, new_value)
            model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
            out = probes.logits(model, tokens)
        except Exception as exc:  # config validators and forwards raise several exception types
            logger.debug("moving %s.%s to %r failed: %s", parent, key, new_value, exc)
            continue
        return out.shape != base_logits.shape or not torch.allclose(out, base_logits, atol=1e-6, rtol=1e-5)
    return False


def _moved_model(
    ctx: Context, name: str, value: Any, tokens: torch.Tensor, base_logits: torch.Tensor
) -> tuple[PreTrainedModel, Any] | None:
    """A seeded tiny model with one field moved, when that changes the logits."""
    for new_value in probes.perturbed_values(value):
        config = copy.deepcopy(ctx.tiny)
        try:
            setattr(config, name, new_value)
            model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
            out = probes.logits(model, tokens)
        except Exception as exc:
            logger.debug("moving %s to %r failed: %s", name, new_value, exc)
            continue
        if out.shape != base_logits.shape or not torch.allclose(out, base_logits, atol=1e-6, rtol=1e-5):
            return model, new_value
    return None


# ------------------------------------------------------------------ attention


def _attention_projections(ctx: Context) -> dict[str, mt.Projection]:
    attention = ctx.anatomy.attention
    if attention is None:
        return {}
    hidden = ctx.tiny.hidden_size
    heads = ctx.tiny.num_attention_heads
    hd = ctx.tiny_head_dim()
    kv = ctx.tiny_kv_heads()
    roles: dict[str, mt.Projection] = {}
    found = mt.projections(attention, recurse=False)
    # A projection is a fused q/k/v by its width only where no key and value projections of
    # their own exist: with half as many KV heads as query heads, a query that also yields a
    # gate (2 * heads * head_dim, MiniCPM5-MoE's q_gate_proj) has that width too.
    separate_kv = any(_K.search(p.name.lower()) for p in found) and any(_V.search(p.name.lower()) for p in found)
    for proj in found:
        name = proj.name.lower()
        out = proj.out_features
        if (
            "qkv" in name
            or "query_key_value" in name
            or name in ("c_attn", "w_pack", "wqkv")
            or (not separate_kv and proj.in_features == hidden and out == (heads + 2 * kv) * hd and heads + 2 * kv > 3)
        ):
            roles.setdefault("qkv", proj)
        elif _Q.search(name):
            roles.setdefault("q", proj)
        elif _K.search(name):
            roles.setdefault("k", proj)
        elif _V.search(name):
            roles.setdefault("v", proj)
        elif _O.search(name) and proj.out_features == hidden:
            roles.setdefault("o", proj)
        else:
            roles.setdefault(f"other:{proj.name}", proj)
    if separate_kv and "q" not in roles and "qkv" not in roles:
        # The query under a name of its own (q_gate_proj): the one other projection of the
        # block input to the query width, or to twice it (each head's query and gate).
        queries = [
            key
            for key, proj in roles.items()
            if key.startswith("other:")
            and proj.in_features == hidden
            and proj.out_features in (heads * hd, 2 * heads * hd)
        ]
        if len(queries) == 1:
            roles["q"] = roles.pop(queries[0])
    return roles


@dataclass(frozen=True)
class _QKNorm:
    kind: QKNormKind = QKNormKind.NONE
    placement: QKNormPlacement = QKNormPlacement.NONE
    computation: NormKind | None = None
    full_width: bool = False


def _qk_norm(ctx: Context, roles: dict[str, mt.Projection]) -> _QKNorm:
    attention = ctx.anatomy.attention
    if attention is None:
        return _QKNorm()
    q_norm, _ = mt.qk_norms(attention)
    if q_norm is None:
        return _QKNorm()
    name, norm = q_norm
    width = mt.norm_width(norm) or ctx.tiny_head_dim()
    hd = ctx.tiny_head_dim()
    has_weight = isinstance(getattr(norm, "weight", None), torch.Tensor)
    computation = probes.probe_norm_kind(norm, width)
    if not has_weight:
        kind = QKNormKind.WEIGHTLESS
    elif computation is NormKind.RMS_ONE_PLUS_W:
        kind = QKNormKind.RMS_ONE_PLUS_W
    elif computation in (NormKind.LAYER_NORM, NormKind.LAYER_NORM_NO_BIAS, NormKind.LAYER_NORM_ONE_PLUS_W):
        kind = QKNormKind.LAYER_NORM
    elif width == hd:
        kind = QKNormKind.PER_HEAD_RMS
    else:
        kind = QKNormKind.FULL_WIDTH_RMS
    ctx.evidence.append(
        f"qk norm: {type(attention).__name__}.{name}, width {width} (head_dim {hd}) -> {kind.value}, "
        f"computing {computation.value}"
    )
    _check_qk_norm_eps(ctx, norm)
    placement = QKNormPlacement.BEFORE_ROPE
    if ctx.source is not None:
        before = ctx.source.qk_norm_before_rope(type(attention).__name__, name)
        if before is False:
            placement = QKNormPlacement.AFTER_ROPE
        elif before is None:
            ctx.evidence.append("qk norm placement: forward order not readable in the source; assumed before RoPE")
    return _QKNorm(kind, placement, computation, full_width=width != hd)


def _norm_eps(module: nn.Module) -> float | None:
    value = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    return value if isinstance(value, float) else None


def _check_qk_norm_eps(ctx: Context, q_norm: nn.Module) -> None:
    """The port builds the QK norms with the block norms' epsilon (``norm_eps``): one the
    QK norm holds that differs from theirs is named."""
    block = ctx.anatomy.final_norm or next(iter(ctx.anatomy.norms.values()), None)
    ours, theirs = _norm_eps(q_norm), _norm_eps(block) if block is not None else None
    if ours is not None and theirs is not None and not math.isclose(ours, theirs):
        ctx.other.append(f"QK norm epsilon {ours:g} beside the block norms' {theirs:g}")


def _window_size(ctx: Context) -> tuple[str, int] | None:
    for name in _WINDOW_FIELDS:
        value = ctx.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def _sliding_window(ctx: Context) -> SlidingWindow:
    window = _window_size(ctx)
    layer_types = [str(t) for t in (ctx.get("layer_types") or [])]
    sliding_kinds = {t for t in layer_types if "sliding" in t or "local" in t}
    if window is None and not sliding_kinds:
        return SlidingWindow()
    field_name, size = window if window else ("layer_types", None)
    tiny_window = next(
        (getattr(ctx.tiny, n) for n in _WINDOW_FIELDS if isinstance(getattr(ctx.tiny, n, None), int)), None
    )
    all_layers = False
    if tiny_window:
        all_layers = probes.probe_window_reaches_all_layers(
            ctx.model, ctx.tiny, int(tiny_window), ctx.tiny.num_hidden_layers
        )
    # A config whose RoPE parameters name a sliding_attention layer type makes any layer of
    # that type windowed, even where its default layer_types hold none (Mellum).
    named_sliding = isinstance(_rope_parameters(ctx.config).get("sliding_attention"), dict)
    if (sliding_kinds and len(set(layer_types)) > 1) or (window and layer_types and named_sliding and not all_layers):
        ctx.evidence.append(f"sliding window: config {field_name}={size} and per-layer layer_types")
        return SlidingWindow(
            kind=SlidingWindowKind.PER_LAYER_PATTERN, size=size, layer_pattern=layer_types, evidence="config"
        )
    if all_layers:
        ctx.evidence.append(f"sliding window: config {field_name}={size}; the mask probe shows it on every layer")
        return SlidingWindow(kind=SlidingWindowKind.ALL_LAYERS, size=size, evidence="config + mask probe")
    if window and tiny_window and _window_reaches_some_layer(ctx, field_name, int(tiny_window)):
        # GPT-Neo: the window applies on the layers another per-layer field (attention_layers) marks.
        kinds = _layer_kinds_field(ctx, int(tiny_window))
        if kinds is not None:
            kinds_field, windowed = kinds
            pattern = [str(kind) for kind in ctx.get(kinds_field)]
            ctx.evidence.append(
                f"sliding window: config {field_name}={size} on the layers {kinds_field} marks {windowed!r} "
                "(mask probe: the window reaches every layer when all are)"
            )
            return SlidingWindow(
                kind=SlidingWindowKind.PER_LAYER_PATTERN,
                size=size,
                layer_pattern=pattern,
                evidence=f"config {field_name} and {kinds_field} + mask probe",
                size_field=field_name if field_name != "sliding_window" else None,
                layer_kinds_field=kinds_field,
                windowed_kind=windowed if windowed != "sliding_attention" else None,
            )
        ctx.evidence.append(f"sliding window: config {field_name}={size} on some layers, chosen without layer_types")
        ctx.other.append(f"sliding window ({field_name}) on some layers only, chosen by a field other than layer_types")
        return SlidingWindow(evidence=f"config {field_name} set, mask probe: some layers only")
    ctx.evidence.append(
        f"sliding window: config {field_name}={size}, but the mask probe shows full attention; treated as none"
    )
    return SlidingWindow(evidence=f"config {field_name} set, mask probe: not applied")


def _layer_kinds_field(ctx: Context, tiny_window: int) -> tuple[str, str] | None:
    """The config field other than ``layer_types`` that lists each layer's attention kind,
    and the kind that sees the window: a list of strings, one per layer, with one
    ``local``/``sliding`` kind among others. Measured: a tiny model whose every layer has
    that kind must be windowed on every layer (the window probe of ``ALL_LAYERS``)."""
    n_layers = ctx.tiny.num_hidden_layers
    for name, value in sorted(vars(ctx.tiny).items()):
        if name == "layer_types" or not isinstance(value, list) or len(value) != n_layers:
            continue
        if not all(isinstance(kind, str) for kind in value) or len(set(value)) < 2:
            continue
        windowed = sorted({kind for kind in value if "sliding" in kind or "local" in kind})
        if len(windowed) != 1 or not isinstance(ctx.get(name), list):
            continue
        config = copy.deepcopy(ctx.tiny)
        setattr(config, name, [windowed[0]] * n_layers)
        try:
            model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
        except Exception as exc:
            logger.debug("the layer-kind probe on %s failed: %s", name, exc)
            continue
        if probes.probe_window_reaches_all_layers(model, config, tiny_window, n_layers):
            return name, windowed[0]
    return None


def _window_reaches_some_layer(ctx: Context, field_name: str, tiny_window: int) -> bool:
    """Whether the config's window changes the logits at all: a seeded tiny model whose
    window covers the whole probe sequence must give the same logits when no layer is
    windowed. Called when the window does not reach every layer."""
    length = ctx.tiny.num_hidden_layers * tiny_window + 4
    tokens = probes.tokens_for(ctx.tiny, length)
    config = copy.deepcopy(ctx.tiny)
    setattr(config, field_name, length + 1)
    try:
        windowless = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
        moved = probes.logits(windowless, tokens)
        base = probes.logits(ctx.model, tokens)
    except Exception as exc:
        logger.debug("the window probe on %s failed: %s", field_name, exc)
        return False
    return moved.shape == base.shape and not torch.allclose(moved, base, atol=1e-6, rtol=1e-5)


def _scalar_source(ctx: Context, role: str) -> ConfigScalar | None:
    """The config field the probes found for a factor's role, with its relation."""
    found = ctx.scalar_role(role)
    if found is None:
        return None
    if found.relation is None:
        ctx.other.append(f"{role.replace('_', ' ')} set by config field {found.name} in a relation not measured")
        return ConfigScalar(field=found.name)
    return ConfigScalar(field=found.name, relation=found.relation)


def _custom_scaling(ctx: Context) -> tuple[bool, ConfigScalar | None, float | None]:
    """Whether the scores' scale is not head_dim**-0.5 or is set by a config field, the
    field, and a constant scale no field sets (measured where the module names no scale).

    A field the forward reads (granite's attention_multiplier, gemma's
    query_pre_attn_scalar) makes the scaling custom even where its default gives
    head_dim**-0.5: a checkpoint sets it.
    """
    source = _scalar_source(ctx, "attention_scaling")
    attention = ctx.anatomy.attention
    scaling = getattr(attention, "scaling", None) if attention is not None else None
    if not isinstance(scaling, (int, float)):
        measured = _measured_score_scale(ctx) if source is None else None
        if measured is None:
            return source is not None, source, None
        default = ctx.tiny_head_dim() ** -0.5
        if math.isclose(measured, default, rel_tol=1e-3):
            return False, None, None
        constant = round(measured, 6)
        ctx.evidence.append(f"attention scaling {constant:.4g} vs head_dim**-0.5 {default:.4g}, measured, no field")
        return True, None, constant
    # Candidate head widths: the config's, MLA's query-key width, the module's own.
    widths = {ctx.tiny_head_dim()}
    for name in ("qk_head_dim", "head_dim"):
        for holder in (ctx.tiny, attention):
            value = getattr(holder, name, None)
            if isinstance(value, int) and value > 0:
                widths.add(value)
    default = ctx.tiny_head_dim() ** -0.5
    if any(math.isclose(float(scaling), w**-0.5, rel_tol=1e-4) for w in widths) and source is None:
        return False, None, None
    if source is None:
        match = probes.matching_field(ctx.tiny, float(scaling))
        source = ConfigScalar(field=match[0], relation=match[1]) if match else None
    ctx.evidence.append(
        f"attention scaling {scaling:.4g} vs head_dim**-0.5 {default:.4g} (field {source.field if source else None})"
    )
    return True, source, None


def _measured_score_scale(ctx: Context) -> float | None:
    """Layer 0's score scale from its attention weights, for an attention module that names
    no ``scaling`` (GPT-Neo multiplies by nothing). Needs separate query and key
    projections; ``None`` where the scores are no plain scaled ``q . k`` (RoPE, QK norms)."""
    attention = ctx.anatomy.attention
    roles = _attention_projections(ctx)
    if attention is None or "q" not in roles or "k" not in roles:
        return None
    try:
        return probes.probe_score_scale(ctx.model, attention, roles["q"].module, roles["k"].module, ctx.tiny)
    except (RuntimeError, TypeError, ValueError) as exc:
        logger.debug("the score-scale probe failed: %s", exc)
        return None


@dataclass(frozen=True)
class _OutputGate:
    kind: OutputGateKind | None = None
    key: str | None = None  # the gate projection's module in a layer (self_attn.gate_proj)
    bias: bool = False


def _query_gate_channels(heads: int, head_dim: int) -> torch.Tensor:
    """The gate's channels of a query projection whose rows hold, head after head, the
    head's query then its gate (``view(..., heads, 2 * head_dim).chunk(2, -1)``)."""
    return (torch.arange(heads).unsqueeze(1) * 2 * head_dim + head_dim + torch.arange(head_dim)).flatten()


def _output_gate(ctx: Context, roles: dict[str, mt.Projection]) -> _OutputGate | None:
    """The attention output's gate, or ``None``: where it comes from, its function (probed
    by pinning the gate projection's output, :func:`probes.probe_output_gate_function`)
    and its granularity (one value per head or per head channel)."""
    if isinstance(ctx.get("kv_lora_rank"), int):
        return None  # MLA's query width is its own (nope + rope), not a gate
    q = roles.get("q")
    heads, hd = ctx.tiny.num_attention_heads, ctx.tiny_head_dim()
    if q is not None and q.out_features == 2 * heads * hd:
        out = roles.get("o")
        key = f"{ctx.anatomy.attention_name}.{q.name}" if ctx.anatomy.attention_name else q.name
        function = None
        if out is not None and q.orientation == "out_in":
            channels = _query_gate_channels(heads, hd)
            function = probes.probe_output_gate_function(ctx.model, q.module, out.module, ctx.tiny, channels)
        if function is None:
            ctx.evidence.append("attention output gate: the query projection also yields a gate no probe read")
            return _OutputGate(OutputGateKind.IN_QUERY)
        kind = OutputGateKind(f"{function}_in_query")
        ctx.evidence.append(
            f"attention output gate: the second half of each head's rows of {key} (bias {q.bias}), probed {function}"
        )
        return _OutputGate(kind, key, q.bias)
    gates = [proj for key, proj in roles.items() if _is_gate_projection(ctx, key, proj)]
    if not gates:
        return None
    gate = gates[0]
    key = f"{ctx.anatomy.attention_name}.{gate.name}" if ctx.anatomy.attention_name else gate.name
    out = roles.get("o")
    function = None
    if len(gates) == 1 and out is not None and gate.orientation == "out_in":
        function = probes.probe_output_gate_function(ctx.model, gate.module, out.module, ctx.tiny)
    if function is None:
        ctx.evidence.append(f"attention output gate: {key} scales the output by no known gate function")
        return _OutputGate(OutputGateKind.UNMATCHED, key, gate.bias)
    per_head = gate.out_features != ctx.tiny.num_attention_heads * ctx.tiny_head_dim()
    kind = OutputGateKind(f"{function}_per_{'head' if per_head else 'element'}")
    ctx.evidence.append(f"attention output gate: {key} (bias {gate.bias}), probed {kind.value}")
    return _OutputGate(kind, key, gate.bias)


def _is_gate_projection(ctx: Context, role: str, proj: mt.Projection) -> bool:
    """An extra projection of the layer input to one value per head (or per head channel)."""
    if not role.startswith("other:"):
        return False
    heads, hd = ctx.tiny.num_attention_heads, ctx.tiny_head_dim()
    # Layer 0's own head count, where layers differ (a per-layer heads list).
    own = getattr(ctx.anatomy.attention, "num_heads", None)
    counts = {heads} | ({own} if isinstance(own, int) else set())
    widths = set(counts) | {n * hd for n in counts}
    return proj.in_features == ctx.tiny.hidden_size and proj.out_features in widths


def uses_rope(ctx: Context) -> bool:
    """A rotary module in the model, or an attention class that calls a rotary helper itself."""
    if probes.rotary_modules(ctx.model):
        return True
    attention = ctx.anatomy.attention
    return attention is not None and ctx.source is not None and ctx.source.applies_rotary(type(attention).__name__)


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module``'s submodule at a dotted ``path`` (an attention inside its wrapper), or ``None``."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _layer_attentions(ctx: Context, layers: nn.ModuleList) -> list[nn.Module] | None:
    name = ctx.anatomy.attention_name
    found = []
    for layer in layers:
        module = _submodule(layer, name) if name else None
        if not isinstance(module, nn.Module):
            module = next((child for _, child in layer.named_children() if mt.is_attention(child)), None)
        if module is None:
            return None
        found.append(module)
    return found


def _nope_layers(ctx: Context) -> list[int]:
    """Layers whose attention output does not move when only the positions move.

    Probed on the full-depth stack (tiny widths) where it builds, so the indices are
    the real model's; otherwise on the tiny stack, which shows one period of the pattern.
    """
    if not uses_rope(ctx):
        return []
    model, layers, full = ctx.layer_stack()
    attentions = _layer_attentions(ctx, layers)
    result = probes.probe_rotary_layers(model, attentions, ctx.tiny) if attentions else None
    if result is None:
        ctx.evidence.append("layers without RoPE: the position probe reached no attention output; none reported")
        return []
    flags, method = result
    nope = [index for index, rotates in enumerate(flags) if not rotates]
    depth = "full-depth" if full else "tiny"
    if nope:
        ctx.evidence.append(f"layers without RoPE (position probe, {method}, {depth} stack of {len(flags)}): {nope}")
        if not full:
            ctx.other.append("layers without RoPE measured on the tiny stack only (full-depth pattern unknown)")
    return nope


def nope_rule(config: Any, nope: list[int]) -> tuple[str | None, str | None]:
    """The config fact that reproduces the measured layers without RoPE: a list field with
    one entry a layer, falsy exactly on those layers (SmolLM3's ``no_rope_layers``), or the
    one ``layer_types`` value held exactly by those layers (EXAONE-4's full-attention
    layers). ``(field, None)``, ``(None, layer_type)`` or ``(None, None)``."""
    if not nope:
        return None, None
    n_layers = getattr(config, "num_hidden_layers", None)
    for name, value in sorted(config.to_dict().items()):
        if (
            name != "layer_types"
            and isinstance(value, list)
            and len(value) == n_layers
            and all(isinstance(v, (bool, int)) and v in (0, 1) for v in value)
            and [i for i, v in enumerate(value) if not v] == nope
        ):
            return name, None
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == n_layers:
        for kind in sorted({str(t) for t in layer_types}):
            if [i for i, t in enumerate(layer_types) if t == kind] == nope:
                return None, kind
    return None, None


def _nope_with_rule(ctx: Context) -> tuple[list[int], str | None, str | None]:
    """The layers without RoPE and the config fact that says which they are (measured on
    the full-depth stack, so compared with the full config; else the tiny one)."""
    nope = _nope_layers(ctx)
    if not nope:
        return nope, None, None
    full = ctx.layer_stack()[2]
    field_name, layer_type = nope_rule(ctx.config if full else ctx.tiny, nope)
    if field_name is not None:
        ctx.evidence.append(f"layers without RoPE: config {field_name} is 0 exactly on them")
    elif layer_type is not None:
        ctx.evidence.append(f"layers without RoPE: exactly the layer_types {layer_type!r} layers")
    else:
        ctx.evidence.append("layers without RoPE: no config field reproduces them")
    return nope, field_name, layer_type


def _measured_kv_heads(ctx: Context, roles: dict[str, mt.Projection], heads: int | None, kv: int | None) -> int | None:
    """KV heads as the projections are built, at full size.

    A config may keep a KV-head count that the modeling code overrides (multi-query
    attention behind a ``multi_query`` flag): the key projection's width, or the fused
    projection's width beyond the queries, says how many KV heads there are. The tiny
    count maps back to full size: one stays one, all heads stay all heads.
    """
    hd = ctx.tiny_head_dim()
    tiny_heads = ctx.tiny.num_attention_heads
    if "k" in roles:
        measured = roles["k"].out_features / hd
    elif "qkv" in roles:
        measured = (roles["qkv"].out_features / hd - tiny_heads) / 2
    else:
        return kv
    if measured != int(measured) or measured <= 0 or isinstance(ctx.get("kv_lora_rank"), int):
        return kv
    measured = int(measured)
    if measured == ctx.tiny_kv_heads():
        return kv
    full: int | None
    if measured == 1:
        full = 1
    elif measured == tiny_heads:
        full = heads
    else:
        return kv
    ctx.evidence.append(
        f"KV heads: the projections hold {measured} of {tiny_heads} heads in the tiny model although the config "
        f"gives {ctx.tiny_kv_heads()}; {full} at full size"
    )
    return full


def _clip_qkv(ctx: Context) -> tuple[float | None, str | None]:
    found = ctx.scalar_role("clip_qkv")
    if found is None:
        return None, None
    value = ctx.get(found.name)
    return (float(value) if isinstance(value, (int, float)) else None), found.name


# A clamp far below what a tiny model's projections output, so that clamping changes them.
_CLIP_PROBE_LIMIT = 1e-4


def _clip_after_qk_norm(ctx: Context, clip_field: str) -> bool | None:
    """Whether the forward clamps q/k after the QK norm (OLMoE) or before it: probed on a
    tiny model whose config sets the clamp (the default config may leave it unset)."""
    attention = ctx.anatomy.attention
    path = next((name for name, module in ctx.model.named_modules() if module is attention), None)
    if attention is None or path is None:
        return None
    config = copy.deepcopy(ctx.tiny)
    setattr(config, clip_field, _CLIP_PROBE_LIMIT)
    try:
        model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
        q_norm, _ = mt.qk_norms(model.get_submodule(path))
    except Exception as exc:
        logger.debug("clip/QK-norm order probe failed: %s", exc)
        return None
    if q_norm is None:
        return None
    after = probes.probe_clip_after_qk_norm(model, q_norm[1], config, _CLIP_PROBE_LIMIT)
    ctx.evidence.append(f"q/k clamp {'after' if after else 'before'} the QK norm, from the clamp probe: {after}")
    return after


_QKV_ORDERS = ("qkv", "qvk", "kqv", "kvq", "vqk", "vkq")


def qkv_rows(heads: int, kv: int, head_dim: int, blocks: int, order: str) -> dict[str, torch.Tensor]:
    """Rows of a fused q/k/v projection that hold each query, key and value feature, for a
    layout of ``blocks`` equal blocks, each holding its share of the query heads, key heads
    and value heads in ``order`` (``"qkv"``: stacked with one block, grouped with one
    block per KV head; CodeGen: four blocks of query, value, key). Per role, one row index
    per (head, feature), heads in order."""
    per_block = {"q": heads // blocks, "k": kv // blocks, "v": kv // blocks}
    block_rows = (heads + 2 * kv) // blocks * head_dim
    offset = 0
    rows: dict[str, torch.Tensor] = {}
    for role in order:
        count = per_block[role]
        head = torch.arange(count * blocks).repeat_interleave(head_dim)
        feature = torch.arange(head_dim).repeat(count * blocks)
        rows[role] = (head // count) * block_rows + offset + (head % count) * head_dim + feature
        offset += count * head_dim
    return rows


@dataclass(frozen=True)
class _QKVProbe:
    """What the probes read from one fused q/k/v projection, per query head."""

    values: torch.Tensor  # [heads, head_dim]: the row of each value feature
    queries: list[set[int]]  # the rows feeding each head's query
    keys: list[set[int]]  # the rows feeding each head's key


def _probe_qkv(
    model: nn.Module, attention: nn.Module, roles: dict[str, mt.Projection], config: Any
) -> _QKVProbe | None:
    qkv, out = roles.get("qkv"), roles.get("o")
    heads = config.num_attention_heads
    if qkv is None or out is None:
        return None
    values = probes.probe_value_rows(model, attention, qkv, out, config)
    qk_norms = [pair[1] for pair in mt.qk_norms(attention) if pair is not None]
    rows = probes.probe_query_rows(model, attention, qkv, out, config, heads, bypassed=qk_norms)
    if values is None or rows is None or values.numel() % heads:
        return None
    values = values.reshape(heads, -1)
    queries, keys_values = rows
    keys = [kv_rows - set(values[h].tolist()) for h, kv_rows in enumerate(keys_values)]
    return _QKVProbe(values=values, queries=queries, keys=keys)


def _match_qkv(probe: _QKVProbe, heads: int, kv: int, head_dim: int) -> tuple[int, str] | None:
    """The (blocks, order) layout whose rows the probe read: fewest blocks first."""
    per_kv = heads // kv
    for blocks in (b for b in range(1, kv + 1) if kv % b == 0 and heads % b == 0):
        for order in _QKV_ORDERS:
            rows = qkv_rows(heads, kv, head_dim, blocks, order)
            q, k, v = (rows[r].reshape(-1, head_dim) for r in "qkv")
            if all(
                torch.equal(probe.values[h], v[h // per_kv])
                and probe.queries[h] == set(q[h].tolist())
                and probe.keys[h] == set(k[h // per_kv].tolist())
                for h in range(heads)
            ):
                return blocks, order
    return None


def _doubled_heads_layout(ctx: Context, heads: int, kv: int, head_dim: int) -> tuple[int, str] | None:
    """The (blocks, order) the fused q/k/v rows of the doubled-heads model follow, or None."""
    doubled = _doubled_heads(ctx)
    if doubled is None:
        return None
    model, module, roles, config = doubled
    probe = _probe_qkv(model, module, roles, config)
    return None if probe is None else _match_qkv(probe, 2 * heads, 2 * kv, head_dim)


def _doubled_heads(ctx: Context) -> tuple[nn.Module, nn.Module, dict[str, mt.Projection], Any] | None:
    """A second tiny model with twice the heads (and KV heads, and width, so head_dim
    stays): whether a block count follows the head count or stays fixed."""
    attention = ctx.anatomy.attention
    path = next((name for name, module in ctx.model.named_modules() if module is attention), None)
    if path is None:
        return None
    config = copy.deepcopy(ctx.tiny)
    try:
        config.hidden_size = 2 * ctx.tiny.hidden_size
        config.num_attention_heads = 2 * ctx.tiny.num_attention_heads
        if "head_dim" in config.to_dict() and isinstance(config.head_dim, int):
            config.head_dim = ctx.tiny_head_dim()
        for name in _KV_HEAD_FIELDS:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                setattr(config, name, 2 * value)
        model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
        doubled = model.get_submodule(path)
    except Exception as exc:
        logger.debug("doubled-heads model failed: %s", exc)
        return None
    names = {role: p.name for role, p in _attention_projections(ctx).items()}
    found = {p.name: p for p in mt.projections(doubled, recurse=False)}
    roles = {role: found[name] for role, name in names.items() if name in found}
    return model, doubled, roles, config


def fused_qkv_layout(ctx: Context, roles: dict[str, mt.Projection]) -> tuple[FusedQKVLayout, int | None, str | None]:
    """The row layout of a fused q/k/v projection, from the rows that feed each head's
    query, key and value (two probes on layer 0's attention). Returns the layout and, for
    ``blocked``, its fixed block count and the order of q, k, v inside a block.

    Every candidate is ``blocks`` equal blocks, each holding its share of the query, key
    and value heads in some order (:func:`qkv_rows`). ``stacked``: one block, q k v
    (Phi-3, Falcon MQA; also with one KV head, where the grouped rows are the same).
    ``grouped``: one block per KV head, q k v (GPT-NeoX, Bloom, Falcon's new
    architecture). ``blocked``: a block count that stays fixed when the heads double,
    any order (CodeGen: 4 blocks of q, v, k). A second tiny model with twice the heads
    tells a count that follows the KV heads from a fixed one.
    """
    qkv = roles.get("qkv")
    if qkv is None:
        return FusedQKVLayout.NONE, None, None
    hd, heads = ctx.tiny_head_dim(), ctx.tiny.num_attention_heads
    kv_float = (qkv.out_features / hd - heads) / 2
    attention = ctx.anatomy.attention
    if "o" not in roles or attention is None or kv_float != int(kv_float) or kv_float <= 0 or heads % kv_float:
        ctx.evidence.append("fused q/k/v layout: no output projection or no whole number of KV heads to probe")
        return FusedQKVLayout.OTHER, None, None
    kv = int(kv_float)
    probe = _probe_qkv(ctx.model, attention, roles, ctx.tiny)
    if probe is None:
        ctx.evidence.append("fused q/k/v layout: the row probes could not read the attention output")
        return FusedQKVLayout.OTHER, None, None
    match = _match_qkv(probe, heads, kv, hd)
    if match is None:
        ctx.evidence.append("fused q/k/v layout: the probed rows follow no block layout of q, k and v")
        return FusedQKVLayout.OTHER, None, None
    blocks, order = match
    if blocks == 1 and kv > 1:
        layout = FusedQKVLayout.STACKED if order == "qkv" else FusedQKVLayout.OTHER
        ctx.evidence.append(f"fused q/k/v layout: rows probed -> one block of {order} ({kv} KV heads): {layout.value}")
        return layout, None, None
    second = _doubled_heads_layout(ctx, heads, kv, hd)
    if blocks == 1 and second in ((1, order), None):
        # One KV head: grouped rows read the same as stacked ones. Twice the heads has two
        # KV heads, which tells them apart; a model that keeps one whatever its config says
        # (Falcon's multi_query) matches no layout there and stays stacked.
        layout = FusedQKVLayout.STACKED if order == "qkv" else FusedQKVLayout.OTHER
        ctx.evidence.append(
            f"fused q/k/v layout: rows probed -> one block of {order} ({kv} KV heads); with twice the heads "
            f"{second[0] if second else 'unread'} block: {layout.value}"
        )
        return layout, None, None
    if blocks == kv and order == "qkv" and second in ((2 * blocks, order), None):
        # One block per KV head; unread at twice the heads, the value rows alone said so before.
        layout, fixed = FusedQKVLayout.GROUPED, None
    elif second == (blocks, order):
        layout, fixed = FusedQKVLayout.BLOCKED, blocks
    else:
        layout, fixed = FusedQKVLayout.OTHER, None
    ctx.evidence.append(
        f"fused q/k/v layout: rows probed -> {blocks} blocks of {order} ({kv} KV heads); with twice the heads "
        f"{second[0] if second else 'unread'} blocks: {layout.value}"
    )
    return layout, fixed, order if layout is FusedQKVLayout.BLOCKED else None


def _config_path(config: PretrainedConfig, path: str) -> Any:
    """A config value by path: a field, or ``rope_parameters.<key>``."""
    if path.startswith("rope_parameters."):
        rope = getattr(config, "rope_parameters", None)
        return rope.get(path.split(".", 1)[1]) if isinstance(rope, dict) else None
    return getattr(config, path, None)


def _with_config_path(config: PretrainedConfig, path: str, value: Any) -> PretrainedConfig:
    moved = copy.deepcopy(config)
    if path.startswith("rope_parameters."):
        moved.rope_parameters = {**moved.rope_parameters, path.split(".", 1)[1]: value}
    else:
        setattr(moved, path, value)
    return moved


def _numeric_paths(config: PretrainedConfig) -> dict[str, float]:
    """Numeric config values by path: the flat ``rope_parameters`` entries, then the fields."""
    found: dict[str, float] = {}
    rope = getattr(config, "rope_parameters", None)
    sources = [("rope_parameters.", rope)] if isinstance(rope, dict) else []
    sources.append(("", config.to_dict()))
    for prefix, values in sources:
        for name, value in sorted(values.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
                found[f"{prefix}{name}"] = value
    return found


def _log_floor_scale(beta: float, period: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def scale(positions: torch.Tensor) -> torch.Tensor:
        return 1 + beta * torch.log(1 + torch.floor(positions / period))

    return scale


def _query_projections(ctx: Context, model: nn.Module) -> list[nn.Module]:
    """Every layer's query projection in ``model`` (a tiny model of the same config)."""
    q = _attention_projections(ctx).get("q")
    layer0 = ctx.anatomy.layers[0]
    relative = next((n for n, m in layer0.named_modules() if q is not None and m is q.module), None)
    if relative is None:
        return []
    _, layers = mt.find_layers(model, int(ctx.tiny.num_hidden_layers))
    return [layer.get_submodule(relative) for layer in layers]


def query_position_scale(ctx: Context) -> QueryPositionScale | None:
    """Queries scaled by their absolute position (RoPE aside), and the config fields setting it.

    The logits of a short sequence are compared at positions near 0 and near the end of the
    context with RoPE pinned (:func:`skill.analysis.probes.pinned_rope_logits`); where they
    differ, the numeric config value whose zeroing removes the difference is the scale's
    ``beta``, and ``q * (1 + beta * log(1 + floor(p / period)))`` applied to the queries of
    a model without it must give the same far logits, for one config value as the period
    (each candidate tried on a window that straddles a multiple of it). A dependence no
    such pair explains is named in ``other``."""
    tiny = ctx.tiny
    length = probes.ABSOLUTE_PROBE_LENGTH
    limit = getattr(tiny, "max_position_embeddings", None)
    far = limit - length if isinstance(limit, int) and limit > 64 * length else 1 << 16
    measured = probes.pinned_rope_logits(ctx.model, tiny, far)
    if measured is None or torch.allclose(*measured, atol=1e-6, rtol=1e-5):
        return None
    paths = _numeric_paths(tiny)
    for beta_path, beta in paths.items():
        try:
            without = build_tiny_model(
                _with_config_path(tiny, beta_path, type(beta)(0)), seed=0, trust_remote_code=ctx.trust_remote_code
            )
        except Exception as exc:  # config validators raise several exception types
            logger.debug("zeroing %s failed: %s", beta_path, exc)
            continue
        plain = probes.pinned_rope_logits(without, tiny, far)
        # Zeroed, the value must remove the dependence and change nothing near position 0
        # (a size or a constant the whole forward reads is no such scale).
        if plain is None or not torch.allclose(*plain, atol=1e-6, rtol=1e-5):
            continue
        if not torch.allclose(plain[0], measured[0], atol=1e-6, rtol=1e-5):
            continue
        queries = _query_projections(ctx, without)
        for period_path, period in paths.items():
            if period_path == beta_path or not isinstance(period, int) or period < 2 or period > far:
                continue
            start = (far // period) * period - length // 2  # positions on both sides of a multiple
            ours = probes.pinned_rope_logits(ctx.model, tiny, start)
            theirs = probes.pinned_rope_logits(
                without, tiny, start, query_scale=_log_floor_scale(float(beta), period), query_modules=queries
            )
            if ours is not None and theirs is not None and torch.allclose(ours[1], theirs[1], atol=1e-5, rtol=1e-4):
                ctx.evidence.append(
                    f"queries scaled by absolute position: 1 + {beta_path} * log(1 + floor(p / {period_path})) "
                    "(probe, RoPE pinned)"
                )
                return QueryPositionScale(beta_field=beta_path, period_field=period_path)
        ctx.other.append(f"queries scaled by absolute position by {beta_path} in a form no probe matched")
        return None
    ctx.other.append("attention reads absolute positions beyond RoPE (no config value found that sets it)")
    return None


# Llama 4's attention temperature, measured with its period shrunk to a few tokens.
_TEMPERATURE_LENGTH = 12
_TEMPERATURE_PERIOD = 3


def _scaled_query_logits(
    model: nn.Module, tokens: torch.Tensor, queries: list[nn.Module], factor: torch.Tensor
) -> torch.Tensor | None:
    """``model``'s logits with the output of each of ``queries`` multiplied by ``factor`` (one per token)."""

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return output * factor.to(output.dtype).view(1, -1, *([1] * (output.dim() - 2)))

    handles = [q.register_forward_hook(hook) for q in queries]
    try:
        return probes.logits(model, tokens)
    except Exception as exc:  # a remote-code forward raises several exception types
        logger.debug("the temperature probe's forward failed: %s", exc)
        return None
    finally:
        for handle in handles:
            handle.remove()


def nope_query_temperature(ctx: Context, nope_layers: list[int]) -> QueryPositionScale | None:
    """Queries of the layers without RoPE scaled by their position in the sequence (Llama 4's
    ``1 + beta * log(1 + floor((p + 1) / period))``), and the config fields setting it.

    The period is far beyond any tiny sequence, so the tiny model never shows the scale: each
    integer config value past the probe's length is shrunk to a few tokens in turn; one whose
    shrinking moves the logits is the period when the model with it equals the tiny model (the
    period at its own value) whose NoPE layers' query projections are multiplied by that form,
    for one other config value as ``beta`` and an offset of 0 or 1. The boolean field whose
    flip removes the scale is its switch. None: no such scale (or one this form does not fit)."""
    tiny = ctx.tiny
    layers = [i for i in nope_layers if i < int(tiny.num_hidden_layers)]
    if not layers:
        return None
    tokens = probes.tokens_for(tiny, _TEMPERATURE_LENGTH)
    base = probes.logits(ctx.model, tokens)
    positions = torch.arange(_TEMPERATURE_LENGTH, dtype=torch.float64)
    paths = _numeric_paths(tiny)
    for period_path, period in paths.items():
        if not isinstance(period, int) or isinstance(period, bool) or period <= 4 * _TEMPERATURE_LENGTH:
            continue
        shrunk_config = _with_config_path(tiny, period_path, _TEMPERATURE_PERIOD)
        try:
            shrunk = build_tiny_model(shrunk_config, seed=0, trust_remote_code=ctx.trust_remote_code)
            moved = probes.logits(shrunk, tokens)
        except Exception as exc:  # config validators raise several exception types
            logger.debug("shrinking %s failed: %s", period_path, exc)
            continue
        if moved.shape != base.shape or torch.allclose(moved, base, atol=1e-6, rtol=1e-5):
            continue
        queries = _query_projections(ctx, ctx.model)
        if len(queries) != int(tiny.num_hidden_layers):
            return None
        nope_queries = [queries[i] for i in layers]
        for beta_path, beta in paths.items():
            if beta_path == period_path or isinstance(beta, int):
                continue
            for offset in (0, 1):
                factor = _log_floor_scale(float(beta), _TEMPERATURE_PERIOD)(positions + offset)
                scaled = _scaled_query_logits(ctx.model, tokens, nope_queries, factor)
                if scaled is None or not torch.allclose(scaled, moved, atol=1e-5, rtol=1e-4):
                    continue
                switch = _scale_switch(ctx, shrunk_config, tokens, base)
                ctx.evidence.append(
                    f"queries of the layers without RoPE scaled by 1 + {beta_path} * log(1 + floor((p + {offset}) / "
                    f"{period_path})) (probe, {period_path} shrunk to {_TEMPERATURE_PERIOD})"
                    + (f", switched on by {switch}" if switch else "")
                )
                return QueryPositionScale(
                    beta_field=beta_path,
                    period_field=period_path,
                    offset=offset,
                    nope_layers_only=True,
                    switch_field=switch,
                )
    return None


def _scale_switch(ctx: Context, shrunk: PretrainedConfig, tokens: torch.Tensor, base: torch.Tensor) -> str | None:
    """The boolean config field that, flipped on the model with the shrunk period, gives the
    unscaled model's logits back."""
    for name, value in sorted(vars(shrunk).items()):
        if not isinstance(value, bool) or not value:
            continue
        flipped = copy.deepcopy(shrunk)
        setattr(flipped, name, False)
        try:
            logits = probes.logits(build_tiny_model(flipped, seed=0, trust_remote_code=ctx.trust_remote_code), tokens)
        except Exception as exc:  # config validators raise several exception types
            logger.debug("flipping %s failed: %s", name, exc)
            continue
        if logits.shape == base.shape and torch.allclose(logits, base, atol=1e-6, rtol=1e-5):
            return name
    return None


# The epsilon of the deepseek_v3 reference's latent norms (its model.py's LATENT_NORM_EPS).
REFERENCE_LATENT_NORM_EPS = 1e-6


def _latent_norm_eps(attention: nn.Module) -> float | None:
    """The one epsilon MLA's latent norms hold, read or measured (``None``: none, or several)."""
    values = set()
    for _, norm in mt.latent_norms(attention):
        eps = _norm_eps(norm)
        if eps is None:
            eps = probes.probe_norm_eps(norm, mt.norm_width(norm) or 8, NormKind.RMS)
        values.add(eps)
    return values.pop() if len(values) == 1 else None


def _latent_norm_eps_field(ctx: Context) -> str | None:
    """The block norms' epsilon field when MLA's latent norms take their epsilon from it.

    DeepSeek builds ``q_a_layernorm`` and ``kv_a_layernorm`` at RMSNorm's default 1e-6
    whatever ``rms_norm_eps`` says (the deepseek_v3 reference's ``LATENT_NORM_EPS``); other
    code passes the config's. Measured: a second tiny model with the field moved tenfold
    shows whether the latent norms follow it. A constant other than the reference's is
    named as unsupported."""
    attention = ctx.anatomy.attention
    if attention is None or not mt.latent_norms(attention):
        return None
    held = _latent_norm_eps(attention)
    field_name = _norm_eps_field(ctx.tiny)
    path = next((name for name, module in ctx.model.named_modules() if module is attention), None)
    if held is None or field_name is None or path is None:
        return None
    moved = _with_config_path(ctx.tiny, field_name, 10 * float(getattr(ctx.tiny, field_name)))
    try:
        follows = _latent_norm_eps(build_tiny_model(moved, trust_remote_code=ctx.trust_remote_code).get_submodule(path))
    except Exception as exc:  # a config class may validate the moved value
        logger.debug("latent norm epsilon probe failed: %s", exc)
        follows = None
    if follows is not None and not math.isclose(follows, held):
        ctx.evidence.append(f"MLA latent norms: epsilon {held:g} follows {field_name} (moved tenfold: {follows:g})")
        return field_name
    if not math.isclose(held, REFERENCE_LATENT_NORM_EPS):
        ctx.evidence.append(f"MLA latent norms: epsilon {held:g}, a constant of the modeling code")
        ctx.other.append(f"MLA latent norm epsilon {held:g} (the reference's is {REFERENCE_LATENT_NORM_EPS:g})")
    return None


def _mla_qk_width(ctx: Context) -> int | None:
    """The query/key head width of multi-head latent attention (``qk_nope_head_dim +
    qk_rope_head_dim``), or ``None`` without MLA."""
    if not isinstance(ctx.get("kv_lora_rank"), int):
        return None
    nope, rope = ctx.get("qk_nope_head_dim"), ctx.get("qk_rope_head_dim")
    if not (isinstance(nope, int) and isinstance(rope, int)):
        return None
    return nope + rope


def _eps_of(norm: nn.Module) -> float | None:
    value = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    return value if isinstance(value, float) else None


def _block_like_norm(ctx: Context, name: str, norm: nn.Module, archon: str, where: str) -> NormKind | None:
    """The kind of ``norm`` (HF's ``name``, found ``where``) when an edit writes it as Archon's
    ``archon`` module inside the layer: it computes a kind of the vocabulary and holds the block
    norms' epsilon. ``None`` otherwise: the norm stays a feature no edit supports."""
    width = norm_width(norm)
    block_norm = ctx.anatomy.final_norm or next(iter(ctx.anatomy.norms.values()), None)
    if width is None or block_norm is None:
        return None
    kind = probes.probe_norm_kind(norm, width)
    eps = _eps_of(norm)
    if kind is NormKind.OTHER or eps is None or eps != _eps_of(block_norm):
        ctx.evidence.append(f"{name}: {kind.value} norm, eps {eps} unlike the block norms': no edit")
        return None
    ctx.contract_norms[norm] = archon
    ctx.evidence.append(f"{name}: a {kind.value} norm {where} (measured)")
    return kind


def _sub_norm(
    ctx: Context, norms: dict[str, nn.Module], place: HandEditPlace | None, contract: ContractInput, archon: str
) -> NormKind | None:
    """The kind of the one norm whose output the projection of ``contract`` reads, when an edit
    writes it (:func:`_block_like_norm`); ``place`` is where :func:`norm_place` measured it."""
    if place != contract.place or len(norms) != 1:
        return None
    ((name, norm),) = norms.items()
    return _block_like_norm(ctx, name, norm, archon, contract.statement)


def last_layer_output_bias(ctx: Context, roles: dict[str, mt.Projection]) -> str | None:
    """The checkpoint key, inside a layer, of a vector the last layer's attention holds and no
    other layer's does, measured as its output projection's bias (GPT-NeoX-Japanese's
    ``dense_bias``): with it zeroed and its value added to the projection's output instead, the
    full-depth model's logits stay the same. ``None`` when there is no such vector."""
    model, layers, full = ctx.layer_stack()
    name = ctx.anatomy.attention_name
    if not full or len(layers) < 2 or name is None or "o" not in roles:
        return None
    first, *middle, last = (layer.get_submodule(name) for layer in layers)
    own = {n for n, _ in first.named_parameters(recurse=False)}
    extra = [(n, p) for n, p in last.named_parameters(recurse=False) if n not in own]
    if len(extra) != 1 or extra[0][1].dim() != 1:
        return None
    (param_name, bias), projection = extra[0], roles["o"].name
    if any(param_name in dict(m.named_parameters(recurse=False)) for m in middle):
        return None
    output = last.get_submodule(projection)
    if bias.shape[0] != getattr(output, "out_features", None):
        return None
    tokens = probes.tokens_for(ctx.tiny, 5)
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(0)))
            value = bias.detach().clone()
            held = probes.logits(model, tokens)
            bias.zero_()
            handle = output.register_forward_hook(lambda module, args, out: out + value)
            try:
                moved = probes.logits(model, tokens)
            finally:
                handle.remove()
    except Exception as exc:  # a forward the probe cannot run: not measured
        logger.debug("measuring %s as the output projection's bias failed: %s", param_name, exc)
        return None
    finally:
        with torch.no_grad():
            bias.copy_(saved)
    if not torch.allclose(held, moved, atol=1e-5):
        return None
    key = f"{name}.{param_name}"
    ctx.per_layer_parameters.add(key)
    ctx.evidence.append(f"{key}: the last layer's output-projection bias, no other layer's (measured)")
    return key


def _measured_indexer(ctx: Context, attention: nn.Module) -> SparseIndexer | None:
    """MLA's one nested module measured as a sparse-attention indexer (skill.analysis.indexer),
    its parts entered in the checkpoint's module map; a forward that lets gradients reach it
    is named (the port computes it without, as HF's own forward does where measured)."""
    name, child = next((n, c) for n, c in attention.named_children() if not mt.is_norm(c) and mt.weight_2d(c) is None)
    indexer = sparse_indexer(ctx, attention, name, child)
    if indexer is None:
        return None
    if indexer.grad:
        ctx.other.append(f"sparse-attention indexer trained through the attention's loss: {name}")
    attentions = _layer_attentions(ctx, ctx.layer_stack()[1]) or []
    without = [str(i) for i, layer_attention in enumerate(attentions) if getattr(layer_attention, name, None) is None]
    if without:
        # Such a layer reuses another layer's selection (GLM-5's "shared" indexer layers).
        ctx.other.append(f"layers without a sparse-attention indexer of their own: {', '.join(without)}")
    for role, part in indexer.parts.items():
        ctx.contract_norms[getattr(child, part)] = f"attention.indexer.{role}"
    return indexer


def _differential(ctx: Context, roles: dict[str, mt.Projection]) -> DifferentialAttention | None:
    """Differential attention measured on every layer of the full-depth stack
    (skill/analysis/differential.py), with its four vectors' checkpoint keys inside a layer;
    a differential attention of another form is named in ``other``."""
    name = ctx.anatomy.attention_name
    if name is None or "v" not in roles or "o" not in roles:
        return None
    model, layers, _ = ctx.layer_stack()
    attentions = _layer_attentions(ctx, layers)
    if not attentions:
        return None
    found, why_not = measure_differential(
        model, attentions, roles["v"].name, roles["o"].name, ctx.tiny_kv_heads(), ctx.tiny_head_dim()
    )
    if why_not is not None:
        ctx.other.append(why_not)
    if found is None:
        return None
    ctx.evidence.append(
        f"differential attention: lambda = exp({found.lambda_vectors[0]} . {found.lambda_vectors[1]}) - "
        f"exp({found.lambda_vectors[2]} . {found.lambda_vectors[3]}) + {found.lambda_init}, "
        f"pairs normalised by {found.norm} (eps {found.norm_eps:g}) (measured on every layer)"
    )
    return found.model_copy(update={"lambda_keys": [f"{name}.{vector}" for vector in found.lambda_vectors]})


def attention_features(ctx: Context) -> AttentionFeatures:
    roles = _attention_projections(ctx)
    attention = ctx.anatomy.attention
    qkv = roles.get("qkv")
    q_bias = (roles["q"].bias if "q" in roles else False) or (qkv.bias if qkv else False)
    k_bias = (roles["k"].bias if "k" in roles else False) or (qkv.bias if qkv else False)
    v_bias = (roles["v"].bias if "v" in roles else False) or (qkv.bias if qkv else False)
    o_bias = roles["o"].bias if "o" in roles else False
    qk = _qk_norm(ctx, roles)
    heads = ctx.get("num_attention_heads")
    kv = _kv_heads(ctx.config) or heads
    head_dim = ctx.get("head_dim")
    hidden = ctx.get("hidden_size")
    derived = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    explicit = isinstance(head_dim, int) and derived is not None and head_dim != derived
    qk_width = _mla_qk_width(ctx)
    if qk_width is not None:
        # MLA's head widths are their own fields (a config's head_dim, when it has one, is
        # the RoPE slice or a serving hint): a query/key head is qk_nope + qk_rope wide.
        head_dim, explicit = qk_width, True
    # Not the final logits' cap, nor an MoE router's (Laguna's moe_router_logit_softcapping).
    softcaps = {
        k: v for k, v in _fields_matching(ctx.config, "softcap").items() if "final" not in k and "router" not in k
    }
    attn_softcap = next((float(v) for v in softcaps.values() if isinstance(v, (int, float))), None)
    custom, scaling_source, scaling_constant = _custom_scaling(ctx)
    kv = _measured_kv_heads(ctx, roles, heads, kv)
    # A set multi-query switch fixes one KV head; the config's KV-head count follows it.
    mqa_flag = next(
        (n for n, v in sorted(ctx.config.to_dict().items()) if v is True and "multi_query" in n and kv == 1), None
    )
    clip_value, clip_field = _clip_qkv(ctx)
    clip_after_norm = (
        _clip_after_qk_norm(ctx, clip_field) if clip_field is not None and qk.kind is not QKNormKind.NONE else None
    )
    mla = None
    if isinstance(ctx.get("kv_lora_rank"), int):
        mla = MLA(
            q_lora_rank=ctx.get("q_lora_rank"),
            kv_lora_rank=ctx.get("kv_lora_rank"),
            qk_nope_head_dim=ctx.get("qk_nope_head_dim"),
            qk_rope_head_dim=ctx.get("qk_rope_head_dim"),
            v_head_dim=ctx.get("v_head_dim"),
            latent_norm_eps_field=_latent_norm_eps_field(ctx),
        )
    sinks = attention is not None and any("sink" in n for n, _ in attention.named_parameters())
    sub_norm: NormKind | None = None
    differential = _differential(ctx, roles) if mla is None else None
    explained = set(differential.lambda_vectors) if differential is not None else set()
    unexplained = [
        n
        for n, _ in (attention.named_parameters(recurse=False) if attention is not None else [])
        if "sink" not in n and n not in explained
    ]
    if unexplained:
        ctx.other.append(
            f"attention parameters outside the vocabulary: {', '.join(unexplained)} ({type(attention).__name__})"
        )
    if mla is None:
        extra = [
            k.split(":", 1)[1]
            for k, p in roles.items()
            if k.startswith("other:") and not _is_gate_projection(ctx, k, p)
        ]
        if extra:
            ctx.other.append(f"attention projections outside the vocabulary: {', '.join(extra)}")
    if attention is not None:
        q_norm, k_norm = mt.qk_norms(attention)
        named = {pair[0] for pair in (q_norm, k_norm) if pair is not None}
        if differential is not None:
            named.add(differential.norm)
        inner = [
            n
            for n, child in attention.named_children()
            if mt.is_norm(child) and n not in named and "_a_" not in n and not n.startswith(("kv_a", "q_a"))
        ]
        if inner:
            children = dict(attention.named_children())
            consumers = {roles["o"].module: ATTENTION_OUTPUT} if "o" in roles else {}
            norms = {n: children[n] for n in inner}
            place = norm_place(ctx.model, ctx.tiny, norms, consumers)
            sub_norm = _sub_norm(ctx, norms, place, ATTENTION_OUTPUT, "attention.sub_norm")
            if sub_norm is None:
                feature = f"norm inside the attention outside the vocabulary: {', '.join(inner)}"
                ctx.other.append(feature)
                if place is not None:
                    ctx.places[feature] = place
        # A child with parameters of its own that is no projection and no norm: a module the
        # attention consults (DeepSeek-V3.2's sparse-attention indexer picking the keys to attend).
        nested = [
            f"{n} ({type(child).__name__})"
            for n, child in attention.named_children()
            if not mt.is_norm(child) and mt.weight_2d(child) is None and any(True for _ in child.parameters())
        ]
        if mla is not None and len(nested) == 1:
            indexer = _measured_indexer(ctx, attention)
            if indexer is not None:
                mla = mla.model_copy(update={"indexer": indexer})
                nested = []
        if nested:
            ctx.other.append(f"attention submodule outside the vocabulary: {', '.join(nested)}")
    nope, nope_field, nope_type = _nope_with_rule(ctx)
    gate = _output_gate(ctx, roles)
    qkv_layout, qkv_blocks, qkv_order = fused_qkv_layout(ctx, roles)
    stacked = saved_qkv(ctx, roles) if qkv is None else None
    if stacked is not None:
        # Separate in memory, one tensor on disk: its rows are the projections' rows, stacked.
        ctx.evidence.append(f"q/k/v saved as one tensor {stacked[0]} (rows: {', '.join(stacked[1])}; by value)")
        qkv_layout = FusedQKVLayout.STACKED if stacked[1] == ["q", "k", "v"] else FusedQKVLayout.OTHER
    position_scale = query_position_scale(ctx) if probes.rotary_modules(ctx.model) else None
    if position_scale is None and nope:
        position_scale = nope_query_temperature(ctx, nope)
    if position_scale is None and ctx.get("attn_temperature_tuning") and isinstance(ctx.get("floor_scale"), int):
        # Llama 4's attention temperature that the probe above could not fit (it reads the queries
        # of the NoPE layers past floor_scale tokens, which tiny sequences never reach).
        ctx.other.append(
            "queries scaled by their sequence index on layers without RoPE (attn_temperature_tuning, from "
            f"floor_scale={ctx.get('floor_scale')} tokens on) in a form no probe matched"
        )
    chunked, chunked_evidence = measure_chunked_attention(ctx.tiny, ctx.model, ctx.trust_remote_code)
    if chunked is not None and chunked_evidence:
        ctx.evidence.append(chunked_evidence)
    elif chunked_evidence:
        ctx.other.append(f"chunked local attention: {chunked_evidence}")
    return AttentionFeatures(
        q_bias=bool(q_bias),
        k_bias=bool(k_bias),
        v_bias=bool(v_bias),
        o_bias=bool(o_bias),
        qk_norm=qk.kind,
        qk_norm_placement=qk.placement,
        qk_norm_computation=qk.computation,
        qk_norm_full_width=qk.full_width,
        n_heads=heads,
        n_kv_heads=kv,
        gqa=isinstance(kv, int) and isinstance(heads, int) and kv < heads,
        mqa_flag=mqa_flag,
        head_dim=head_dim if isinstance(head_dim, int) else derived,
        explicit_head_dim=explicit,
        sliding_window=_sliding_window(ctx),
        logit_softcap=attn_softcap,
        custom_scaling=custom,
        scaling_field=scaling_source.field if scaling_source else None,
        scaling_source=scaling_source,
        scaling_constant=scaling_constant,
        fused_qkv=qkv is not None or stacked is not None,
        fused_qkv_layout=qkv_layout,
        fused_qkv_blocks=qkv_blocks,
        fused_qkv_order=qkv_order,
        mla=mla,
        sinks=sinks,
        output_gate=gate is not None,
        output_gate_kind=gate.kind if gate else None,
        output_gate_key=gate.key if gate else None,
        output_gate_bias=gate.bias if gate else False,
        sub_norm=sub_norm,
        differential=differential,
        chunked=chunked,
        o_bias_last_layer_key=last_layer_output_bias(ctx, roles) if not o_bias else None,
        nope_layers=nope,
        nope_layers_field=nope_field,
        nope_layer_type=nope_type,
        query_position_scale=position_scale,
        clip_qkv=clip_value,
        clip_qkv_field=clip_field,
        clip_qkv_after_qk_norm=clip_after_norm,
        heads_per_layer_field=_heads_per_layer_field(ctx),
    )


def _heads_per_layer_field(ctx: Context) -> str | None:
    """A config list of one query-head count per layer (Laguna's
    ``num_attention_heads_per_layer``) whose entries all equal the head count: probed by
    doubling the first layer's entry in a tiny model, which widens that layer's parameters
    when the model reads the list. The port gives every layer the one head count and
    refuses a list that differs from it."""
    heads = getattr(ctx.tiny, "num_attention_heads", None)
    layers = getattr(ctx.tiny, "num_hidden_layers", None)
    if not isinstance(heads, int) or not isinstance(layers, int) or layers < 1:
        return None
    base = {k: v.shape for k, v in ctx.model.state_dict().items()}
    for name, value in sorted(ctx.tiny.to_dict().items()):
        if not isinstance(value, list) or len(value) != layers:
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) and v == heads for v in value):
            continue
        config = copy.deepcopy(ctx.tiny)
        try:
            setattr(config, name, [2 * heads, *value[1:]])
            model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
        except Exception as exc:  # config validators and constructors raise several exception types
            logger.debug("moving %s failed: %s", name, exc)
            continue
        if any(base.get(k) != v.shape for k, v in model.state_dict().items()):
            ctx.evidence.append(f"{name}: one query-head count per layer (probe: its first entry widens layer 0)")
            return name
    return None


# ------------------------------------------------------------------------ FFN


def _activation(ctx: Context, ffn: nn.Module | None) -> tuple[str, str | None]:
    """The FFN activation as an entry of the one table (``skill.activations``), and the
    config field that names it.

    A config value that is a table entry is taken as is; one that is another ACT2FN key
    (``gelu_new``) is instantiated and probed numerically against the table; with no
    config value (or one transformers does not know), the FFN's activation module is
    probed. What matches nothing keeps its config value or class name (unsupported).
    """
    from transformers.activations import ACT2FN

    for name in _ACTIVATION_FIELDS:
        value = ctx.get(name)
        if not isinstance(value, str):
            continue
        if value in ACTIVATIONS:
            return value, name
        if value in ACT2FN:
            try:
                matched = match_activation(ACT2FN[value])
            except Exception:
                matched = None
            if matched is not None:
                ctx.evidence.append(f"activation: {name}={value!r} computes the table's {matched!r} (numeric probe)")
                return matched, name
            return value, name
        probed = _probe_activation_module(ctx, ffn)
        if probed is not None:
            return probed, name
        return value, name
    probed = _probe_activation_module(ctx, ffn)
    if probed is not None:
        return probed, None
    if ffn is not None:
        for _, module in ffn.named_modules():
            cls = type(module).__name__
            if re.search(r"(Activation|Gelu|GELU|SiLU|Silu|ReLU|Relu|Swish|Tanh)", cls):
                return cls, None
    return "unknown", None


def _activation_leaf(ffn: nn.Module) -> tuple[str, nn.Module, str] | None:
    """(path, module, table entry) of the first parameter-free leaf module of ``ffn`` that
    computes an entry of the table (numeric probe)."""
    for path, module in ffn.named_modules():
        if list(module.children()) or list(module.parameters()) or mt.weight_2d(module) is not None:
            continue
        if isinstance(module, (nn.Dropout, nn.Identity)) or mt.is_norm(module):
            continue
        matched = match_activation(module)
        if matched is not None:
            return path, module, matched
    return None


def _probe_activation_module(ctx: Context, ffn: nn.Module | None) -> str | None:
    """The table entry a parameter-free leaf module of the FFN computes (numeric probe)."""
    found = _activation_leaf(ffn) if ffn is not None else None
    if found is None:
        return None
    path, module, matched = found
    ctx.evidence.append(f"activation: {type(module).__name__} ({path}) computes {matched!r} (numeric probe)")
    return matched


def expert_activation_mismatches(block: nn.Module | None, activation: str) -> list[str]:
    """The MoE block's routed and shared experts, each probed on its own activation module:
    one computing another table entry than the family's FFN activation (which the port gives
    both) is named. Experts with no activation module of their own are not judged."""
    if block is None:
        return []
    routed = mt.experts_module(block)
    parts = [("routed experts", routed[1])] if routed is not None else []
    parts += [(f"shared experts ({name})", child) for name, child in block.named_children() if "shared" in name]
    mismatches = []
    for role, module in parts:
        found = _activation_leaf(module)
        if found is not None and found[2] != activation:
            mismatches.append(f"{role} activated by {found[2]!r} while the MLP's activation is {activation!r}")
    return mismatches


def _dense_mlp(ctx: Context) -> nn.Module | None:
    """A dense FFN module: the layer-0 FFN, or the shared expert of an MoE block."""
    ffn = ctx.anatomy.ffn
    if ffn is None:
        return None
    if mt.experts_module(ffn) is None:
        return ffn
    for name, child in ffn.named_children():
        if "shared" in name and "gate" not in name:
            return child
    return None


def _layer_ffn_projections(ctx: Context) -> list[mt.Projection]:
    """Projections held directly by the layer, outside attention: an FFN without its own
    module (``fc1``/``fc2`` as attributes of the decoder layer)."""
    layer = ctx.anatomy.layers[0]
    return [p for p in mt.projections(layer, recurse=False) if p.module is not ctx.anatomy.attention]


_WIDTH_WORDS = ("intermediate", "ffn", "inner", "mlp")
_RATIO_WORDS = ("ratio", "expansion")


def _parameter_name(model: nn.Module, module: nn.Module) -> str | None:
    """The full name of ``module``'s weight in ``model``."""
    for name, child in model.named_modules():
        if child is module:
            return f"{name}.weight" if name else "weight"
    return None


def _sets_ffn_width(ctx: Context, ups: list[mt.Projection], field_name: str, side: str = "out") -> bool:
    """Whether a config field sets the FFN width, measured: a tiny model built with the field
    moved has every up projection as wide as the new value (``side="in"``: every projection
    given reads that many inputs, as a down projection reads the MLP's width whether its
    gate and up are fused or not). A field whose value merely equals the width (or whose
    name merely says "ffn") is no evidence; CTRL's ``dff`` is named by no width word and
    sets the width all the same."""
    value = getattr(ctx.tiny, field_name)
    moved = value + 32
    names = [_parameter_name(ctx.model, p.module) for p in ups]
    if not names or None in names:
        return False
    config = copy.deepcopy(ctx.tiny)
    try:
        setattr(config, field_name, moved)
        variant = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
    except Exception as exc:  # config validators and model builds raise several exception types
        logger.debug("moving %s to probe the FFN width failed: %s", field_name, exc)
        return False
    variant_params = dict(variant.named_parameters())
    for p, name in zip(ups, names, strict=True):
        weight = variant_params.get(str(name))
        if weight is None or weight.dim() != 2:
            return False
        out_axis = 1 if p.orientation == "in_out" else 0
        if weight.shape[out_axis if side == "out" else 1 - out_axis] != moved:
            return False
    return True


def _intermediate_size(ctx: Context, ups: list[mt.Projection]) -> tuple[int | None, str | None, int | None, str | None]:
    """The FFN width at full size and the config field that sets it: ``intermediate_size``,
    else the field whose tiny value is the up projection's width and whose move moves that
    width (probed: ``ffn_dim``, ``n_inner``, CTRL's ``dff``, ...), else a width field left
    ``None`` when the width is a multiple of the hidden size (GPT-2's ``n_inner=None``:
    4 * hidden), else a ratio field whose value is that multiple (MPT's ``expansion_ratio``),
    else, with no field at all, the multiple alone (Bloom: 4 * hidden). (size, field, multiple, ratio field)."""
    declared = ctx.get("intermediate_size")
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared, "intermediate_size", None, None
    widths = {p.out_features for p in ups}
    tiny_fields = sorted(ctx.tiny.to_dict().items())
    for name, value in tiny_fields:
        is_width = isinstance(value, int) and not isinstance(value, bool) and value in widths
        if is_width and _sets_ffn_width(ctx, ups, name):
            full = ctx.get(name)
            if isinstance(full, int) and not isinstance(full, bool):
                return full, name, None, None
    hidden = ctx.tiny.hidden_size
    if len(widths) == 1 and next(iter(widths)) % hidden == 0:
        multiple = next(iter(widths)) // hidden
        unset = [n for n, v in tiny_fields if v is None and any(w in n for w in _WIDTH_WORDS)]
        if len(unset) == 1 and ctx.get(unset[0]) is None:
            ctx.evidence.append(f"FFN width: {unset[0]}=None gives {multiple} * hidden_size")
            return multiple * int(ctx.config.hidden_size), unset[0], multiple, None
        ratios = [
            n
            for n, v in tiny_fields
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and v == multiple
            and any(w in n for w in _RATIO_WORDS)
        ]
        if len(ratios) == 1:
            full_ratio = ctx.get(ratios[0])
            ctx.evidence.append(f"FFN width: {ratios[0]} * hidden_size (probed: {multiple} * hidden_size)")
            return int(full_ratio * ctx.config.hidden_size), None, None, ratios[0]
        if not ratios and not unset:
            ctx.evidence.append(f"FFN width: {multiple} * hidden_size, no config field sets it")
            return multiple * int(ctx.config.hidden_size), None, multiple, None
    return None, None, None, None


def ffn_features(ctx: Context) -> FFNFeatures:
    mlp = _dense_mlp(ctx)
    activation, activation_field = _activation(ctx, ctx.anatomy.ffn)
    intermediate = ctx.get("intermediate_size")
    in_layer = _layer_ffn_projections(ctx) if ctx.anatomy.ffn is None else []
    if mlp is None and in_layer:
        ctx.evidence.append("FFN: projections held by the decoder layer itself: " + ", ".join(p.name for p in in_layer))
        return _plain_or_gated(ctx, in_layer, activation, activation_field)
    if mlp is None:
        # Every layer of the tiny model is MoE: read the experts' layout from disk keys.
        # Every layer of the tiny model is MoE: the routed experts' tensors on disk say
        # whether they are gated (an in-projection twice the down projection's width).
        tensors = expert_tensors(ctx)
        gated = tensors is not None and tensors.gated
        constants: dict[str, str] = {}
        if ctx.source is not None and ctx.source.experts_clamped_glu():
            # No activation function: the experts clamp gate and up and gate by a sigmoid.
            activation = "clamped_swiglu"
            constants = ctx.source.clamped_glu_fields()
            ctx.evidence.append(
                "experts' activation from the source scan: clamped SwiGLU (clamp + sigmoid gate), constants "
                + (", ".join(f"{k}={v}" for k, v in sorted(constants.items())) or "from no config field")
            )
        fused = tensors is not None and tensors.layout is ExpertLayout.PER_EXPERT_2D and "gate_up" in tensors.up_key
        bias = tensors is not None and tensors.bias
        return FFNFeatures(
            kind=FFNKind.GATED if gated else FFNKind.PLAIN,
            activation=activation,
            activation_field=activation_field,
            activation_fields=constants,
            bias=bias,
            fused_gate_up=fused,
            intermediate_size=intermediate if isinstance(intermediate, int) else None,
        )
    inner = [n for n, m in mlp.named_modules() if n and mt.is_norm(m)]
    sub_norm = None
    if inner:
        hidden = ctx.tiny.hidden_size
        downs = [p for p in mt.projections(mlp) if p.out_features == hidden and p.in_features != hidden]
        children = dict(mlp.named_modules())
        norms = {n: children[n] for n in inner}
        place = norm_place(ctx.model, ctx.tiny, norms, {p.module: FFN_DOWN for p in downs})
        sub_norm = _sub_norm(ctx, norms, place, FFN_DOWN, "feed_forward.sub_norm")
        if sub_norm is None:
            feature = f"norm inside the feed-forward: {', '.join(inner)}"
            ctx.other.append(feature)
            if place is not None:
                ctx.places[feature] = place
    features = _plain_or_gated(ctx, mt.projections(mlp), activation, activation_field)
    if features.kind is FFNKind.GATED:
        features = _clamped_glu_measured(ctx, mlp, features)
    return features.model_copy(update={"sub_norm": sub_norm}) if sub_norm is not None else features


def _gated_mlp_computes(mlp: nn.Module, hidden: int, act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether a gated MLP computes ``down(act(gate, up))``, probed on its own weights: the
    gate and up read from its projections (either half of a fused one first, or either of two
    separate ones as the gate), with inputs scaled until the pre-activations reach +-20, so a
    clamp shows. False when its projections are no gated MLP's or its forward takes no input."""
    projs = mt.projections(mlp)
    ups = [p for p in projs if p.in_features == hidden]
    downs = [p for p in projs if p.out_features == hidden and p.in_features != hidden]
    if len(downs) != 1:
        return False
    width = downs[0].in_features
    generator = torch.Generator().manual_seed(0)
    weight = mt.weight_2d(downs[0].module)
    if weight is None:
        return False
    x = torch.randn(1, 8, hidden, generator=generator, dtype=weight.dtype)
    try:
        with torch.no_grad():
            pre = torch.cat([p.module(x) for p in ups], dim=-1)
            x = x * (20.0 / pre.abs().max().clamp_min(1e-6))
            outs = [p.module(x) for p in ups]
            if len(outs) == 1 and outs[0].shape[-1] == 2 * width:
                pairs = [(outs[0][..., :width], outs[0][..., width:]), (outs[0][..., width:], outs[0][..., :width])]
            elif len(outs) == 2 and all(o.shape[-1] == width for o in outs):
                pairs = [(outs[0], outs[1]), (outs[1], outs[0])]
            else:
                return False
            out = mlp(x)
            if not isinstance(out, torch.Tensor):
                return False
            tolerance = 1e-5 * max(1.0, float(out.abs().max()))
            return any(
                torch.allclose(downs[0].module(act(gate, up)), out, rtol=1e-4, atol=tolerance) for gate, up in pairs
            )
    except Exception:  # a forward that wants more than hidden states raises several exception types
        return False


def _clamped_glu_measured(ctx: Context, mlp: nn.Module, features: FFNFeatures) -> FFNFeatures:
    """The gated MLP's activation as measured where the config's names another: an MLP that
    does not compute ``down(act(gate) * up)`` for the config's activation but does compute
    the clamped SwiGLU (gpt-oss's, inline in the MLP's forward: MiniMax-M3 declares
    ``hidden_act="silu"`` as a mere fallback) with the constants its class reads from the
    config (source scan), tried at their tiny values, is reported as ``clamped_swiglu``."""
    entry = ACTIVATIONS.get(features.activation)
    reference = entry.reference if entry is not None else None
    hidden = ctx.tiny.hidden_size
    if reference is not None and _gated_mlp_computes(mlp, hidden, lambda gate, up: reference(gate) * up):
        return features
    if ctx.source is None:
        return features
    constants = ctx.source.clamped_glu_fields(type(mlp).__name__)
    alpha, limit = (ctx.tiny.to_dict().get(constants.get(k, "")) for k in ("alpha", "limit"))
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)):
        return features
    from skill.snippets.experts import clamped_swiglu

    if not _gated_mlp_computes(mlp, hidden, lambda gate, up: clamped_swiglu(gate, up, float(alpha), float(limit))):
        return features
    ctx.evidence.append(
        f"activation: {type(mlp).__name__} computes the clamped SwiGLU (probed), not {features.activation!r}; "
        + ", ".join(f"{k}={v}" for k, v in sorted(constants.items()))
    )
    return features.model_copy(update={"activation": "clamped_swiglu", "activation_fields": constants})


def _plain_or_gated(
    ctx: Context, projs: list[mt.Projection], activation: str, activation_field: str | None
) -> FFNFeatures:
    hidden = ctx.tiny.hidden_size
    ups = [p for p in projs if p.in_features == hidden]
    downs = [p for p in projs if p.out_features == hidden and p.in_features != hidden]
    fused = any(
        "gate_up" in p.name or (len(ups) == 1 and len(downs) == 1 and p.out_features == 2 * downs[0].in_features)
        for p in ups
    )
    gated = len(ups) >= 2 or fused
    bias = any(p.bias for p in projs)
    size, size_field, multiple, ratio_field = _intermediate_size(ctx, ups)
    return FFNFeatures(
        kind=FFNKind.GATED if gated else FFNKind.PLAIN,
        activation=activation,
        activation_field=activation_field,
        bias=bias,
        fused_gate_up=fused,
        intermediate_size=size,
        intermediate_size_field=size_field,
        intermediate_multiple=multiple,
        intermediate_ratio_field=ratio_field,
    )


# ------------------------------------------------------------------------ MoE


_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k")


def _positive_field(config: PretrainedConfig, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(config, n, None), int) and getattr(config, n) > 0), None)


def expert_count(config: PretrainedConfig) -> int | None:
    """The number of routed experts a config declares, if any."""
    name = _positive_field(config, _EXPERT_COUNT_FIELDS)
    return getattr(config, name) if name else None


def _top_k(config: PretrainedConfig) -> int | None:
    name = _positive_field(config, _TOP_K_FIELDS)
    return getattr(config, name) if name else None


def _moe_layers(ctx: Context) -> tuple[list[int], int]:
    n = int(ctx.config.num_hidden_layers)
    model = ctx.deep_model
    if model is not None:
        try:
            _, layers = mt.find_layers(model, n)
            return [i for i, layer in enumerate(layers) if mt.layer_has_experts(layer)], n
        except LookupError:
            pass
    tiny_layers = ctx.anatomy.layers
    ctx.evidence.append("MoE layers: full-depth module tree unavailable; listed for the tiny stack")
    return [i for i, layer in enumerate(tiny_layers) if mt.layer_has_experts(layer)], len(tiny_layers)


# Config rules that decide which layers route to experts, each with the fields it reads
# (all of them must be in the config) and the layers it makes sparse. The analysis names
# the rule whose prediction equals the measured moe_layers of the full-depth model.
def _sparse_step_rule(config: PretrainedConfig, n: int) -> list[int]:
    step = getattr(config, "decoder_sparse_step", None) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def _first_k_dense_rule(field: str):
    """The first ``config.<field>`` layers are dense (DeepSeek's ``first_k_dense_replace``,
    AFMoE's ``num_dense_layers``), every later one routes to experts."""

    def predict(config: PretrainedConfig, n: int) -> list[int]:
        return [i for i in range(n) if i >= int(getattr(config, field))]

    return predict


def _layer_types_rule(config: PretrainedConfig, n: int) -> list[int]:
    types = list(config.mlp_layer_types)
    return [i for i in range(n) if i < len(types) and types[i] == "sparse"]


def _start_end_interval_rule(config: PretrainedConfig, n: int) -> list[int]:
    start, end, interval = config.moe_layer_start_index, config.moe_layer_end_index, config.moe_layer_interval
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, interval)):
        return []
    return [i for i in range(n) if (i + 1) % interval == 0 and start <= i <= end]


MOE_LAYER_RULES: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("first_k_dense", ("first_k_dense_replace",), _first_k_dense_rule("first_k_dense_replace")),
    ("first_k_dense", ("num_dense_layers",), _first_k_dense_rule("num_dense_layers")),
    ("layer_types", ("mlp_layer_types",), _layer_types_rule),
    (
        "start_end_interval",
        ("moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval"),
        _start_end_interval_rule,
    ),
    ("sparse_step", ("decoder_sparse_step", "mlp_only_layers"), _sparse_step_rule),
)


def moe_layer_rule(config: PretrainedConfig, moe_layers: list[int], n_layers: int) -> tuple[str, list[str]]:
    """The config rule (and the fields it reads) that reproduces the measured MoE layers.

    A rule applies when the config has its fields (``sparse_step``: either of them) and its
    prediction on the full-size config is exactly ``moe_layers``; ``("", [])`` when no rule
    does (every layer MoE with no rule field is ``("all", [])``).
    """
    values = config.to_dict()
    for name, fields, predict in MOE_LAYER_RULES:
        present = [f for f in fields if f in values]
        if (name == "sparse_step" and present) or len(present) == len(fields):
            try:
                predicted = predict(config, n_layers)
            except (TypeError, ValueError, AttributeError):
                continue
            if predicted == moe_layers:
                return name, present
    if len(moe_layers) == n_layers:
        return "all", []
    return "", []


@dataclass(frozen=True)
class ExpertTensors:
    """Where a layer's routed experts sit on disk (layer 0, ``{}`` for indices)."""

    layout: ExpertLayout
    orientation: WeightOrientation
    up_key: str  # gate/up (fused) or the gate/up/fc1 key of one expert
    down_key: str
    gated: bool
    bias: bool
    down_orientation: WeightOrientation | None = None  # fused layout: the down tensor's own (None: as ``orientation``)

    @property
    def mixed_orientation(self) -> bool:
        return self.down_orientation is not None and self.down_orientation is not self.orientation

    layer: int = 0  # the layer the keys were read from (the first with experts)
    up_bias_key: str = ""  # fused layout: the [E, width] bias of the in-projection ({} for the layer)
    down_bias_key: str = ""  # fused layout: the [E, hidden] bias of the down projection


def _expert_template(key: str) -> str:
    return re.sub(r"\.experts\.\d+\.", ".experts.{}.", re.sub(r"\.\d+\.", ".{}.", key, count=1), count=1)


def expert_tensors(ctx: Context) -> ExpertTensors | None:
    """The first reading of :func:`expert_tensor_readings` (what every reading agrees on:
    the layout, the keys, whether the experts are gated), ``None`` when there is none."""
    readings = expert_tensor_readings(ctx)
    return readings[0] if readings else None


def expert_tensor_readings(ctx: Context) -> list[ExpertTensors]:
    """The routed experts' checkpoint tensors of layer 0, read off the saved keys' shapes.

    Per-expert 2D keys hold an expert index; a fused layout holds one 3D tensor per
    projection whose first dimension is the expert count (``experts.gate_up_proj``,
    granite's ``input_linear``/``output_linear``, aria's ``fc1``/``fc2``). The in-projection
    reads the hidden size, the down projection writes it; the experts are gated when the
    in-projection is twice as wide as the down projection's input. Expert biases are the
    2D ``[E, n]`` (fused) or 1D (per expert) tensors beside those weights.

    A fused tensor whose two trailing dimensions are equal (a gate/up ``[E, 2I, H]`` with
    ``2I == H``, as the tiny model's widths make it) fits both orientations: every
    shape-consistent reading is returned, and :func:`_probed_reading` measures which one
    the HF module computes with.
    """
    n_experts = expert_count(ctx.tiny) or 0
    hidden = ctx.tiny.hidden_size
    # The first layer holding experts: leading dense layers (first_k_dense_replace) have none.
    layer_re = re.compile(re.escape(ctx.layer_prefix).replace(r"0\.", r"(\d+)\.", 1) if ctx.layer_prefix else "^$")
    expert_layers = sorted(
        {int(m.group(1)) for k in ctx.saved_keys if ".experts." in k and (m := layer_re.match(k)) is not None}
    )
    index = expert_layers[0] if expert_layers else 0
    layer = ctx.layer_prefix[: -len("0.")] + f"{index}." if ctx.layer_prefix else ""
    # Not the attention's tensors: a mixture-of-attention (JetMoE's MoA) stacks its own
    # experts' projections as 3D tensors too.
    attention = f"{layer}{ctx.anatomy.attention_name}." if ctx.anatomy.attention_name else None
    keys = {
        k: s
        for k, s in ctx.saved_keys.items()
        if k.startswith(layer) and "shared" not in k and not (attention and k.startswith(attention))
    }
    per_expert = {k: s for k, s in keys.items() if re.search(r"\.experts\.\d+\.", k) and k.endswith("weight")}
    if per_expert:
        first = re.search(r"\.experts\.(\d+)\.", next(iter(per_expert))).group(1)  # type: ignore[union-attr]
        one = {k: s for k, s in per_expert.items() if f".experts.{first}." in k and len(s) == 2}
        ins = [k for k, s in one.items() if hidden in s and not re.search(r"(down|w2|fc2|output)", k)]
        downs = [k for k in one if k not in ins]
        if not ins:
            return []
        up = next((k for k in ins if re.search(r"(up|gate|w1|w3|fc1)", k)), ins[0])
        orientation = WeightOrientation.OUT_IN if one[up][-1] == hidden else WeightOrientation.IN_OUT
        # An expert's own bias (experts.{e}.gate_proj.bias); a per-expert vector saved beside
        # the experts (Laguna's experts.e_score_correction_bias) is the router's, not theirs.
        bias = any(re.search(r"\.experts\.\d+\.", k) and k.endswith(".bias") for k in keys)
        return [
            ExpertTensors(
                ExpertLayout.PER_EXPERT_2D,
                orientation,
                _expert_template(up),
                _expert_template(downs[0]) if downs else "",
                gated=len(ins) >= 2,
                bias=bias,
                layer=index,
            )
        ]
    fused = {k: s for k, s in keys.items() if len(s) == 3 and n_experts and s[0] == n_experts}
    if len(fused) != 2:
        return []
    # The down projection writes the hidden size and reads what the in-projection writes.
    (ka, sa), (kb, sb) = fused.items()

    def split(shape: tuple[int, ...]) -> tuple[tuple[int, WeightOrientation], ...]:
        """(the other width, orientation) for each way the hidden size can be this tensor's input."""
        options = []
        if shape[2] == hidden:
            options.append((shape[1], WeightOrientation.OUT_IN))
        if shape[1] == hidden:
            options.append((shape[2], WeightOrientation.IN_OUT))
        return tuple(options)

    readings: list[ExpertTensors] = []
    for up, down, up_shape, down_shape in ((ka, kb, sa, sb), (kb, ka, sb, sa)):
        for width, up_orientation in split(up_shape):
            # As the down projection: hidden is its output (out_in: dim 1, in_out: dim 2).
            for down_orientation in (WeightOrientation.OUT_IN, WeightOrientation.IN_OUT):
                out_dim, in_dim = (1, 2) if down_orientation is WeightOrientation.OUT_IN else (2, 1)
                if down_shape[out_dim] != hidden or width not in (down_shape[in_dim], 2 * down_shape[in_dim]):
                    continue
                if width != 2 * down_shape[in_dim] and re.search(r"(down|output|fc2|w2)", up):
                    continue
                bias_keys = [
                    k
                    for k, s in keys.items()
                    if (len(s) == 2 and s[0] == n_experts and k.rsplit(".", 1)[0] in (up, down, up.rsplit(".", 1)[0]))
                    or k in (up + "_bias", down + "_bias")
                ]
                # Which bias is whose, by its width: the in-projection's output or the hidden size.
                up_bias = next((k for k in bias_keys if keys[k][-1] == width and width != hidden), "")
                down_bias = next((k for k in bias_keys if keys[k][-1] == hidden and width != hidden), "")
                readings.append(
                    ExpertTensors(
                        ExpertLayout.FUSED_3D,
                        up_orientation,
                        re.sub(r"\.\d+\.", ".{}.", up, count=1),
                        re.sub(r"\.\d+\.", ".{}.", down, count=1),
                        gated=width == 2 * down_shape[in_dim],
                        bias=bool(bias_keys),
                        down_orientation=down_orientation,
                        layer=index,
                        up_bias_key=re.sub(r"\.\d+\.", ".{}.", up_bias, count=1),
                        down_bias_key=re.sub(r"\.\d+\.", ".{}.", down_bias, count=1),
                    )
                )
        if readings:
            # The in-projection is the first tensor that fits; the other pairing is not tried.
            break
    return readings


def _gate_up_order(ctx: Context, tensors: ExpertTensors) -> GateUpOrder | None:
    """Probe which positions of a fused gate/up tensor are the activated (gate) ones."""
    if tensors.layout is not ExpertLayout.FUSED_3D or not tensors.gated:
        return GateUpOrder.SEPARATE
    up_key, down_key = tensors.up_key.format(tensors.layer), tensors.down_key.format(tensors.layer)
    axis = 1 if tensors.orientation is WeightOrientation.OUT_IN else 2
    order = probes.probe_gate_up_order(
        ctx.model, ctx.tiny, up_key, ctx.saved_keys[up_key], axis, down_key, ctx.saved_keys[down_key]
    )
    return GateUpOrder(order) if order else None


def _probed_reading(ctx: Context, readings: list[ExpertTensors]) -> tuple[ExpertTensors, GateUpOrder | None] | None:
    """The reading of the experts' tensors the HF module computes with, and its gate/up order.

    One reading needs no choice. Several (a square fused gate/up tensor) are told apart by
    the gate/up probe: it zeroes positions along the in-projection's output axis, which
    silences the up positions only on the axis HF really writes to; ``None`` when no reading,
    or more than one, explains HF's outputs.
    """
    if len(readings) == 1:
        found: tuple[ExpertTensors, GateUpOrder | None] | None = (readings[0], _gate_up_order(ctx, readings[0]))
    else:
        probed = [(reading, _gate_up_order(ctx, reading)) for reading in readings]
        explained = [(reading, order) for reading, order in probed if order is not None]
        found = explained[0] if len(explained) == 1 else None
    if found is not None and found[0].layout is ExpertLayout.FUSED_3D and found[0].gated:
        ctx.evidence.append(f"fused expert gate/up order from the zeroing probe: {found[1]}")
    return found


def _selection_bias(ffn: nn.Module, num_experts: int) -> torch.Tensor | None:
    """A per-expert vector in the MoE block that is not a projection's bias.

    Added to the scores only to pick experts (DeepSeek's ``e_score_correction_bias``,
    other families' ``expert_bias``); a router Linear's own bias does not count.
    """
    if num_experts <= 0:
        return None
    for _, module in ffn.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if tensor.dim() != 1 or tensor.numel() != num_experts:
                continue
            if name == "bias" and mt.weight_2d(module) is not None:
                continue
            return tensor
    return None


def _has_selection_bias(ffn: nn.Module, num_experts: int) -> bool:
    return _selection_bias(ffn, num_experts) is not None


def _selection_bias_placement(ctx: Context, ffn: nn.Module | None, moe_layer: nn.Module | None) -> str:
    """Where the MoE block's selection bias enters the top-k, probed (see
    :func:`skill.analysis.probes.probe_selection_bias_placement`); names what no edit
    reproduces: a bias on the logits before the score function."""
    experts = expert_count(ctx.tiny) or 0
    if ffn is None or moe_layer is None:
        return ""
    bias = _selection_bias(ffn, experts)
    router = mt.router_module(ffn, experts)
    if bias is None or router is None:
        return ""
    placement = probes.probe_selection_bias_placement(
        ctx.model, moe_layer, router[1], bias, ctx.tiny, _top_k(ctx.tiny) or 0
    )
    ctx.evidence.append(f"selection bias placement from the top-k probe: {placement or 'unknown'}")
    groups = next((ctx.get(f) for f in ("n_group", "num_expert_group") if isinstance(ctx.get(f), int)), None)
    if placement == "logits" and isinstance(groups, int) and groups > 1:
        ctx.other.append("grouped top-k routing with the selection bias on the logits before the score function")
    return placement


def _per_layer_list_fields(config: PretrainedConfig, source: SourceFacts | None = None) -> list[str]:
    """The expert-count and experts-per-token fields whose config class annotation accepts a
    list, or that the modeling code indexes by layer (one value per layer, HunYuan-MoE's
    ``moe_topk`` and ``num_experts``), by the config class's own names."""
    cls = type(config)
    aliases = getattr(cls, "attribute_map", {}) or {}
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        hints = dict(getattr(cls, "__annotations__", {}))
    fields = []
    for name in (_positive_field(config, _EXPERT_COUNT_FIELDS), _positive_field(config, _TOP_K_FIELDS)):
        if name is None:
            continue
        own = aliases.get(name, name)
        hint = hints.get(own)
        indexed = source is not None and source.indexes_config_by_layer(own)
        if (hint is not None and "list" in str(hint).lower()) or indexed:
            fields.append(own)
    return fields


def _selection_bias_key(ctx: Context, num_experts: int) -> tuple[str, list[int]]:
    """The checkpoint key (inside a layer, ``{}`` for nothing else) of a per-expert
    selection bias, and its shape: a saved tensor of the MoE block with one entry per
    expert that is neither a projection's weight nor its bias nor an expert's.

    Keys of the layer's attention never count: its per-head sinks may have as many
    entries. (The MoE block may be saved under another name than its module's.)"""
    if num_experts <= 0:
        return "", []
    # Any layer: the first layers of a family with leading dense layers have no router.
    layer = re.compile(re.escape(ctx.layer_prefix).replace(r"0\.", r"\d+\.", 1) if ctx.layer_prefix else "^$")
    # Not the attention's per-head tensors (gpt-oss's sinks, Flint's saved as
    # self_attn.softmax_offset), which a tiny model with as many heads as experts shapes alike.
    attention = ctx.anatomy.attention_name
    for key, shape in sorted(ctx.saved_keys.items()):
        match = layer.match(key)
        # Not an expert's own tensor (experts.{e}.*); a vector saved under the experts'
        # module (Laguna writes its router's bias as mlp.experts.e_score_correction_bias) counts.
        if match is None or re.search(r"\.experts\.\d+\.", key) or "shared" in key:
            continue
        if attention and key[match.end() :].startswith(f"{attention}."):
            continue
        if key.endswith((".weight", ".bias")) or not shape or shape[-1] != num_experts:
            continue
        if any(n != 1 for n in shape[:-1]):
            continue
        return key[match.end() :], list(shape)
    return "", []


def _shared_expert_width(ctx: Context, ffn: nn.Module | None) -> tuple[str | None, str, str | None]:
    """The config field counting shared experts, how their MLP's width is set
    (``experts_multiple`` when it is that count times the routed experts' width, as
    AReaL's ``num_shared_experts`` builds it; ``own_field`` when a field of its own sets
    it) and that field when it is not AReaL's ``shared_expert_intermediate_size``;
    measured on the tiny model's shared MLP."""
    if ffn is None:
        return None, "", None
    shared = next((c for n, c in ffn.named_children() if "shared" in n and "gate" not in n), None)
    if shared is None:
        return None, "", None
    hidden = ctx.tiny.hidden_size
    widths = {p.out_features for p in mt.projections(shared) if p.in_features == hidden}
    if len(widths) != 1:
        return None, "", None
    width = widths.pop()
    tiny = ctx.tiny.to_dict()
    count_field = next(
        (
            k
            for k, v in sorted(tiny.items())
            if "shared" in k
            and "expert" in k
            and isinstance(v, int)
            and not isinstance(v, bool)
            and "size" not in k
            and "dim" not in k
        ),
        None,
    )
    # An expert's width: moe_intermediate_size, else intermediate_size (aria_text), as the port reads it.
    expert_width = tiny.get("moe_intermediate_size", tiny.get("intermediate_size"))
    if count_field is not None and isinstance(expert_width, int) and width == expert_width * tiny[count_field]:
        return count_field, "experts_multiple", None
    if tiny.get("shared_expert_intermediate_size") == width:
        return count_field, "own_field", None
    if count_field is None and width == expert_width:
        # One shared MLP as wide as a routed expert, no field counting it (HunYuan-MoE's shared_mlp).
        return None, "experts_multiple", None
    own = _shared_width_field(ctx, shared)
    return count_field, "own_field" if own is not None else "", own


def _shared_width_field(ctx: Context, shared: nn.Module) -> str | None:
    """The config field that sets the shared MLP's own width, measured: its down projection
    reads as many inputs as the field's tiny value, and a tiny model built with the field
    moved reads the moved value (MiniMax-M3's ``shared_intermediate_size``, its gate and up
    fused in one projection twice that wide). ``None`` when no field moves it."""
    hidden = ctx.tiny.hidden_size
    downs = [p for p in mt.projections(shared) if p.out_features == hidden and p.in_features != hidden]
    widths = {p.in_features for p in downs}
    if len(widths) != 1:
        return None
    width = widths.pop()
    for name, value in sorted(ctx.tiny.to_dict().items()):
        if isinstance(value, bool) or value != width or not isinstance(ctx.get(name), int):
            continue
        if _sets_ffn_width(ctx, downs, name, side="in"):
            ctx.evidence.append(f"shared experts' width: {name} (moving it moves their down projection's input)")
            return name
    return None


def moe_block(ctx: Context) -> tuple[nn.Module | None, nn.Module | None]:
    """The first decoder layer holding experts, and its MoE block (the child holding them)."""
    moe_layer = next((layer for layer in ctx.anatomy.layers if mt.layer_has_experts(layer)), None)
    if moe_layer is not None:
        for child in moe_layer.children():
            if mt.experts_module(child) is not None and not mt.is_norm(child):
                return moe_layer, child
    return moe_layer, None


def _moe_output_norm_place(
    ctx: Context, moe_layer: nn.Module | None, ffn: nn.Module, inner: list[str]
) -> HandEditPlace | None:
    """Where the hand edit of the MoE block's own output norm goes (measured), when it has one
    norm and its routed experts; their sum with the shared experts is what the norm reads."""
    experts = mt.experts_module(ffn)
    if moe_layer is None or len(inner) != 1 or experts is None:
        return None
    children = dict(ffn.named_children())
    shared = [child for name, child in children.items() if "shared" in name and "gate" not in name]
    return moe_output_norm_place(ctx.model, ctx.tiny, moe_layer, ffn, children[inner[0]], [experts[1], *shared])


def moe_features(ctx: Context) -> MoEFeatures | None:
    num_experts = expert_count(ctx.config)
    has_experts = any(mt.layer_has_experts(layer) for layer in ctx.anatomy.layers)
    if not has_experts and not any(".experts." in k for k in ctx.saved_keys):
        return None
    if num_experts is None:
        ctx.evidence.append("MoE: experts in the module tree but no expert-count field in the config")
        num_experts = 0
    moe_layers, n_layers = _moe_layers(ctx)
    moe_layer, ffn = moe_block(ctx)
    scoring_field = next((v for k, v in _fields_matching(ctx.config, "scor").items() if isinstance(v, str)), None)
    if scoring_field in ("sigmoid", "softmax"):
        scoring = RouterScoring(scoring_field)
    else:
        scanned = ctx.source.router_scoring() if ctx.source else None
        if ctx.source is not None and ctx.source.router_sparse_mixer():
            scanned = RouterScoring.SPARSEMIXER.value
        scoring = RouterScoring(scanned) if scanned else RouterScoring.OTHER
        ctx.evidence.append(f"router scoring from the source scan: {scanned}")
    norm_topk = ctx.get("norm_topk_prob")
    if not isinstance(norm_topk, bool):
        probed = probes.probe_topk_weights_sum_to_one(ctx.model, ctx.anatomy, ctx.tiny, _top_k(ctx.tiny) or 0)
        if probed is not None:
            norm_topk = probed
            ctx.evidence.append(f"top-k renormalisation from the routing-weights probe: {norm_topk}")
        else:
            norm_topk = bool(ctx.source.router_renormalises()) if ctx.source else False
            ctx.evidence.append(f"top-k renormalisation from the source scan: {norm_topk}")
    correction_key, correction_shape = _selection_bias_key(ctx, expert_count(ctx.tiny) or 0)
    correction = (
        bool(correction_key)
        or any("correction" in k for k in ctx.saved_keys)
        or (ffn is not None and _has_selection_bias(ffn, expert_count(ctx.tiny) or 0))
    )
    placement = _selection_bias_placement(ctx, ffn, moe_layer) if correction else ""
    output_norm: NormKind | None = None
    if ffn is not None:
        inner = [n for n, child in ffn.named_children() if mt.is_norm(child)]
        if inner:
            place = _moe_output_norm_place(ctx, moe_layer, ffn, inner)
            if place == MOE_BRANCH_ADD:
                where = "on the MoE's output before the residual add"
                output_norm = _block_like_norm(ctx, inner[0], getattr(ffn, inner[0]), "moe_output_norm", where)
            if output_norm is None:
                feature = f"norm on the MoE block's output, inside the MoE module: {', '.join(inner)}"
                ctx.other.append(feature)
                if place is not None:
                    ctx.places[feature] = place
    router_bias = False
    shared_gate = False
    shared = 0
    if ffn is not None:
        router = mt.router_module(ffn, expert_count(ctx.tiny) or 0)
        if router is not None and isinstance(getattr(router[1], "bias", None), torch.Tensor):
            router_bias = True
        shared_children = [(n, c) for n, c in ffn.named_children() if "shared" in n]
        for name, child in shared_children:
            proj = mt.projection(name, child)
            if "gate" in name and proj is not None and proj.out_features == 1:
                shared_gate = True
        if any("gate" not in n for n, _ in shared_children):
            shared = next(
                (
                    int(v)
                    for k, v in _fields_matching(ctx.config, "shared", "expert").items()
                    if isinstance(v, int) and not isinstance(v, bool) and "size" not in k and "dim" not in k
                ),
                1,
            )
    group_field = next((f for f in ("n_group", "num_expert_group") if f in ctx.config.to_dict()), None)
    topk_group_field = "topk_group" if group_field is not None and "topk_group" in ctx.config.to_dict() else None
    n_group = ctx.get(group_field) if group_field else None
    topk_group = ctx.get("topk_group")
    # DeepSeek-V2's group_limited_greedy scores a group by its best expert, V3's noaux_tc by
    # the sum of its two best: probed on HF's MoE block with the groups turned on.
    group_scoring, switch = "sum_top2", None
    if group_field is not None and topk_group_field is not None:
        group_scoring, switch = _group_rule(ctx, group_field, topk_group_field)
    norm_ignored, renormalises_when_ignored = (
        _norm_topk_prob_ignored(ctx) if isinstance(ctx.get("norm_topk_prob"), bool) else (False, None)
    )
    shared_field, shared_width, shared_width_field = _shared_expert_width(ctx, ffn) if shared else (None, "", None)
    if not shared:
        # A count field at 0 (Cohere2-MoE's num_shared_experts): this config has none, one
        # setting it has; the port names the field so it can refuse such a config.
        shared_field = next(
            (
                k
                for k, v in _fields_matching(ctx.config, "shared", "expert").items()
                if isinstance(v, int) and not isinstance(v, bool) and v == 0 and "size" not in k and "dim" not in k
            ),
            None,
        )
    scaling = next(
        (v for v in _fields_matching(ctx.config, "rout", "scal").values() if isinstance(v, (int, float))), None
    )
    routed_field = ctx.scalar_role("routed_scaling")
    if routed_field is not None and isinstance(ctx.get(routed_field.name), (int, float)):
        scaling = ctx.get(routed_field.name)
    rule, rule_fields = moe_layer_rule(ctx.config, moe_layers, n_layers)
    if not rule:
        ctx.evidence.append(f"MoE layers {moe_layers}: no config rule reproduces them")
    readings = expert_tensor_readings(ctx)
    reading = _probed_reading(ctx, readings) if readings else None
    bias_keys: list[str] = []
    if not readings:
        ctx.other.append("routed experts whose checkpoint tensors the analyser cannot place")
    elif reading is None:
        ctx.other.append(
            "fused expert tensors that fit several orientations, none (or more than one) of which the gate/up probe"
            " confirms"
        )
    if reading is None:
        layout, orientation, up, down, order, bias = ExpertLayout.NONE, WeightOrientation.OUT_IN, "", "", None, False
    else:
        tensors, order = reading
        bias_keys = [tensors.up_bias_key, tensors.down_bias_key] if tensors.bias else []
        layout, orientation, up, down = tensors.layout, tensors.orientation, tensors.up_key, tensors.down_key
        bias = tensors.bias
        if tensors.mixed_orientation:
            ctx.other.append(
                "fused expert projections stored in different orientations (the adapter transposes gate/up and"
                " down alike)"
            )
        if order is None:
            ctx.other.append("fused expert gate/up tensor whose gate/up order no probe explains")
    jitter = None
    if scoring is RouterScoring.SPARSEMIXER:
        jitter = next((k for k in _fields_matching(ctx.config, "jitter") if "router" in k), None)
        if jitter is None:
            ctx.other.append("sparsemixer routing with no config field for its threshold epsilon")
    return MoEFeatures(
        num_experts=num_experts,
        top_k=_top_k(ctx.config) or 0,
        output_norm=output_norm,
        router_scoring=scoring,
        norm_topk_prob=bool(norm_topk),
        score_correction_bias=correction,
        score_correction_key=correction_key,
        score_correction_shape=correction_shape,
        n_group_field=group_field,
        topk_group_field=topk_group_field,
        group_scoring=group_scoring,
        routed_scaling_factor=float(scaling) if isinstance(scaling, (int, float)) and scaling != 1.0 else None,
        routed_scaling_field=routed_field.name if routed_field else None,
        n_group=int(n_group) if isinstance(n_group, int) and n_group > 1 else None,
        topk_group=int(topk_group)
        if isinstance(n_group, int) and n_group > 1 and isinstance(topk_group, int)
        else None,
        shared_experts=shared,
        shared_experts_field=shared_field,
        shared_expert_width=shared_width,
        shared_expert_width_field=shared_width_field,
        shared_expert_gate=shared_gate,
        moe_layers=moe_layers,
        n_layers=n_layers,
        moe_layer_rule=rule,
        moe_layer_fields=rule_fields,
        expert_layout=layout,
        expert_orientation=orientation,
        expert_key_template=up,
        expert_down_key_template=down,
        expert_gate_up=order or GateUpOrder.SEPARATE,
        expert_bias=bias,
        expert_bias_key_templates=bias_keys,
        router_bias=router_bias,
        router_jitter_field=jitter,
        num_experts_field=_positive_field(ctx.config, _EXPERT_COUNT_FIELDS),
        top_k_field=_positive_field(ctx.config, _TOP_K_FIELDS),
        norm_topk_prob_ignored=norm_ignored,
        group_switch_field=switch[0] if switch else None,
        group_switch_value=switch[1] if switch else None,
        group_switch_values=list(switch[2]) if switch else [],
        selection_bias_placement=placement,
        renormalises_when_ignored=renormalises_when_ignored,
        per_layer_list_fields=_per_layer_list_fields(ctx.config, ctx.source),
        router_softcap_field=_router_softcap_field(ctx),
        score_before_experts=True if scores_before_experts(ctx.model, ctx.tiny, ffn) else None,
    )


# A cap small enough to bend a tiny router's logits (tanh(x / c) * c).
_PROBE_ROUTER_CAP = 0.1


def _router_softcap_field(ctx: Context) -> str | None:
    """A config field soft-capping the router logits (Laguna's ``moe_router_logit_softcapping``)
    that is off in this config (0 or None): probed by setting a small cap in the tiny model,
    which moves the logits when the forward reads it. The port keeps the router's logits
    uncapped and refuses a config that sets one. A cap already on is named in ``other``."""
    tokens = probes.tokens_for(ctx.tiny, 6)
    base: torch.Tensor | None = None
    for name, value in sorted(ctx.config.to_dict().items()):
        lowered = name.lower()
        if "router" not in lowered or not ("softcap" in lowered or "soft_cap" in lowered):
            continue
        if isinstance(value, bool) or not (value is None or isinstance(value, (int, float))):
            continue
        if value:
            ctx.other.append(f"router logits soft-capped ({name}={value!r})")
            return None
        config = copy.deepcopy(ctx.tiny)
        try:
            base = probes.logits(ctx.model, tokens) if base is None else base
            setattr(config, name, _PROBE_ROUTER_CAP)
            moved = probes.logits(build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code), tokens)
        except Exception as exc:  # config validators and forwards raise several exception types
            logger.debug("capping the router with %s failed: %s", name, exc)
            continue
        if moved.shape == base.shape and torch.allclose(moved, base, atol=1e-6, rtol=1e-5):
            continue
        ctx.evidence.append(
            f"{name}={value!r}: the router's logit soft-cap, off here (probe: a cap of {_PROBE_ROUTER_CAP} "
            "moves the logits)"
        )
        return name
    return None


# The routing probes' variant: 8 experts in 2 groups of 4, one group kept, top-2.
_GROUP_PROBE = {"experts": 8, "groups": 2, "kept": 1, "top_k": 2}


def _routing_variant(ctx: Context, **fields: Any) -> PreTrainedModel | None:
    """A seeded tiny model with config fields set (an expert-count or top-k field by the name
    the config uses); ``None`` when the config or the model refuses them."""
    config = copy.deepcopy(ctx.tiny)
    try:
        for name, value in fields.items():
            setattr(config, name, value)
        return build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
    except Exception as exc:  # config validators and model builds raise several exception types
        logger.debug("the routing variant %s failed: %s", fields, exc)
        return None


def _group_switches(ctx: Context) -> list[tuple[str, str, tuple[str, ...]]]:
    """Config fields the router code compares with string literals (``self.topk_method ==
    "group_limited_greedy"`` where ``self.topk_method = config.topk_method``): the field,
    one value, and every value compared, for each value."""
    if ctx.source is None:
        return []
    code = ctx.source.router_code()
    assigned = dict(re.findall(r"self\.(\w+)\s*=\s*config\.(\w+)", code))
    found: dict[str, list[str]] = {}
    for attr, value in re.findall(r"self\.(\w+)\s*==\s*[\"'](\w+)[\"']", code):
        field_name = assigned.get(attr)
        if field_name is not None and isinstance(ctx.get(field_name), str):
            found.setdefault(field_name, [])
            if value not in found[field_name]:
                found[field_name].append(value)
    return [(f, v, tuple(values)) for f, values in found.items() for v in values]


def _group_rule(
    ctx: Context, group_field: str, topk_group_field: str
) -> tuple[str, tuple[str, str, tuple[str, ...]] | None]:
    """How HF's router scores an expert group (``"max"`` or ``"sum_top2"``), probed with the
    groups on, and the config switch (field, value, all values) that turns them on where
    the group fields alone do not. ``"sum_top2"`` and no switch when no probe sees a limit."""
    count_field = _positive_field(ctx.tiny, _EXPERT_COUNT_FIELDS)
    top_k_field = _positive_field(ctx.tiny, _TOP_K_FIELDS)
    if count_field is None or top_k_field is None:
        return "sum_top2", None
    fields = {
        count_field: _GROUP_PROBE["experts"],
        group_field: _GROUP_PROBE["groups"],
        topk_group_field: _GROUP_PROBE["kept"],
        top_k_field: _GROUP_PROBE["top_k"],
    }
    for switch in [None, *_group_switches(ctx)]:
        extra = {switch[0]: switch[1]} if switch else {}
        model = _routing_variant(ctx, **fields, **extra)
        if model is None:
            continue
        rule = probes.probe_group_rule(mt.anatomy(model, ctx.tiny.num_hidden_layers))
        if rule is not None:
            ctx.evidence.append(
                f"group-limited routing probed on HF's MoE block: {rule}"
                + (f" ({switch[0]}={switch[1]!r})" if switch else "")
            )
            return rule, switch
    return "sum_top2", None


def _norm_topk_prob_ignored(ctx: Context) -> tuple[bool, bool | None]:
    """Whether flipping the config's ``norm_topk_prob`` leaves the routing weights HF's MoE
    block computes unchanged (the forward never reads it for this config's scoring), and
    then whether those weights are renormalised anyway (each token's top-k weights sum to
    one constant: Cohere2-MoE's softmax over the top-k logits) or never (DeepSeek-V2).
    ``(False, None)`` when the field is read or a probe cannot run."""
    count = expert_count(ctx.tiny) or 0
    top_k = _top_k(ctx.tiny) or 0
    if count < 2 or top_k < 1:
        return False, None
    flag = bool(ctx.get("norm_topk_prob"))
    weights = []
    for value in (flag, not flag):
        model = _routing_variant(ctx, norm_topk_prob=value)
        measured = (
            probes.routing_weights(mt.anatomy(model, ctx.tiny.num_hidden_layers), count, top_k) if model else None
        )
        if measured is None:
            return False, None
        weights.append(measured)
    if not torch.allclose(weights[0], weights[1], atol=1e-6, rtol=1e-5):
        return False, None
    sums = weights[0].float().sum(-1)
    renormalised = bool(torch.allclose(sums, sums[:1].expand_as(sums), atol=1e-4) and sums[0].abs() > 1e-6)
    ctx.evidence.append(
        "norm_topk_prob: flipping it leaves HF's routing weights unchanged (never read); "
        f"they are {'always' if renormalised else 'never'} renormalised"
    )
    return True, renormalised


# ------------------------------------------------------------------ positions


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None)
    return rope if isinstance(rope, dict) else {}


def rotary_interleaved(config: PretrainedConfig, source: SourceFacts | None) -> bool:
    """Whether the rotation pairs adjacent features ``(x[2i], x[2i+1])`` rather than the two
    halves: the config says so (``rope_interleave``) or the modeling source's rotary helpers
    slice ``::2`` / ``repeat_interleave`` / go through complex numbers. When the modeling
    code branches on ``config.rope_interleave`` (DeepSeek-V3 has both helpers), the field
    alone decides."""
    flag = getattr(config, "rope_interleave", None)
    if flag is not None and source is not None and source.reads_config("rope_interleave"):
        return bool(flag)
    return bool(flag) or bool(source and source.rotary_interleaved())


def position_features(ctx: Context) -> PositionFeatures:
    model = ctx.model
    rotary = [m for n, m in model.named_modules() if "Rotary" in type(m).__name__ or n.endswith("rotary_emb")]
    embedding = ctx.anatomy.embedding
    position_tables = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Embedding) and m is not embedding and ("pos" in n.lower() or n.endswith("wpe"))
    ]
    sinusoidal = [n for n, m in model.named_modules() if "Sinusoidal" in type(m).__name__]
    sinusoidal += [n for n in _position_buffer_owners(ctx) if n not in sinusoidal]
    relative = [n for n, m in model.named_modules() if "relative" in n.lower() and isinstance(m, nn.Embedding)]
    alibi_field = any(bool(v) for v in _fields_matching(ctx.config, "alibi").values() if isinstance(v, bool))
    alibi_code = ctx.source is not None and ctx.source.mentions("alibi")
    rope = _rope_parameters(ctx.config)
    if rotary or uses_rope(ctx):
        kind = PositionKind.ROPE
    elif sinusoidal:
        kind = PositionKind.SINUSOIDAL
    elif position_tables:
        kind = PositionKind.LEARNED
    elif alibi_field or (alibi_code and not _fields_matching(ctx.config, "alibi")):
        kind = PositionKind.ALIBI
    elif relative:
        kind = PositionKind.RELATIVE_BIAS
    else:
        kind = PositionKind.NONE
    if kind is PositionKind.LEARNED:
        name, table = position_tables[0]
        key, offset, rows_field = _learned_table(ctx, name, table)
        return PositionFeatures(
            kind=kind, rope_type=None, theta=None, table_key=key, table_offset=offset, table_rows_field=rows_field
        )
    if kind is PositionKind.ALIBI:
        return PositionFeatures(kind=kind, rope_type=None, theta=None, alibi_slopes=_alibi_slopes(ctx))
    if kind is PositionKind.SINUSOIDAL:
        offset, zero_field = _sinusoidal_table(ctx, sinusoidal[0])
        return PositionFeatures(
            kind=kind, rope_type=None, theta=None, table_offset=offset, table_zero_row_field=zero_field
        )
    if kind is not PositionKind.ROPE:
        return PositionFeatures(kind=kind, rope_type=None, theta=None)
    layer_dicts = {k: v for k, v in rope.items() if isinstance(v, dict)}
    per_layer = bool(rope) and (len(layer_dicts) == len(rope) or any(t in layer_dicts for t in PER_LAYER_ROPE_TYPES))
    if per_layer and len(layer_dicts) < len(rope):
        # A saved checkpoint's config may keep a flat key beside the layer types' dicts
        # (Laguna-XS.2: original_max_position_embeddings); each layer type reads its own dict.
        extras = ", ".join(sorted(set(rope) - set(layer_dicts)))
        ctx.evidence.append(f"rope_parameters: {extras} beside the per-layer-type dicts, which each layer type reads")
        rope = layer_dicts
    first = _per_layer_rope(ctx, rope) if per_layer else rope
    rope_type = str(first.get("rope_type", "default")) if first else "default"
    theta = first.get("rope_theta") if first else None
    if theta is None:
        theta = ctx.get("rope_theta")
    scaling = {
        k: v
        for k, v in sorted((first or {}).items())
        if k not in ("rope_type", "rope_theta", "partial_rotary_factor") and v is not None
    }
    interleaved = rotary_interleaved(ctx.config, ctx.source)
    direction = RotaryDirection.STANDARD
    measured = _measured_rotation(ctx)
    if measured is not None:
        pairing, reversed_ = measured
        if pairing is not None:
            if (pairing == "interleaved") != interleaved:
                ctx.evidence.append(f"RoPE pairing: {pairing} as the rotary function computes it, not as read")
            interleaved = pairing == "interleaved"
        direction = RotaryDirection.REVERSED if reversed_ else RotaryDirection.STANDARD
    if not rotary:
        ctx.evidence.append("RoPE: the attention class applies the rotation itself (no rotary module)")
    factor = _partial_rotary(ctx, rotary[0] if rotary else None, first or {})
    layer_factors = _layer_rotary_factors(ctx, rope) if per_layer else None
    return PositionFeatures(
        kind=kind,
        rope_type=rope_type,
        rope_scaling=scaling,
        theta=float(theta) if isinstance(theta, (int, float)) else None,
        rotary_style=RotaryStyle.INTERLEAVED if interleaved else RotaryStyle.HALF,
        rotary_direction=direction,
        partial_rotary_factor=factor,
        per_layer_type_rope=per_layer,
        rope_layer_types=sorted(rope) if per_layer else [],
        layer_rotary_factors=layer_factors,
    )


def _measured_rotation(ctx: Context) -> tuple[str | None, bool] | None:
    """``(pairing, reversed)`` of the rotary function the attention's modeling module
    defines (``apply_rotary_pos_emb``), probed (:func:`probes.probe_rotation`). A module
    with several rotary functions (DeepSeek-V3 picks one by ``rope_interleave``) gives a
    direction only when they turn the same way, and no pairing (the config's and source's
    stands); ``None`` when nothing could be probed."""
    attention = ctx.anatomy.attention
    module = sys.modules.get(type(attention).__module__) if attention is not None else None
    functions = {
        name: value
        for name, value in vars(module).items()
        if module is not None and name.startswith("apply_rotary") and callable(value)
    }
    measured = {name: probes.probe_rotation(fn) for name, fn in sorted(functions.items())}
    found = {name: m for name, m in measured.items() if m is not None}
    if not found:
        if functions:
            ctx.evidence.append(
                f"RoPE direction: {', '.join(functions)} take no (q, k, cos, sin) to probe; taken as standard"
            )
        return None
    directions = {reversed_ for _, reversed_ in found.values()}
    if len(directions) != 1:
        ctx.other.append(f"rotary functions turning both ways ({', '.join(found)})")
        return None
    (reversed_,) = directions
    way = "reversed, (x1, x2) -> (x2, -x1)" if reversed_ else "standard, (x1, x2) -> (-x2, x1)"
    ctx.evidence.append(f"RoPE direction: {way} ({', '.join(found)}, probed)")
    if len(found) == 1:
        ((name, (pairing, _)),) = found.items()
        ctx.evidence.append(f"RoPE pairing: {pairing} ({name}, probed)")
        return pairing, reversed_
    # Several functions, one picked by a config field: their direction, the config's pairing.
    return None, reversed_


def _position_buffer_owners(ctx: Context) -> list[str]:
    """Modules holding a fixed position table as a non-persistent buffer (CTRL's model)."""
    return list(probes.position_buffers(ctx.model, ctx.anatomy, int(ctx.tiny.hidden_size)))


def _vaswani_positions(n_positions: int, dim: int) -> torch.Tensor:
    """The Transformer paper's table as CTRL builds it: ``[sin | cos]`` of ``p * 10000^(-2i/d)``
    (the denominator ``d``, not fairseq's ``d/2 - 1``); a measuring stick, no port writes it."""
    frequencies = torch.pow(10000.0, -2.0 * torch.arange(dim // 2, dtype=torch.float64) / dim)
    angles = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1) * frequencies.unsqueeze(0)
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()


def _sinusoidal_table(ctx: Context, name: str) -> tuple[int, str | None]:
    """A fixed sinusoidal position table: the row offset position ``p`` reads (probed through
    layer 0's input), and the config field naming a row the module zeroes (XGLM zeroes row
    ``pad_token_id``; read off the module's table against the formula). What is not the
    ``[sin | cos]`` table the port builds is named."""
    width = int(ctx.tiny.hidden_size)
    offset = probes.probe_sinusoidal_offset(ctx.model, ctx.anatomy, ctx.tiny, sinusoidal_positions)
    if offset is None:
        vaswani = probes.probe_sinusoidal_offset(ctx.model, ctx.anatomy, ctx.tiny, _vaswani_positions)
        if vaswani is not None:
            ctx.evidence.append(f"sinusoidal positions: position p reads row p + {vaswani} of {name} (probe)")
            feature = (
                f"sinusoidal positions of another formula ([sin | cos] rows, frequencies 10000^(-2i/d), offset "
                f"{vaswani}, probe of {name}): the sinusoidal_positions edit builds 10000^(-i/(d/2-1))"
            )
            ctx.other.append(feature)
            ctx.places[feature] = SINUSOIDAL_TABLE_BUILT
            ctx.facts[feature] = NamedFact(key="sinusoidal_formula", data={"formula": "vaswani", "offset": vaswani})
            return vaswani, None
        ctx.other.append(f"sinusoidal positions that are no [sin | cos] table rows (probe of {name})")
        return 0, None
    module = dict(ctx.model.named_modules())[name]
    tables = [b for b in module.buffers(recurse=False) if b.ndim == 2 and b.shape[-1] == width]
    zero_rows: list[int] = []
    if tables:
        table = tables[0].detach().double()
        expected = sinusoidal_positions(table.shape[0], width).double()
        zeroed = (table.abs().sum(-1) == 0) & (expected.abs().sum(-1) != 0)
        zero_rows = [int(i) for i in torch.nonzero(zeroed).flatten()]
        rest = ~zeroed
        if not torch.allclose(table[rest], expected[rest], rtol=1e-5, atol=1e-5):
            ctx.other.append(f"sinusoidal position table {name} other than the [sin | cos] one")
    ctx.evidence.append(f"sinusoidal positions: position p reads row p + {offset} of {name} (probe)")
    if not zero_rows:
        return offset, None
    fields = [
        n
        for n, v in sorted(ctx.tiny.to_dict().items())
        if isinstance(v, int) and not isinstance(v, bool) and v == zero_rows[0] and n.endswith("token_id")
    ]
    field = "pad_token_id" if "pad_token_id" in fields else (fields[0] if fields else None)
    if len(zero_rows) > 1 or field is None:
        ctx.other.append(f"sinusoidal position table with zeroed rows {zero_rows} no config field names")
        return offset, None
    ctx.evidence.append(f"sinusoidal positions: row {field} of {name} is zero")
    return offset, field


def _alibi_slopes(ctx: Context) -> list[float]:
    """The ALiBi slopes of the tiny model (probed); what is not ALiBi's standard geometric
    sequence for the head count (the one the port computes) is named."""
    slopes = probes.probe_alibi_slopes(ctx.model, ctx.anatomy, ctx.tiny)
    if slopes is None:
        ctx.other.append("ALiBi whose score bias no probe reads (no linear bias in the attention weights)")
        return []
    expected = alibi_slopes(ctx.tiny.num_attention_heads).tolist()
    if len(slopes) != len(expected) or not all(
        math.isclose(got, want, rel_tol=1e-4) for got, want in zip(slopes, expected, strict=False)
    ):
        shown = ", ".join(f"{x:.4g}" for x in slopes)
        ctx.other.append(f"ALiBi slopes ({shown}) other than the standard 2**(-8 / n) sequence (probe)")
    else:
        ctx.evidence.append(f"ALiBi slopes {', '.join(f'{x:.4g}' for x in slopes)}: the standard sequence (probe)")
    return [float(f"{x:.6g}") for x in slopes]  # six significant digits: probe noise stays out of reports


PER_LAYER_ROPE_TYPES = ("full_attention", "sliding_attention")


def _per_layer_rope(ctx: Context, rope: dict[str, Any]) -> dict[str, Any]:
    """The parameters that stand for per-layer-type RoPE in the checklist: the scaled
    layer type's (its ``rope_type`` is the one scaling the port implements), else the full
    attention layers'. What one scaling function per model cannot express is named."""
    unknown = sorted(set(rope) - set(PER_LAYER_ROPE_TYPES))
    if unknown:
        ctx.other.append(f"RoPE parameters for layer types {', '.join(unknown)}")
    scaled = {k: v for k, v in rope.items() if str(v.get("rope_type", "default")) != "default"}
    if len({str(v.get("rope_type")) for v in scaled.values()}) > 1:
        ctx.other.append("per-layer-type RoPE with a different scaling type on each layer type")
    if scaled:
        return next(iter(scaled.values()))
    return rope.get("full_attention") or next(iter(rope.values()))


def _layer_rotary_factors(ctx: Context, rope: dict[str, Any]) -> dict[str, float] | None:
    """Per-layer-type RoPE: the share of each head that the layers of each type rotate,
    where some type rotates only part of it (``None`` where every layer rotates whole
    heads, so the other families' reports read as before).

    Measured as :func:`_partial_rotary` measures one width, on the rotary tables of HF's
    rotary module: one inverse-frequency table per layer type (``<type>_inv_freq``), one
    frequency per rotated pair. A model builds tables only for the types its layers have
    (Laguna's default layers are all full attention), so the probe builds a tiny model
    whose layers take every type in turn. A type without a table to read keeps the
    ``partial_rotary_factor`` its ``rope_parameters`` declare, and the evidence says so."""
    types = sorted(rope)
    declared = {t: float(rope[t].get("partial_rotary_factor", 1.0) or 1.0) for t in types}
    tables = _layer_inv_freq_tables(ctx, types)
    factors: dict[str, float] = {}
    for layer_type in types:
        table = tables.get(layer_type)
        if table is None:
            factors[layer_type] = declared[layer_type]
            continue
        factors[layer_type] = round(2 * table.numel() / ctx.tiny_head_dim(), 4)
    if all(math.isclose(f, 1.0) for f in factors.values()):
        return None
    for layer_type, factor in factors.items():
        how = (
            f"{tables[layer_type].numel()} frequencies in the rotary table {layer_type}_inv_freq (probe)"
            if layer_type in tables
            else "as rope_parameters declare it (no rotary table of that type to read)"
        )
        ctx.evidence.append(f"partial rotary of the {layer_type} layers: {factor} of each head, {how}")
        if layer_type in tables and not math.isclose(factor, declared[layer_type], rel_tol=1e-3):
            ctx.evidence.append(
                f"rope_parameters[{layer_type!r}] declare partial_rotary_factor {declared[layer_type]}: "
                "not what the model rotates"
            )
    return factors


def _layer_inv_freq_tables(ctx: Context, types: list[str]) -> dict[str, torch.Tensor]:
    """The ``<type>_inv_freq`` buffers of the rotary module of a tiny model whose layers take
    every one of ``types`` (the tiny model itself when its ``layer_types`` already do)."""
    model: nn.Module | None = ctx.model
    kinds = list(getattr(ctx.tiny, "layer_types", None) or [])
    if kinds and not set(types) <= set(kinds):
        model = None
        if len(kinds) >= len(types):
            config = copy.deepcopy(ctx.tiny)
            try:
                config.layer_types = [types[i % len(types)] for i in range(len(kinds))]
                model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
            except Exception as exc:  # config validators and constructors raise several exception types
                logger.debug("the per-layer-type rotary probe failed: %s", exc)
    if model is None:
        return {}
    tables: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if "Rotary" not in type(module).__name__ and not name.endswith("rotary_emb"):
            continue
        for buffer_name, buffer in module.named_buffers(recurse=False):
            layer_type = buffer_name.removesuffix("_inv_freq")
            if buffer_name.endswith("_inv_freq") and layer_type in types:
                tables.setdefault(layer_type, buffer)
    return tables


def _learned_table(ctx: Context, name: str, table: nn.Embedding) -> tuple[str | None, int, str | None]:
    """A learned position table: its checkpoint key, the row offset position ``p`` reads
    (probed: the table's output for a fresh sequence against its rows), and the config
    field that sizes it (rows = field + offset)."""
    key = f"{name}.weight" if f"{name}.weight" in ctx.saved_keys else None
    offset = probes.probe_position_offset(ctx.model, table, ctx.tiny)
    if offset is None:
        ctx.other.append(f"learned positions that read no contiguous rows of {name} (probe)")
        offset = 0
    rows = table.weight.shape[0] - offset
    fields = [
        n
        for n, v in sorted(ctx.tiny.to_dict().items())
        if isinstance(v, int) and not isinstance(v, bool) and v == rows and ("position" in n or n in ("n_ctx",))
    ]
    if getattr(ctx.tiny, "max_position_embeddings", None) == rows:
        fields.insert(0, "max_position_embeddings")
    if offset:
        ctx.evidence.append(f"learned positions: position p reads row p + {offset} of {name}")
    return key, offset, (fields[0] if fields else None)


def _rotary_dims_field(ctx: Context) -> tuple[str, int] | None:
    """A config field giving the rotated width in dimensions (``rotary_dim``)."""
    for name, value in sorted(ctx.config.to_dict().items()):
        if "rotary" in name and "dim" in name and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def _partial_rotary(ctx: Context, rotary: nn.Module | None, rope: dict[str, Any]) -> float:
    declared = rope.get("partial_rotary_factor", ctx.get("partial_rotary_factor"))
    if isinstance(declared, (int, float)):
        return float(declared)
    if isinstance(ctx.get("kv_lora_rank"), int):
        return 1.0  # MLA rotates its own rope slice of qk_rope_head_dim
    inv_freq = next((b for n, b in rotary.named_buffers() if "inv_freq" in n), None) if rotary is not None else None
    dims = _rotary_dims_field(ctx)
    if inv_freq is not None:
        # What the model rotates: its rotary table holds one frequency per rotated pair. A
        # config field naming another width is not read (MiniMax-M3's rotary_dim).
        factor = round(2 * inv_freq.numel() / ctx.tiny_head_dim(), 4)
        if not math.isclose(factor, 1.0):
            ctx.evidence.append(f"partial rotary from the rotary table: {inv_freq.numel()} frequencies")
        if dims is not None:
            tiny_dims = getattr(ctx.tiny, dims[0], None)
            read = isinstance(tiny_dims, int) and math.isclose(tiny_dims / ctx.tiny_head_dim(), factor, rel_tol=1e-3)
            ctx.evidence.append(
                f"config field {dims[0]}={dims[1]}: "
                + ("the rotated width" if read else f"not what the model rotates (factor {factor} from its table)")
            )
        return factor
    head_dim = ctx.get("head_dim")
    heads = ctx.get("num_attention_heads")
    if not isinstance(head_dim, int) and isinstance(ctx.get("hidden_size"), int) and isinstance(heads, int) and heads:
        head_dim = ctx.get("hidden_size") // heads
    if dims is not None and isinstance(head_dim, int) and head_dim > 0:
        # No rotary table to read (GPT-J and CodeGen build sin/cos of rotary_dim themselves).
        ctx.evidence.append(f"partial rotary from the config: {dims[0]}={dims[1]} of head_dim {head_dim}")
        return round(dims[1] / head_dim, 4)
    return 1.0


# ----------------------------------------------------------------------- norm


def _norms_eps(ctx: Context) -> float | None:
    """The one epsilon every norm of the tiny model holds; ``None`` if they differ."""
    values = set()
    for _, module in ctx.model.named_modules():
        if mt.is_norm(module):
            value = getattr(module, "eps", getattr(module, "variance_epsilon", None))
            if isinstance(value, float):
                values.add(value)
    if len(values) != 1:
        return None
    (value,) = values
    return value


def _saved_block_norm_names(ctx: Context, block_norms: dict[str, str]) -> dict[str, str]:
    """``block_norms`` keyed by the names the checkpoint saves the norms under.

    Some families save a module under another name than its attribute (Kolibri1's
    ``post_self_attn_layernorm`` is written as ``post_attn_norm``): each norm of layer 0
    whose name the checkpoint lacks is looked up by value in what ``save_pretrained``
    writes (:meth:`Context.saved_location`)."""
    missing = [n for n in block_norms if f"{ctx.layer_prefix}{n}.weight" not in ctx.saved_keys]
    if not missing or not ctx.anatomy.layers or not ctx.layer_prefix:
        return block_norms
    renamed: dict[str, str] = {}
    for name in missing:
        location = ctx.saved_location(f"{ctx.anatomy.layers_path}.0.{name}.weight")
        if location is not None and location.whole and location.key.startswith(ctx.layer_prefix):
            renamed[name] = location.module[len(ctx.layer_prefix) :]
    if renamed:
        ctx.evidence.append(
            "block norms saved under other names: " + ", ".join(f"{a} -> {b}" for a, b in sorted(renamed.items()))
        )
    return {renamed.get(name, name): role for name, role in block_norms.items()}


def constant_eps_norms(ctx: Context, eps_field: str) -> dict[str, float]:
    """The norms of the tiny model whose epsilon does not follow ``eps_field``, measured: a
    tiny model built with the field moved holds a new epsilon in every norm that reads it; one
    that keeps its value is a constant of the modeling code (CTRL's block ``LayerNorm(d_model,
    eps=1e-6)`` beside a final norm that reads ``layer_norm_epsilon``), whether or not it equals
    the field's value. Module path (layer index as ``{}``) -> the constant."""
    value = getattr(ctx.tiny, eps_field, None)
    if not isinstance(value, float):
        return {}
    moved = copy.deepcopy(ctx.tiny)
    try:
        setattr(moved, eps_field, value * 1.37 if value else 1e-5)
        variant = build_tiny_model(moved, seed=0, trust_remote_code=ctx.trust_remote_code)
    except Exception as exc:  # config validators and model builds raise several exception types
        logger.debug("moving %s to probe the norms' epsilon failed: %s", eps_field, exc)
        return {}
    moved_modules = dict(variant.named_modules())
    constants: dict[str, float] = {}
    for name, module in ctx.model.named_modules():
        held = _norm_eps(module) if mt.is_norm(module) else None
        twin = moved_modules.get(name)
        if held is None or twin is None:
            continue
        if (after := _norm_eps(twin)) is not None and math.isclose(after, held):
            constants[re.sub(r"\.\d+\.", ".{}.", name, count=1)] = held
    return constants


def _name_constant_block_norm_eps(ctx: Context, eps_field: str, roles: dict[str, str]) -> None:
    """Name the block or final norms whose epsilon is a constant beside ``eps_field`` (the port
    gives every norm ``norm_eps``, read from that field: right only while the two agree), and key
    the fact with each constant and the role probed for each block norm among them.
    ``roles``: layer 0's block norms (name inside the layer) -> the role probed for each."""
    layer = ctx.layer_prefix.replace(".0.", ".{}.", 1)
    block = {f"{layer}{name}" for name in ctx.anatomy.norms}
    final = {name for name, module in ctx.model.named_modules() if module is ctx.anatomy.final_norm}
    constants = {name: value for name, value in constant_eps_norms(ctx, eps_field).items() if name in block | final}
    if not constants:
        return
    held = ", ".join(f"{name} eps={value:g}" for name, value in sorted(constants.items()))
    ctx.evidence.append(f"norm epsilon: {held} is a constant of the modeling code (moving {eps_field} leaves it)")
    feature = f"norms whose epsilon is a constant, not {eps_field}: {held}"
    ctx.other.append(feature)
    ctx.places[feature] = BLOCK_NORMS_BUILT if set(constants) & block else FINAL_NORM_BUILT
    probed = {f"{layer}{name}": role for name, role in roles.items()}
    ctx.facts[feature] = NamedFact(
        key="constant_norm_eps",
        data={
            "field": eps_field,
            "constants": constants,
            "roles": {name: probed[name] for name in constants if name in probed},
        },
    )


def _norm_eps_field(config: PretrainedConfig) -> str | None:
    """The config field of the norms' epsilon: the first float field named ``*eps`` or ``*epsilon``."""
    return next(
        (k for k, v in sorted(config.to_dict().items()) if k.endswith(("eps", "epsilon")) and isinstance(v, float)),
        None,
    )


def norm_features(ctx: Context) -> NormFeatures:
    norm = ctx.anatomy.final_norm or next(iter(ctx.anatomy.norms.values()), None)
    kind = probes.probe_norm_kind(norm, ctx.tiny.hidden_size) if norm is not None else NormKind.OTHER
    eps_field = _norm_eps_field(ctx.config)
    placement, probed_roles = probes.probe_block_norms(ctx.model, ctx.anatomy, ctx.tiny)
    block_norms = _saved_block_norm_names(ctx, probed_roles)
    if placement is None:
        placement = NormPlacement.PRE
        ctx.evidence.append("norm placement: the layer probe was inconclusive; assumed pre-norm")
        ctx.other.append("block structure the norm probe could not read")
    held = _norms_eps(ctx)
    declared = getattr(ctx.tiny, eps_field, None) if eps_field else None
    if eps_field and held is not None and isinstance(declared, float) and not math.isclose(declared, held):
        # The config has the field but the norms are built without it (BioGPT: layer_norm_eps
        # 1e-12, nn.LayerNorm(embed_dim) at its default 1e-5).
        ctx.evidence.append(f"{eps_field}={declared:g} is not what the norms hold ({held:g}): the field is unused")
        eps_field = None
    eps: float | None
    if eps_field is not None:
        eps = float(ctx.get(eps_field))
        _name_constant_block_norm_eps(ctx, eps_field, probed_roles)
    elif held is not None:
        eps = held
        ctx.evidence.append(f"norm epsilon {held:g}: a constant of the modeling code, no config field")
    elif norm is not None:
        # The norms keep no readable epsilon attribute (OLMo's functional LayerNorm): measure it.
        eps = probes.probe_norm_eps(norm, ctx.tiny.hidden_size, kind)
        ctx.evidence.append(f"norm epsilon: no config field; measured {eps!r} on {type(norm).__name__}")
    else:
        eps = None
    return NormFeatures(
        kind=kind,
        eps=eps,
        eps_field=eps_field,
        placement=placement,
        block_norms=block_norms,
        final_norm=ctx.anatomy.final_norm is not None,
    )


# -------------------------------------------------------------------- scalars


def scalar_features(ctx: Context) -> ScalarFeatures:
    """Embedding, residual and logit factors, and the config fields that set them.

    A factor is reported when the default config moves it, and also when the forward
    reads a config field for it whose default is neutral (1.0): a checkpoint sets it.
    """
    head_bias = _lm_head_bias(ctx)
    projection: EmbeddingProjection | str | None = None
    scale = probes.probe_embedding_scale(ctx.model, ctx.anatomy, ctx.tiny)
    embedding_source = _scalar_source(ctx, "embedding")
    embedding_norm: tuple[NormKind, str] | None = None
    if scale is None:
        kind, value = "none", None
        embedding_norm = _embedding_norm(ctx)
        if embedding_norm is None:
            projection = embedding_projection(ctx)
            if isinstance(projection, EmbeddingProjection):
                ctx.evidence.append(
                    f"embedding projection: {projection.in_module} before layer 0, {projection.out_module} after the "
                    f"final norm; embedding width from {projection.field} (probe)"
                )
            else:
                ctx.other.append(_embedding_transform(ctx) + (f" ({projection})" if projection else ""))
    elif embedding_source is not None:
        kind = "constant"
        value = _full_size_value(ctx, embedding_source, scale)
    elif math.isclose(scale, 1.0, rel_tol=1e-4):
        kind, value = "none", None
    elif math.isclose(scale, math.sqrt(ctx.tiny.hidden_size), rel_tol=1e-3):
        kind, value = "sqrt_dim", math.sqrt(ctx.config.hidden_size)
    else:
        match = probes.matching_field(ctx.tiny, scale)
        kind = "constant"
        embedding_source = ConfigScalar(field=match[0], relation=match[1]) if match else None
        value = _full_size_value(ctx, embedding_source, scale)
    residual_field = ctx.scalar_role("residual")
    residual = ctx.get(residual_field.name) if residual_field else None
    residual_source = None
    if residual_field is not None and residual_field.relation is not None:
        tiny_residual = probes.probe_residual_multiplier(ctx.model, ctx.anatomy, ctx.tiny)
        if tiny_residual is not None:
            residual_source = _with_size_factor(ctx, residual_field.name, residual_field.relation, tiny_residual)
            if residual_source is None:
                ctx.other.append(
                    f"residual multiplier {tiny_residual:.4g} that {residual_field.name} and the model sizes "
                    "do not explain"
                )
            else:
                residual = _full_size_value(ctx, residual_source, tiny_residual)
    logit = probes.probe_logit_multiplier(ctx.model, ctx.anatomy, ctx.tiny, final_logit_softcap(ctx.tiny))
    logit_source = _scalar_source(ctx, "logit")
    final_cap = final_logit_softcap(ctx.config)
    logit_value = None
    if logit is None:
        if final_cap is None:
            ctx.evidence.append("logit probe: logits are not a constant multiple of lm_head(h)")
    elif not math.isclose(logit, 1.0, rel_tol=1e-4):
        if logit_source is not None:
            logit_source = _with_size_factor(ctx, logit_source.field, logit_source.relation, logit) or logit_source
        else:
            # A field whose value only happens to equal the factor does not move it: a field
            # times a model size that does comes first; failing both, the plain match.
            match = probes.matching_field(ctx.tiny, logit)
            if match is not None and _moves_logit(ctx, match[0], match[1], logit):
                logit_source = ConfigScalar(field=match[0], relation=match[1])
            else:
                logit_source = _sized_source(ctx, logit) or (
                    ConfigScalar(field=match[0], relation=match[1]) if match else None
                )
        logit_value = _full_size_value(ctx, logit_source, logit)
    tied, tying_field = weight_tying(ctx)
    padding_field = padding_idx_field(ctx)
    return ScalarFeatures(
        embedding_scale=value,
        embedding_scale_kind=kind,
        embedding_scale_source=embedding_source,
        embedding_norm=embedding_norm[0] if embedding_norm else None,
        embedding_norm_module=embedding_norm[1] if embedding_norm else None,
        residual_multiplier=float(residual)
        if isinstance(residual, (int, float)) and not isinstance(residual, bool) and residual != 1.0
        else None,
        residual_multiplier_field=residual_field.name if residual_field else None,
        residual_multiplier_source=residual_source,
        logit_multiplier=logit_value,
        logit_multiplier_source=logit_source,
        final_logit_softcap=final_cap,
        tie_word_embeddings=tied,
        tying_field=tying_field,
        padding_idx_field=padding_field,
        lm_head_bias=head_bias,
        embedding_projection_field=projection.field if isinstance(projection, EmbeddingProjection) else None,
        embedding_projection_in=projection.in_module if isinstance(projection, EmbeddingProjection) else None,
        embedding_projection_out=projection.out_module if isinstance(projection, EmbeddingProjection) else None,
    )


TYING_FIELD = "tie_word_embeddings"


def weight_tying(ctx: Context) -> tuple[bool, str | None]:
    """Whether HF's LM head is the embedding for this config, and the config field that
    decides it: the tiny model is built with ``tie_word_embeddings`` True and False and
    its head probed each time (:func:`skill.analysis.probes.probe_head_is_embedding`).

    ``(config value, "tie_word_embeddings")`` when HF follows the field; ``(False, None)``
    when it keeps its own head either way (remote code that defines no tying); ``(True,
    None)`` when it ties either way."""
    configured = bool(ctx.get(TYING_FIELD, False))
    outcomes: dict[bool, bool | None] = {}
    for value in (True, False):
        if bool(getattr(ctx.tiny, TYING_FIELD, False)) == value:
            outcomes[value] = probes.probe_head_is_embedding(ctx.model)
            continue
        config = copy.deepcopy(ctx.tiny)
        setattr(config, TYING_FIELD, value)
        try:
            model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
        except Exception as exc:  # config validators and constructors raise several exception types
            logger.debug("building with %s=%s failed: %s", TYING_FIELD, value, exc)
            outcomes[value] = None
            continue
        outcomes[value] = probes.probe_head_is_embedding(model)
    if None in outcomes.values() or outcomes == {True: True, False: False}:
        return configured, TYING_FIELD
    tied = bool(outcomes[True])
    ctx.evidence.append(
        f"weight tying probe: the LM head {'is' if tied else 'is not'} the embedding with {TYING_FIELD} True and "
        f"False alike; the port {'ties' if tied else 'keeps its own head'} whatever the config says"
    )
    return tied, None


PAD_FIELD = "pad_token_id"


def padding_idx_field(ctx: Context) -> str | None:
    """The config field naming the embedding row HF never trains (``padding_idx``): with
    ``pad_token_id`` set to one id, then another, the tiny model's token embedding gives
    that row no gradient and the other one some (both probed; see
    :func:`skill.analysis.probes.probe_frozen_embedding_row`). ``None`` when the config has
    no such field or the embedding trains every row it looks up."""
    if PAD_FIELD not in ctx.tiny.to_dict():
        return None
    vocab = int(ctx.tiny.vocab_size)
    first, second = 3 % vocab, 5 % vocab
    frozen = []
    for row, other in ((first, second), (second, first)):
        config = copy.deepcopy(ctx.tiny)
        setattr(config, PAD_FIELD, row)
        try:
            model = build_tiny_model(config, seed=0, trust_remote_code=ctx.trust_remote_code)
        except Exception as exc:  # config validators and constructors raise several exception types
            logger.debug("building with %s=%s failed: %s", PAD_FIELD, row, exc)
            return None
        frozen.append(probes.probe_frozen_embedding_row(model, row, other))
    if frozen != [True, True]:
        return None
    ctx.evidence.append(f"embedding padding_idx probe: the row {PAD_FIELD} names gets no gradient from its lookups")
    return PAD_FIELD


@dataclass(frozen=True)
class EmbeddingProjection:
    """Embeddings narrower than the blocks: ``in_module`` maps them up before layer 0,
    ``out_module`` maps the final norm's output back down for the LM head."""

    field: str
    in_module: str
    out_module: str


def _bias_free_linear(ctx: Context, name: str, module: nn.Module, n_in: int, n_out: int) -> bool:
    proj = mt.projection(name, module)
    return (
        proj is not None
        and not proj.bias
        and proj.orientation == "out_in"
        and (proj.in_features, proj.out_features) == (n_in, n_out)
        and f"{name}.weight" in ctx.saved_keys
    )


def embedding_projection(ctx: Context) -> EmbeddingProjection | str | None:
    """The embedding projections (OPT's ``project_in``/``project_out``), probed: the one
    module between the token embedding and layer 0 maps the embedding's width to
    ``hidden_size`` straight from the embedding's output (positions are added after it), and
    one top-level module maps the final norm's output back to that width for the LM head.
    The width's config field is the one that sets it. ``None`` when the embeddings are not
    projected like that; a string naming what did not fit when they nearly are."""
    anatomy = ctx.anatomy
    embedding, head = anatomy.embedding, anatomy.lm_head
    # What the head reads last: the final norm, or the last layer in a post-LN stack without one.
    final_norm = anatomy.final_norm if anatomy.final_norm is not None else anatomy.layers[-1]
    weight = getattr(embedding, "weight", None)
    hidden = int(ctx.tiny.hidden_size)
    if embedding is None or head is None or not isinstance(weight, torch.Tensor):
        return None
    width = int(weight.shape[1])
    found = probes.modules_before_first_layer(ctx.model, anatomy, ctx.tiny)
    modules = dict(ctx.model.named_modules())
    if width == hidden or len(found) != 1 or not _bias_free_linear(ctx, found[0], modules[found[0]], width, hidden):
        return None
    in_name = found[0]
    layers = set(anatomy.layers.modules())
    outs = [
        name
        for name, module in modules.items()
        if name != in_name and module not in layers and _bias_free_linear(ctx, name, module, hidden, width)
    ]
    if len(outs) != 1:
        return f"{len(outs)} projections back to the embedding width"
    out_name = outs[0]
    seen: dict[str, Any] = {}

    def keep(key: str, what: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            seen[key] = args[0] if what == "input" else output[0] if isinstance(output, tuple) else output

        return hook

    handles = [
        embedding.register_forward_hook(keep("embedding", "output")),
        modules[in_name].register_forward_hook(keep("in", "input")),
        final_norm.register_forward_hook(keep("norm", "output")),
        modules[out_name].register_forward_hook(keep("out", "input")),
        head.register_forward_hook(keep("head", "input")),
    ]
    try:
        with torch.no_grad():
            probes.logits(ctx.model, probes.tokens_for(ctx.tiny, 5))
    finally:
        for handle in handles:
            handle.remove()
    if len(seen) != 5:
        return "the projections did not run in one forward"
    if not torch.equal(seen["in"], seen["embedding"]):
        return f"{in_name} reads more than the token embeddings"
    if not (torch.equal(seen["out"], seen["norm"]) and torch.equal(seen["head"], modules[out_name](seen["norm"]))):
        return f"{out_name} does not map the final norm's output to the LM head"
    fields = [
        name
        for name, value in ctx.tiny.to_dict().items()
        if isinstance(value, int) and not isinstance(value, bool) and value == width and "embed" in name
    ]
    if len(fields) != 1:
        return "no single config field sets the embedding width" if not fields else f"fields {fields} set the width"
    return EmbeddingProjection(field=fields[0], in_module=in_name, out_module=out_name)


def _lm_head_bias(ctx: Context) -> bool:
    """Whether the LM head adds a bias the checkpoint holds (Phi, GPT-J: ``lm_head.bias``).

    A bias the forward adds but no saved key holds has nothing to load: named as other."""
    head = ctx.anatomy.lm_head
    weight = getattr(head, "weight", None)
    if head is None or not isinstance(getattr(head, "bias", None), torch.Tensor) or weight is None:
        return False
    path = next((name for name, module in ctx.model.named_modules() if module is head), None)
    key = f"{path}.bias"
    if key not in ctx.saved_keys:
        # Saved under another name (as GPT-NeoX saves lm_head as embed_out): the one
        # top-level [vocab] bias beside a weight of the head's shape.
        stack = ctx.layer_prefix.removesuffix("0.")
        shape = tuple(weight.shape)
        renamed = [
            k
            for k, s in ctx.saved_keys.items()
            if k.endswith(".bias")
            and not (stack and k.startswith(stack))
            and tuple(s) == shape[:1]
            and tuple(ctx.saved_keys.get(k.removesuffix(".bias") + ".weight", ())) == shape
        ]
        if len(renamed) != 1:
            ctx.other.append("LM head with a bias the checkpoint does not hold")
            return False
        (key,) = renamed
    ctx.evidence.append(f"LM head bias: {key} (checkpoint key)")
    return True


def _embedding_norm(ctx: Context) -> tuple[NormKind, str] | None:
    """(kind, module path) when the one thing between the embedding and layer 0 is a norm
    whose weights the checkpoint holds (Bloom's word_embeddings_layernorm), or a weightless
    one (NanoChat's, which is also its final norm: nothing to hold)."""
    found = probes.modules_before_first_layer(ctx.model, ctx.anatomy, ctx.tiny)
    if len(found) != 1:
        return None
    (name,) = found
    module = dict(ctx.model.named_modules())[name]
    weightless = not any(True for _ in module.parameters())
    if not mt.is_norm(module) or not (weightless or f"{name}.weight" in ctx.saved_keys):
        return None
    if module is ctx.anatomy.final_norm and not weightless:
        return None  # one set of weights in two places: the port's two norms would not share it
    ctx.evidence.append(f"embedding norm before layer 0: {name} (probe)")
    return probes.probe_norm_kind(module, ctx.tiny.hidden_size), name


def _embedding_transform(ctx: Context) -> str:
    """What transforms the embeddings before layer 0, named: the module(s) whose forward runs
    between the token embedding and layer 0 (probed), a norm by its kind."""
    modules = dict(ctx.model.named_modules())
    named = []
    for name in probes.modules_before_first_layer(ctx.model, ctx.anatomy, ctx.tiny):
        module = modules[name]
        if mt.is_norm(module):
            kind = probes.probe_norm_kind(module, ctx.tiny.hidden_size)
            named.append(f"embedding norm ({kind.value}, {name})")
        elif (proj := mt.projection(name, module)) is not None:
            named.append(f"embedding projection {proj.in_features} -> {proj.out_features} ({name})")
        else:
            named.append(f"{type(module).__name__} ({name})")
    if not named:
        return "embeddings transformed before layer 0 beyond a constant scale (no module found by the probe)"
    return "embeddings transformed before layer 0: " + ", ".join(named)


def _full_size_value(ctx: Context, source: ConfigScalar | None, tiny_value: float) -> float:
    """The full-size value of a probed factor, through the config field(s) that explain it."""
    if source is None:
        ctx.evidence.append(f"factor {tiny_value:.6g} measured on the tiny model; no config field explains it")
        return tiny_value
    ctx.evidence.append(f"factor {tiny_value:.6g} = {describe_source(source)}")
    value = 1.0
    part: ConfigScalar | None = source
    while part is not None:
        full = getattr(ctx.config, part.field, None)
        if not isinstance(full, (int, float)) or isinstance(full, bool) or not full:
            return tiny_value
        value *= probes.RELATIONS[part.relation](float(full))
        part = part.times
    return value


def describe_source(source: ConfigScalar) -> str:
    """``scale_depth * num_hidden_layers**-0.5``: a factor's config expression, for people."""
    text = source.relation.replace("x", source.field)
    return text if source.times is None else f"{text} * {describe_source(source.times)}"


# Model sizes a scalar factor may be divided or multiplied by (MiniCPM: the residual
# multiplier scale_depth / sqrt(num_hidden_layers), the logits dim_model_base / hidden_size).
_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")


def _size_factor(ctx: Context, rest: float) -> ConfigScalar | None:
    """The model size whose relation is ``rest`` on the tiny config, if one is."""
    for name in _SIZE_FIELDS:
        value = getattr(ctx.tiny, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value in (0, 1):
            continue
        for relation, derive in probes.RELATIONS.items():
            if math.isclose(derive(float(value)), rest, rel_tol=1e-3):
                return ConfigScalar(field=name, relation=relation)
    return None


def _with_size_factor(ctx: Context, field: str, relation: str, tiny_factor: float) -> ConfigScalar | None:
    """``relation(field)``, times a model size when the field alone leaves a constant over."""
    value = getattr(ctx.tiny, field, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value:
        return None
    direct = probes.RELATIONS[relation](float(value))
    if math.isclose(direct, tiny_factor, rel_tol=1e-3):
        return ConfigScalar(field=field, relation=relation)
    size = _size_factor(ctx, tiny_factor / direct) if direct else None
    return ConfigScalar(field=field, relation=relation, times=size) if size is not None else None


def _moves_logit(ctx: Context, name: str, relation: str, tiny_logit: float) -> bool:
    """Whether moving config field ``name`` moves the logit factor by ``relation``."""
    tokens = probes.tokens_for(ctx.tiny, 6)
    value = getattr(ctx.tiny, name, None)
    moved = _moved_model(ctx, name, value, tokens, probes.logits(ctx.model, tokens))
    if moved is None:
        return False
    model, new_value = moved
    try:
        anatomy = mt.anatomy(model, int(ctx.tiny.num_hidden_layers))
        new_logit = probes.probe_logit_multiplier(model, anatomy, ctx.tiny, final_logit_softcap(ctx.tiny))
    except LookupError:
        return False
    return new_logit is not None and probes.relation_of(value, new_value, tiny_logit, new_logit) == relation


def _sized_source(ctx: Context, tiny_logit: float) -> ConfigScalar | None:
    """A logit factor no single field explains: a config field times a model size, the field
    confirmed by moving it (its factor must move by its relation)."""
    for size_name in _SIZE_FIELDS:
        size = getattr(ctx.tiny, size_name, None)
        if isinstance(size, bool) or not isinstance(size, int) or size in (0, 1):
            continue
        for size_relation, derive in probes.RELATIONS.items():
            rest = tiny_logit / derive(float(size))
            for name, value in sorted(vars(ctx.tiny).items()):
                if name in _SIZE_FIELDS or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if value in (0, 1):
                    continue
                for relation, field_derive in probes.RELATIONS.items():
                    if not math.isclose(field_derive(float(value)), rest, rel_tol=1e-3):
                        continue
                    if _moves_logit(ctx, name, relation, tiny_logit):
                        ctx.evidence.append(f"logit factor moves with {name} ({relation}), times {size_name}")
                        return ConfigScalar(
                            field=name, relation=relation, times=ConfigScalar(field=size_name, relation=size_relation)
                        )
    return None


# ------------------------------------------------------------ weight orientation


def transposed_weights(ctx: Context) -> list[str]:
    """Layer checkpoint keys (``{}`` for the layer) of projections stored ``(in, out)``
    (transformers' ``Conv1D``, probed by :func:`modules.stores_in_out`), so the adapter
    transposes them."""
    prefix = ctx.layer_prefix
    if not prefix.endswith(".0."):
        return []
    template = prefix[: -len("0.")] + "{}."
    keys = []
    for proj in mt.projections(ctx.anatomy.layers[0]):
        key = f"{prefix}{proj.name}.weight"
        if proj.orientation == "in_out" and key in ctx.saved_keys:
            keys.append(template + key[len(prefix) :])
    if keys:
        ctx.evidence.append("projections stored (in, out) (Conv1D, probed): " + ", ".join(sorted(keys)))
    return sorted(keys)


# ------------------------------------------------------------ per-layer differences


def _module_signature(module: nn.Module, prefix: str, written: Set[str] = frozenset()) -> dict[str, str]:
    """Every sub-module of a layer part by path: its class and its own parameters' shapes, but
    those an edit ``written`` on some layers only."""
    signature = {}
    for name, sub in module.named_modules():
        path = f"{prefix}.{name}" if name else prefix
        params = ", ".join(
            f"{p}{tuple(t.shape)}" for p, t in sub.named_parameters(recurse=False) if f"{path}.{p}" not in written
        )
        signature[path] = f"{type(sub).__name__}[{params}]"
    return signature


def _layer_parts(ctx: Context, layer: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """(FFN signature, signature of the rest) of one decoder layer.

    The FFN is the child named like layer 0's FFN or holding routed experts; a dense
    layer and an MoE layer differ there by design (the MoE layer pattern says which).
    """
    ffn: dict[str, str] = {}
    rest: dict[str, str] = {}
    for name, child in layer.named_children():
        is_ffn = name == ctx.anatomy.ffn_name or mt.layer_has_experts(child)
        (ffn if is_ffn else rest).update(_module_signature(child, name, ctx.per_layer_parameters))
    rest.update(_module_signature_own(layer))
    return ffn, rest


def _module_signature_own(layer: nn.Module) -> dict[str, str]:
    params = ", ".join(f"{p}{tuple(t.shape)}" for p, t in layer.named_parameters(recurse=False))
    return {"": f"{type(layer).__name__}[{params}]"}


def _layers_text(indices: list[int], total: int) -> str:
    shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
    return f"layer{'s' if len(indices) > 1 else ''} {shown} of {total}"


def per_layer_differences(ctx: Context, exempt: Set[str] = frozenset()) -> list[str]:
    """Parts of a layer that differ from layer 0's (from the first MoE layer's, for experts).

    The checklist describes layer 0; a bias, norm, QK norm, projection width or module
    kind that another layer has differently would be ported wrong, so each one is named
    ("per-layer difference: ...") and the family refused until an edit covers it. Read on
    the full-depth stack (tiny widths) where it builds, else on the tiny stack. Modules at the
    ``exempt`` paths (a difference an edit covers, measured elsewhere) are not compared.
    """
    _, layers, full = ctx.layer_stack()
    parts = [_layer_parts(ctx, layer) for layer in layers]
    experts = [mt.layer_has_experts(layer) for layer in layers]
    differing: dict[str, list[int]] = {}
    for index, (ffn, rest) in enumerate(parts):
        ref_index = next(i for i, e in enumerate(experts) if e == experts[index])
        for kind, mine, theirs, ref in (
            ("", rest, parts[0][1], 0),
            ("FFN ", ffn, parts[ref_index][0], ref_index),
        ):
            for path in sorted(set(mine) | set(theirs)):
                if mine.get(path) == theirs.get(path) or any(path == e or path.startswith(f"{e}.") for e in exempt):
                    continue
                here, there = mine.get(path, "absent"), theirs.get(path, "absent")
                what = f"{kind}{path or 'layer'}: {here} (layer {ref}: {there})"
                differing.setdefault(what, []).append(index)
    found = []
    for what, indices in differing.items():
        found.append(f"per-layer difference: {what} in {_layers_text(indices, len(layers))}")
    if found:
        ctx.evidence.append(
            f"per-layer differences read over the {'full-depth' if full else 'tiny'} stack of {len(layers)} layers"
        )
    return found


def head_transform(ctx: Context, scalars: ScalarFeatures) -> list[str]:
    """Modules between the final norm and the LM head's projection, named.

    Archon's head is ``output(norm(h))`` (times a constant, or through a measured embedding
    projection). A model whose head reads something else, as ModernBERT-decoder's
    prediction head (dense, activation, norm) before its ``decoder`` projection, would be
    ported without it: the parametered top-level modules beside the base model and the
    head are named.
    """
    if scalars.embedding_projection_out is not None:
        return []
    if probes.head_reads_final_norm(ctx.model, ctx.anatomy, ctx.tiny) is not False:
        return []
    head = ctx.anatomy.lm_head
    base = ctx.anatomy.layers_path.split(".", 1)[0]
    between = [
        f"{name} ({type(child).__name__})"
        for name, child in ctx.model.named_children()
        if child is not head and name != base and any(True for _ in child.parameters())
    ]
    ctx.evidence.append("LM head: its input is no constant multiple of the final norm's output")
    return [f"a transform between the final norm and the LM head: {', '.join(between) or 'unnamed'}"]


def layer_stack_structure(ctx: Context) -> list[str]:
    """What makes the model more than one stack of layers run once each, in order.

    Archon runs ``layers`` once, in order. A model with decoder layers outside that list
    (a second stack) or whose layer 0 runs more than once per forward (a recurrent,
    looped stack: HRM's H/L cycles) is named. Counted on one forward of the tiny model.
    """
    layers = ctx.anatomy.layers
    if layers is None or len(layers) == 0:
        return []
    found = []
    kind = type(layers[0])
    instances = sum(1 for module in ctx.model.modules() if type(module) is kind)
    if instances > len(layers):
        found.append(f"{instances} {kind.__name__} modules, {len(layers)} in the layer list (more than one stack)")
    calls = probes.count_calls(ctx.model, layers[0], ctx.tiny)
    if calls > 1:
        found.append(f"layer 0 runs {calls} times per forward (a recurrent layer stack)")
    held = {
        name: child
        for name, child in layers[0].named_children()
        if any(f"{ctx.layer_prefix}{name}.{param}" in ctx.saved_keys for param, _ in child.named_parameters())
    }
    idle = probes.modules_not_run(ctx.model, held, ctx.tiny)
    if idle:
        # TrOCR's and BART's decoders keep cross-attention (encoder_attn) for an encoder the
        # causal LM never has: Archon has nothing to load those weights into or write back.
        found.append(f"layer modules the causal forward never runs, held by the checkpoint: {', '.join(idle)}")
    if found:
        ctx.evidence.append(f"layer stack: {'; '.join(found)}")
    return found


# ------------------------------------------------------------ checkpoint modules

_ATTENTION_PARTS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo"}
# Archon's projection of a gated attention output's gate (the output_gate edit writes it).
OUTPUT_GATE_PART = "attention.wg"


def saved_qkv(ctx: Context, roles: dict[str, mt.Projection]) -> tuple[str, list[str]] | None:
    """Separate q, k and v projections in memory that ``save_pretrained`` writes as one
    tensor (SarvamMoE's ``attention.query_key_value``): that module, ``{}`` for the layer,
    and the roles in the order its rows hold them; ``None`` otherwise."""
    names = {id(module): name for name, module in ctx.model.named_modules()}
    locations = {}
    for role in ("q", "k", "v"):
        proj = roles.get(role)
        name = names.get(id(proj.module)) if proj is not None else None
        location = ctx.saved_location(f"{name}.weight") if name else None
        if location is None or location.whole:
            return None
        locations[role] = location
    if len({loc.key for loc in locations.values()}) != 1:
        return None
    key = locations["q"].module
    if not key.startswith(ctx.layer_prefix):
        return None
    order = sorted(locations, key=lambda role: locations[role].start)
    return ctx.layer_prefix.removesuffix("0.") + "{}." + key[len(ctx.layer_prefix) :], order


def _layer_key_template(ctx: Context, name: str | None, saved_modules: set[str]) -> str | None:
    """The checkpoint module of the layer module ``name`` (of any layer: a MoE block's norm may
    sit on layer 1 of the tiny model), with ``{}`` for the layer index; found by value when
    ``save_pretrained`` writes it under another name (A.X-K1's ``mlp.post_mlp_layernorm`` is
    saved as ``post_mlp_layernorm``)."""
    layers_path = ctx.anatomy.layers_path
    found = re.match(rf"{re.escape(layers_path)}\.(?P<index>\d+)\.(?P<inner>.+)$", name or "")
    if found is None or name is None:
        return None
    if name in saved_modules:
        return f"{layers_path}.{{}}.{found['inner']}"
    stack = ctx.layer_prefix.removesuffix("0.")
    saved_layer = f"{stack}{found['index']}."
    location = ctx.saved_location(f"{name}.weight")
    if location is None or not location.whole or not location.key.startswith(saved_layer):
        return None
    return f"{stack}{{}}.{location.module[len(saved_layer) :]}"


def _fused_shared_gate_up(block: nn.Module | None) -> nn.Module | None:
    """The MoE block's shared MLP's projection that stacks its gate and up rows: of its two
    projections, the one twice as wide as the other (its down projection) reads, and whose
    input width that one writes."""
    if block is None or mt.experts_module(block) is None:
        return None
    shared = next((c for n, c in block.named_children() if "shared" in n and "gate" not in n), None)
    projs = mt.projections(shared) if shared is not None else []
    if len(projs) != 2:
        return None
    for up, down in (projs, projs[::-1]):
        if up.out_features == 2 * down.in_features and down.out_features == up.in_features:
            return up.module
    return None


def checkpoint_modules(ctx: Context) -> tuple[dict[str, str], dict[str, list[str]]]:
    """HF module -> Archon module, found by structure, for the modules the checkpoint holds.

    Layer modules are written with ``{}`` for the layer index (``gpt_neox.layers.{}.
    attention.dense`` -> ``layers.{}.attention.wo``); the embedding, final norm and LM head
    at the top (the head also when a tied checkpoint leaves it out). Roles come from the
    anatomy: the attention's projections by shape and name, a dense MLP's up and down
    projections by their widths. The second map holds a fused q/k/v projection -> the
    Archon projections it stacks (in q, k, v order; its row layout is in the checklist),
    and a dense MLP's fused gate/up projection -> w1, w3.
    Block norms are named by their probed roles (``NormFeatures.block_norms``), MoE blocks
    by the adapter's rules; neither is here.
    """
    anatomy = ctx.anatomy
    names = {id(module): name for name, module in ctx.model.named_modules()}
    saved_modules = {key.rsplit(".", 1)[0] for key in ctx.saved_keys}
    layer0 = f"{anatomy.layers_path}.0."
    mapping: dict[str, str] = {}
    fused: dict[str, list[str]] = {}

    def template(module: nn.Module) -> str | None:
        name = names.get(id(module))
        if name is None or not name.startswith(layer0):
            return None
        if name in saved_modules:
            return f"{anatomy.layers_path}.{{}}.{name[len(layer0) :]}"
        # Saved under another name (transformers' checkpoint conversion renames it).
        location = ctx.saved_location(f"{name}.weight")
        if location is None or not location.whole or not location.key.startswith(ctx.layer_prefix):
            return None
        return ctx.layer_prefix.removesuffix("0.") + "{}." + location.module[len(ctx.layer_prefix) :]

    roles = _attention_projections(ctx)
    stacked = saved_qkv(ctx, roles)
    if stacked is not None:
        fused[stacked[0]] = [f"layers.{{}}.{_ATTENTION_PARTS[role]}" for role in stacked[1]]
    for role, proj in roles.items():
        if stacked is not None and role in stacked[1]:
            continue
        hf = template(proj.module)
        if hf is None:
            continue
        if role == "qkv":
            fused[hf] = [f"layers.{{}}.{part}" for part in ("attention.wq", "attention.wk", "attention.wv")]
        elif role in _ATTENTION_PARTS:
            mapping[hf] = f"layers.{{}}.{_ATTENTION_PARTS[role]}"
        elif _is_gate_projection(ctx, role, proj):
            mapping[hf] = f"layers.{{}}.{OUTPUT_GATE_PART}"  # the output gate's projection
    mlp = anatomy.ffn if anatomy.ffn is not None and mt.experts_module(anatomy.ffn) is None else None
    if mlp is not None:
        hidden = ctx.tiny.hidden_size
        projs = mt.projections(mlp)
        ups = [p for p in projs if p.in_features == hidden]
        downs = [p for p in projs if p.out_features == hidden and p.in_features != hidden]
        parts: dict[str, mt.Projection] = {}
        if len(downs) == 1:
            parts["w2"] = downs[0]
        if len(ups) == 1 and downs and ups[0].out_features == downs[0].in_features:
            parts["w1"] = ups[0]  # plain MLP: w1 is the up projection
        elif len(ups) == 1 and downs and ups[0].out_features == 2 * downs[0].in_features:
            # One projection holds the gate, then the up rows (whatever it is called:
            # gate_up_proj, or GPT-2's c_fc in a gated MLP).
            hf = template(ups[0].module)
            if hf is not None:
                fused[hf] = [f"layers.{{}}.{part}" for part in ("feed_forward.w1", "feed_forward.w3")]
        elif len(ups) == 2:
            gates = [p for p in ups if "gate" in p.name.lower()]
            if len(gates) == 1:
                parts["w1"] = gates[0]
                parts["w3"] = next(p for p in ups if p is not gates[0])
        for part, proj in parts.items():
            hf = template(proj.module)
            if hf is not None:
                mapping[hf] = f"layers.{{}}.feed_forward.{part}"
    shared = _fused_shared_gate_up(anatomy.ffn)
    if shared is not None and template(shared) is not None:
        # The shared experts' one projection holding the gate, then the up rows (MiniMax-M3's
        # shared_experts.gate_up_proj), as a dense MLP's; their down projection is the MoE rules'.
        fused[str(template(shared))] = [f"layers.{{}}.moe.shared_experts.{part}" for part in ("w1", "w3")]
    for norm, archon in ctx.contract_norms.items():
        hf = _layer_key_template(ctx, names.get(id(norm)), saved_modules)
        if hf is not None:
            mapping[hf] = f"layers.{{}}.{archon}"
    if anatomy.attention is not None:
        # The QK norms, found by structure (Archon's q_norm / k_norm whatever HF calls them).
        for pair, archon in zip(mt.qk_norms(anatomy.attention), ("q_norm", "k_norm"), strict=True):
            hf = template(pair[1]) if pair is not None else None
            if hf is not None:
                mapping[hf] = f"layers.{{}}.attention.{archon}"
    for module, archon, needs_saved in (
        (anatomy.embedding, "tok_embeddings", True),
        (anatomy.final_norm, "norm", True),
        (anatomy.lm_head, "output", False),
    ):
        name = names.get(id(module)) if module is not None else None
        if name and name not in saved_modules and needs_saved:
            location = ctx.saved_location(f"{name}.weight")
            name = location.module if location is not None and location.whole else None
        if name:
            mapping[name] = archon
    projection = embedding_projection(ctx)
    if isinstance(projection, EmbeddingProjection):
        mapping[projection.in_module] = "project_in"
        mapping[projection.out_module] = "project_out"
    head = _saved_head(ctx, mapping)
    if head is not None:
        mapping = {hf: archon for hf, archon in mapping.items() if archon != "output"}
        mapping[head] = "output"
    return dict(sorted(mapping.items())), dict(sorted(fused.items()))


def _saved_head(ctx: Context, mapping: dict[str, str]) -> str | None:
    """The LM head's name on disk when ``save_pretrained`` renames it (GPT-NeoX keeps
    ``lm_head`` in memory, writes ``embed_out``): the one top-level ``[vocab, hidden]``
    weight that is not the embedding's."""
    head = ctx.anatomy.lm_head
    weight = getattr(head, "weight", None)
    in_memory = next((hf for hf, archon in mapping.items() if archon == "output"), None)
    if not isinstance(weight, torch.Tensor) or (in_memory and f"{in_memory}.weight" in ctx.saved_keys):
        return None
    stack = ctx.layer_prefix.removesuffix("0.")
    known = {f"{hf}.weight" for hf, archon in mapping.items() if archon != "output"}
    candidates = [
        key.removesuffix(".weight")
        for key, shape in ctx.saved_keys.items()
        if key.endswith(".weight")
        and not (stack and key.startswith(stack))
        and key not in known
        and tuple(shape) == tuple(weight.shape)
    ]
    return candidates[0] if len(candidates) == 1 else None
