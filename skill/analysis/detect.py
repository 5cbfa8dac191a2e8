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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from skill.analysis import modules as mt
from skill.analysis import probes
from skill.analysis.source_scan import SourceFacts
from skill.features import (
    MLA,
    AttentionFeatures,
    ConfigScalar,
    ExpertLayout,
    FFNFeatures,
    FFNKind,
    FusedQKVLayout,
    MoEFeatures,
    NormFeatures,
    NormKind,
    NormPlacement,
    PositionFeatures,
    PositionKind,
    QKNormKind,
    QKNormPlacement,
    RotaryStyle,
    RouterScoring,
    ScalarFeatures,
    SlidingWindow,
    SlidingWindowKind,
    WeightOrientation,
)
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
    _scalars: dict[str, ScalarField] | None = None

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
    base_logit = probes.probe_logit_multiplier(ctx.model, ctx.anatomy, tiny)
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
        logit = probes.probe_logit_multiplier(model, anatomy, tiny)
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
    for proj in mt.projections(attention, recurse=False):
        name = proj.name.lower()
        out = proj.out_features
        if (
            "qkv" in name
            or "query_key_value" in name
            or name in ("c_attn", "w_pack", "wqkv")
            or (proj.in_features == hidden and out == (heads + 2 * kv) * hd and heads + 2 * kv > 3)
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
    return roles


def _qk_norm(ctx: Context, roles: dict[str, mt.Projection]) -> tuple[QKNormKind, QKNormPlacement]:
    attention = ctx.anatomy.attention
    if attention is None:
        return QKNormKind.NONE, QKNormPlacement.NONE
    q_norm, _ = mt.qk_norms(attention)
    if q_norm is None:
        return QKNormKind.NONE, QKNormPlacement.NONE
    name, norm = q_norm
    width = mt.norm_width(norm) or ctx.tiny_head_dim()
    hd = ctx.tiny_head_dim()
    has_weight = isinstance(getattr(norm, "weight", None), torch.Tensor)
    if not has_weight:
        kind = QKNormKind.WEIGHTLESS
    else:
        norm_kind = probes.probe_norm_kind(norm, width)
        if norm_kind is NormKind.RMS_ONE_PLUS_W:
            kind = QKNormKind.RMS_ONE_PLUS_W
        elif norm_kind in (NormKind.LAYER_NORM, NormKind.LAYER_NORM_NO_BIAS, NormKind.LAYER_NORM_ONE_PLUS_W):
            kind = QKNormKind.LAYER_NORM
        elif width == hd:
            kind = QKNormKind.PER_HEAD_RMS
        else:
            kind = QKNormKind.FULL_WIDTH_RMS
    ctx.evidence.append(f"qk norm: {type(attention).__name__}.{name}, width {width} (head_dim {hd}) -> {kind.value}")
    placement = QKNormPlacement.BEFORE_ROPE
    if ctx.source is not None:
        before = ctx.source.qk_norm_before_rope(type(attention).__name__, name)
        if before is False:
            placement = QKNormPlacement.AFTER_ROPE
        elif before is None:
            ctx.evidence.append("qk norm placement: forward order not readable in the source; assumed before RoPE")
    return kind, placement


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
    if sliding_kinds and len(set(layer_types)) > 1:
        ctx.evidence.append(f"sliding window: config {field_name}={size} and per-layer layer_types")
        return SlidingWindow(
            kind=SlidingWindowKind.PER_LAYER_PATTERN, size=size, layer_pattern=layer_types, evidence="config"
        )
    if all_layers:
        ctx.evidence.append(f"sliding window: config {field_name}={size}; the mask probe shows it on every layer")
        return SlidingWindow(kind=SlidingWindowKind.ALL_LAYERS, size=size, evidence="config + mask probe")
    ctx.evidence.append(
        f"sliding window: config {field_name}={size}, but the mask probe shows full attention; treated as none"
    )
    return SlidingWindow(evidence=f"config {field_name} set, mask probe: not applied")


def _scalar_source(ctx: Context, role: str) -> ConfigScalar | None:
    """The config field the probes found for a factor's role, with its relation."""
    found = ctx.scalar_role(role)
    if found is None:
        return None
    if found.relation is None:
        ctx.other.append(f"{role.replace('_', ' ')} set by config field {found.name} in a relation not measured")
        return ConfigScalar(field=found.name)
    return ConfigScalar(field=found.name, relation=found.relation)


def _custom_scaling(ctx: Context) -> tuple[bool, ConfigScalar | None]:
    """Whether the scores' scale is not head_dim**-0.5 or is set by a config field.

    A field the forward reads (granite's attention_multiplier, gemma's
    query_pre_attn_scalar) makes the scaling custom even where its default gives
    head_dim**-0.5: a checkpoint sets it.
    """
    source = _scalar_source(ctx, "attention_scaling")
    attention = ctx.anatomy.attention
    scaling = getattr(attention, "scaling", None) if attention is not None else None
    if not isinstance(scaling, (int, float)):
        return source is not None, source
    # Candidate head widths: the config's, MLA's query-key width, the module's own.
    widths = {ctx.tiny_head_dim()}
    for name in ("qk_head_dim", "head_dim"):
        for holder in (ctx.tiny, attention):
            value = getattr(holder, name, None)
            if isinstance(value, int) and value > 0:
                widths.add(value)
    default = ctx.tiny_head_dim() ** -0.5
    if any(math.isclose(float(scaling), w**-0.5, rel_tol=1e-4) for w in widths) and source is None:
        return False, None
    if source is None:
        match = probes.matching_field(ctx.tiny, float(scaling))
        source = ConfigScalar(field=match[0], relation=match[1]) if match else None
    ctx.evidence.append(
        f"attention scaling {scaling:.4g} vs head_dim**-0.5 {default:.4g} (field {source.field if source else None})"
    )
    return True, source


def _output_gate(ctx: Context, roles: dict[str, mt.Projection]) -> bool:
    if isinstance(ctx.get("kv_lora_rank"), int):
        return False  # MLA's query width is its own (nope + rope), not a gate
    q = roles.get("q")
    if q is not None and q.out_features == 2 * ctx.tiny.num_attention_heads * ctx.tiny_head_dim():
        return True  # the query projection also yields the gate
    return any(_is_gate_projection(ctx, key, proj) for key, proj in roles.items())


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


def _layer_attentions(ctx: Context, layers: nn.ModuleList) -> list[nn.Module] | None:
    name = ctx.anatomy.attention_name
    found = []
    for layer in layers:
        module = getattr(layer, name, None) if name else None
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


def fused_qkv_layout(ctx: Context, roles: dict[str, mt.Projection]) -> FusedQKVLayout:
    """The row order of a fused q/k/v projection, from the rows that feed each head's values.

    Candidates: ``stacked`` (all query heads, then the key heads, then the value heads)
    and ``grouped`` (per KV head: its query heads, its key, its value; with as many KV
    heads as query heads, GPT-NeoX's and Bloom's per-head interleaving). Where both give
    the same rows (one KV head) the layout is ``stacked``.
    """
    qkv, out = roles.get("qkv"), roles.get("o")
    if qkv is None:
        return FusedQKVLayout.NONE
    hd, heads = ctx.tiny_head_dim(), ctx.tiny.num_attention_heads
    kv_float = (qkv.out_features / hd - heads) / 2
    if out is None or ctx.anatomy.attention is None or kv_float != int(kv_float) or kv_float <= 0:
        ctx.evidence.append("fused q/k/v layout: no output projection or no whole number of KV heads to probe")
        return FusedQKVLayout.OTHER
    kv = int(kv_float)
    rows = probes.probe_value_rows(ctx.model, ctx.anatomy.attention, qkv, out, ctx.tiny)
    if rows is None or rows.numel() != heads * hd or heads % kv:
        ctx.evidence.append("fused q/k/v layout: the value-row probe could not read the attention output")
        return FusedQKVLayout.OTHER
    per_kv = heads // kv
    head = torch.arange(heads).repeat_interleave(hd)
    feature = torch.arange(hd).repeat(heads)
    group = head // per_kv
    candidates = {
        FusedQKVLayout.STACKED: (heads + kv) * hd + group * hd + feature,
        FusedQKVLayout.GROUPED: group * (per_kv + 2) * hd + (per_kv + 1) * hd + feature,
    }
    for layout, expected in candidates.items():
        if torch.equal(rows, expected):
            ctx.evidence.append(f"fused q/k/v layout: value rows probed -> {layout.value} ({kv} KV heads)")
            return layout
    ctx.evidence.append("fused q/k/v layout: the value rows follow neither the stacked nor the grouped order")
    return FusedQKVLayout.OTHER


def attention_features(ctx: Context) -> AttentionFeatures:
    roles = _attention_projections(ctx)
    attention = ctx.anatomy.attention
    qkv = roles.get("qkv")
    q_bias = (roles["q"].bias if "q" in roles else False) or (qkv.bias if qkv else False)
    k_bias = (roles["k"].bias if "k" in roles else False) or (qkv.bias if qkv else False)
    v_bias = (roles["v"].bias if "v" in roles else False) or (qkv.bias if qkv else False)
    o_bias = roles["o"].bias if "o" in roles else False
    qk_kind, qk_place = _qk_norm(ctx, roles)
    heads = ctx.get("num_attention_heads")
    kv = _kv_heads(ctx.config) or heads
    head_dim = ctx.get("head_dim")
    hidden = ctx.get("hidden_size")
    derived = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    explicit = isinstance(head_dim, int) and derived is not None and head_dim != derived
    softcaps = {k: v for k, v in _fields_matching(ctx.config, "softcap").items() if "final" not in k}
    attn_softcap = next((float(v) for v in softcaps.values() if isinstance(v, (int, float))), None)
    custom, scaling_source = _custom_scaling(ctx)
    kv = _measured_kv_heads(ctx, roles, heads, kv)
    clip_value, clip_field = _clip_qkv(ctx)
    mla = None
    if isinstance(ctx.get("kv_lora_rank"), int):
        mla = MLA(
            q_lora_rank=ctx.get("q_lora_rank"),
            kv_lora_rank=ctx.get("kv_lora_rank"),
            qk_nope_head_dim=ctx.get("qk_nope_head_dim"),
            qk_rope_head_dim=ctx.get("qk_rope_head_dim"),
            v_head_dim=ctx.get("v_head_dim"),
        )
    sinks = attention is not None and any("sink" in n for n, _ in attention.named_parameters())
    unexplained = [
        n for n, _ in (attention.named_parameters(recurse=False) if attention is not None else []) if "sink" not in n
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
    if ctx.get("attention_chunk_size"):
        ctx.other.append(f"chunked local attention (attention_chunk_size={ctx.get('attention_chunk_size')})")
    return AttentionFeatures(
        q_bias=bool(q_bias),
        k_bias=bool(k_bias),
        v_bias=bool(v_bias),
        o_bias=bool(o_bias),
        qk_norm=qk_kind,
        qk_norm_placement=qk_place,
        n_heads=heads,
        n_kv_heads=kv,
        gqa=isinstance(kv, int) and isinstance(heads, int) and kv < heads,
        head_dim=head_dim if isinstance(head_dim, int) else derived,
        explicit_head_dim=explicit,
        sliding_window=_sliding_window(ctx),
        logit_softcap=attn_softcap,
        custom_scaling=custom,
        scaling_field=scaling_source.field if scaling_source else None,
        scaling_source=scaling_source,
        fused_qkv=qkv is not None,
        fused_qkv_layout=fused_qkv_layout(ctx, roles),
        mla=mla,
        sinks=sinks,
        output_gate=_output_gate(ctx, roles),
        nope_layers=_nope_layers(ctx),
        clip_qkv=clip_value,
        clip_qkv_field=clip_field,
    )


# ------------------------------------------------------------------------ FFN


def _activation(ctx: Context, ffn: nn.Module | None) -> str:
    for name in _ACTIVATION_FIELDS:
        value = ctx.get(name)
        if isinstance(value, str):
            return value
    if ffn is not None:
        for _, module in ffn.named_modules():
            cls = type(module).__name__
            if re.search(r"(Activation|Gelu|GELU|SiLU|Silu|ReLU|Relu|Swish|Tanh)", cls):
                return cls
    return "unknown"


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


def _intermediate_size(ctx: Context, ups: list[mt.Projection]) -> int | None:
    """The FFN width at full size: ``intermediate_size``, else the width field whose tiny
    value is the up projection's width (``ffn_dim``, ``n_inner``, ...)."""
    declared = ctx.get("intermediate_size")
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared
    widths = {p.out_features for p in ups}
    for name, value in sorted(ctx.tiny.to_dict().items()):
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value in widths
            and any(w in name for w in ("intermediate", "ffn", "inner", "mlp"))
        ):
            full = ctx.get(name)
            if isinstance(full, int) and not isinstance(full, bool):
                return full
    return None


def ffn_features(ctx: Context) -> FFNFeatures:
    mlp = _dense_mlp(ctx)
    activation = _activation(ctx, ctx.anatomy.ffn)
    intermediate = ctx.get("intermediate_size")
    in_layer = _layer_ffn_projections(ctx) if ctx.anatomy.ffn is None else []
    if mlp is None and in_layer:
        ctx.evidence.append("FFN: projections held by the decoder layer itself: " + ", ".join(p.name for p in in_layer))
        return _plain_or_gated(ctx, in_layer, activation)
    if mlp is None:
        # Every layer of the tiny model is MoE: read the experts' layout from disk keys.
        expert_keys = [k for k in ctx.saved_keys if ".experts." in k and k.startswith(ctx.layer_prefix)]
        gated = any(("gate" in k or "w1" in k or "w3" in k) for k in expert_keys)
        fused = any("gate_up" in k for k in expert_keys)
        bias = any(k.endswith("bias") for k in expert_keys)
        return FFNFeatures(
            kind=FFNKind.GATED if gated else FFNKind.PLAIN,
            activation=activation,
            bias=bias,
            fused_gate_up=fused,
            intermediate_size=intermediate if isinstance(intermediate, int) else None,
        )
    return _plain_or_gated(ctx, mt.projections(mlp), activation)


def _plain_or_gated(ctx: Context, projs: list[mt.Projection], activation: str) -> FFNFeatures:
    hidden = ctx.tiny.hidden_size
    ups = [p for p in projs if p.in_features == hidden]
    downs = [p for p in projs if p.out_features == hidden and p.in_features != hidden]
    fused = any(
        "gate_up" in p.name or (len(ups) == 1 and len(downs) == 1 and p.out_features == 2 * downs[0].in_features)
        for p in ups
    )
    gated = len(ups) >= 2 or fused
    bias = any(p.bias for p in projs)
    return FFNFeatures(
        kind=FFNKind.GATED if gated else FFNKind.PLAIN,
        activation=activation,
        bias=bias,
        fused_gate_up=fused,
        intermediate_size=_intermediate_size(ctx, ups),
    )


# ------------------------------------------------------------------------ MoE


def _expert_count(config: PretrainedConfig) -> int | None:
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _top_k(config: PretrainedConfig) -> int | None:
    for name in ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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


def _expert_layout(ctx: Context) -> tuple[ExpertLayout, WeightOrientation, str]:
    keys = [k for k in ctx.saved_keys if ".experts." in k and "shared" not in k]
    if not keys:
        return ExpertLayout.NONE, WeightOrientation.OUT_IN, ""
    per_expert = [k for k in keys if re.search(r"\.experts\.\d+\.", k)]
    hidden = ctx.tiny.hidden_size
    if per_expert:
        key = next(
            (k for k in per_expert if re.search(r"(up|gate|w1|w3|fc1)", k) and k.endswith("weight")), per_expert[0]
        )
        shape = ctx.saved_keys[key]
        orientation = WeightOrientation.OUT_IN if shape[-1] == hidden else WeightOrientation.IN_OUT
        template = re.sub(r"\.experts\.\d+\.", ".experts.{}.", re.sub(r"\.\d+\.", ".{}.", key, count=1), count=1)
        return ExpertLayout.PER_EXPERT_2D, orientation, template
    key = next((k for k in keys if re.search(r"(up|gate)", k)), keys[0])
    shape = ctx.saved_keys[key]
    orientation = WeightOrientation.OUT_IN if shape[-1] == hidden else WeightOrientation.IN_OUT
    return ExpertLayout.FUSED_3D, orientation, re.sub(r"\.\d+\.", ".{}.", key, count=1)


def _has_selection_bias(ffn: nn.Module, num_experts: int) -> bool:
    """A per-expert vector in the MoE block that is not a projection's bias.

    Added to the scores only to pick experts (DeepSeek's ``e_score_correction_bias``,
    other families' ``expert_bias``); a router Linear's own bias does not count.
    """
    if num_experts <= 0:
        return False
    for _, module in ffn.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if tensor.dim() != 1 or tensor.numel() != num_experts:
                continue
            if name == "bias" and mt.weight_2d(module) is not None:
                continue
            return True
    return False


def moe_features(ctx: Context) -> MoEFeatures | None:
    num_experts = _expert_count(ctx.config)
    has_experts = any(mt.layer_has_experts(layer) for layer in ctx.anatomy.layers)
    if not has_experts and not any(".experts." in k for k in ctx.saved_keys):
        return None
    if num_experts is None:
        ctx.evidence.append("MoE: experts in the module tree but no expert-count field in the config")
        num_experts = 0
    moe_layers, n_layers = _moe_layers(ctx)
    moe_layer = next((layer for layer in ctx.anatomy.layers if mt.layer_has_experts(layer)), None)
    ffn = None
    if moe_layer is not None:
        for child in moe_layer.children():
            if mt.experts_module(child) is not None and not mt.is_norm(child):
                ffn = child
                break
    scoring_field = next((v for k, v in _fields_matching(ctx.config, "scor").items() if isinstance(v, str)), None)
    if scoring_field in ("sigmoid", "softmax"):
        scoring = RouterScoring(scoring_field)
    else:
        scanned = ctx.source.router_scoring() if ctx.source else None
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
    correction = any("correction" in k for k in ctx.saved_keys) or (
        ffn is not None and _has_selection_bias(ffn, _expert_count(ctx.tiny) or 0)
    )
    router_bias = False
    shared_gate = False
    shared = 0
    if ffn is not None:
        router = mt.router_module(ffn, _expert_count(ctx.tiny) or 0)
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
    if router_bias:
        ctx.other.append("router linear with a bias")
    n_group = ctx.get("n_group") or ctx.get("num_expert_group")
    topk_group = ctx.get("topk_group")
    scaling = next(
        (v for v in _fields_matching(ctx.config, "rout", "scal").values() if isinstance(v, (int, float))), None
    )
    routed_field = ctx.scalar_role("routed_scaling")
    if routed_field is not None and isinstance(ctx.get(routed_field.name), (int, float)):
        scaling = ctx.get(routed_field.name)
    layout, orientation, template = _expert_layout(ctx)
    return MoEFeatures(
        num_experts=num_experts,
        top_k=_top_k(ctx.config) or 0,
        router_scoring=scoring,
        norm_topk_prob=bool(norm_topk),
        score_correction_bias=correction,
        routed_scaling_factor=float(scaling) if isinstance(scaling, (int, float)) and scaling != 1.0 else None,
        routed_scaling_field=routed_field.name if routed_field else None,
        n_group=int(n_group) if isinstance(n_group, int) and n_group > 1 else None,
        topk_group=int(topk_group)
        if isinstance(n_group, int) and n_group > 1 and isinstance(topk_group, int)
        else None,
        shared_experts=shared,
        shared_expert_gate=shared_gate,
        moe_layers=moe_layers,
        n_layers=n_layers,
        expert_layout=layout,
        expert_orientation=orientation,
        expert_key_template=template,
    )


# ------------------------------------------------------------------ positions


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None)
    return rope if isinstance(rope, dict) else {}


def rotary_interleaved(config: PretrainedConfig, source: SourceFacts | None) -> bool:
    """Whether the rotation pairs adjacent features ``(x[2i], x[2i+1])`` rather than the two
    halves: the config says so (``rope_interleave``) or the modeling source's rotary helpers
    slice ``::2`` / ``repeat_interleave`` / go through complex numbers."""
    return bool(getattr(config, "rope_interleave", None)) or bool(source and source.rotary_interleaved())


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
    if kind is not PositionKind.ROPE:
        return PositionFeatures(kind=kind, rope_type=None, theta=None)
    per_layer = bool(rope) and all(isinstance(v, dict) for v in rope.values())
    first = next(iter(rope.values())) if per_layer else rope
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
    if not rotary:
        ctx.evidence.append("RoPE: the attention class applies the rotation itself (no rotary module)")
    factor = _partial_rotary(ctx, rotary[0] if rotary else None, first or {})
    return PositionFeatures(
        kind=kind,
        rope_type=rope_type,
        rope_scaling=scaling,
        theta=float(theta) if isinstance(theta, (int, float)) else None,
        rotary_style=RotaryStyle.INTERLEAVED if interleaved else RotaryStyle.HALF,
        partial_rotary_factor=factor,
        per_layer_type_rope=per_layer,
    )


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
    dims = _rotary_dims_field(ctx)
    head_dim = ctx.get("head_dim")
    heads = ctx.get("num_attention_heads")
    if not isinstance(head_dim, int) and isinstance(ctx.get("hidden_size"), int) and isinstance(heads, int) and heads:
        head_dim = ctx.get("hidden_size") // heads
    if dims is not None and isinstance(head_dim, int) and head_dim > 0:
        ctx.evidence.append(f"partial rotary from the config: {dims[0]}={dims[1]} of head_dim {head_dim}")
        return round(dims[1] / head_dim, 4)
    if rotary is None:
        return 1.0
    inv_freq = next((b for n, b in rotary.named_buffers() if "inv_freq" in n), None)
    if inv_freq is None:
        return 1.0
    factor = 2 * inv_freq.numel() / ctx.tiny_head_dim()
    if not math.isclose(factor, 1.0):
        ctx.evidence.append(f"partial rotary from the rotary table: {inv_freq.numel()} frequencies")
    return round(factor, 4)


# ----------------------------------------------------------------------- norm


def norm_features(ctx: Context) -> NormFeatures:
    norm = ctx.anatomy.final_norm or next(iter(ctx.anatomy.norms.values()), None)
    kind = probes.probe_norm_kind(norm, ctx.tiny.hidden_size) if norm is not None else NormKind.OTHER
    eps_field = next(
        (k for k, v in sorted(ctx.config.to_dict().items()) if k.endswith(("eps", "epsilon")) and isinstance(v, float)),
        None,
    )
    placement, block_norms = probes.probe_block_norms(ctx.model, ctx.anatomy, ctx.tiny)
    if placement is None:
        placement = NormPlacement.PRE
        ctx.evidence.append("norm placement: the layer probe was inconclusive; assumed pre-norm")
        ctx.other.append("block structure the norm probe could not read")
    return NormFeatures(
        kind=kind,
        eps=float(ctx.get(eps_field)) if eps_field else None,
        eps_field=eps_field,
        placement=placement,
        block_norms=block_norms,
    )


# -------------------------------------------------------------------- scalars


def scalar_features(ctx: Context) -> ScalarFeatures:
    """Embedding, residual and logit factors, and the config fields that set them.

    A factor is reported when the default config moves it, and also when the forward
    reads a config field for it whose default is neutral (1.0): a checkpoint sets it.
    """
    scale = probes.probe_embedding_scale(ctx.model, ctx.anatomy, ctx.tiny)
    embedding_source = _scalar_source(ctx, "embedding")
    if scale is None:
        kind, value = "none", None
        ctx.other.append("embeddings transformed before layer 0 beyond a constant scale (e.g. an embedding norm)")
    elif embedding_source is not None:
        kind = "constant"
        value = _full_size_value(ctx, (embedding_source.field, embedding_source.relation), scale)
    elif math.isclose(scale, 1.0, rel_tol=1e-4):
        kind, value = "none", None
    elif math.isclose(scale, math.sqrt(ctx.tiny.hidden_size), rel_tol=1e-3):
        kind, value = "sqrt_dim", math.sqrt(ctx.config.hidden_size)
    else:
        match = probes.matching_field(ctx.tiny, scale)
        kind = "constant"
        value = _full_size_value(ctx, match, scale)
        embedding_source = ConfigScalar(field=match[0], relation=match[1]) if match else None
    residual_field = ctx.scalar_role("residual")
    residual = ctx.get(residual_field.name) if residual_field else None
    logit = probes.probe_logit_multiplier(ctx.model, ctx.anatomy, ctx.tiny)
    logit_source = _scalar_source(ctx, "logit")
    final_caps = _fields_matching(ctx.config, "final", "softcap")
    final_cap = next((float(v) for v in final_caps.values() if isinstance(v, (int, float))), None)
    logit_value = None
    if logit is None:
        if final_cap is None:
            ctx.evidence.append("logit probe: logits are not a constant multiple of lm_head(h)")
    elif not math.isclose(logit, 1.0, rel_tol=1e-4):
        match = (logit_source.field, logit_source.relation) if logit_source else probes.matching_field(ctx.tiny, logit)
        logit_value = _full_size_value(ctx, match, logit)
        if logit_source is None and match is not None:
            logit_source = ConfigScalar(field=match[0], relation=match[1])
    tied = bool(ctx.get("tie_word_embeddings", False))
    return ScalarFeatures(
        embedding_scale=value,
        embedding_scale_kind=kind,
        embedding_scale_source=embedding_source,
        residual_multiplier=float(residual)
        if isinstance(residual, (int, float)) and not isinstance(residual, bool) and residual != 1.0
        else None,
        residual_multiplier_field=residual_field.name if residual_field else None,
        logit_multiplier=logit_value,
        logit_multiplier_source=logit_source,
        final_logit_softcap=final_cap,
        tie_word_embeddings=tied,
    )


def _full_size_value(ctx: Context, match: tuple[str, str] | None, tiny_value: float) -> float:
    """The full-size value of a probed factor, through the config field that explains it."""
    if match is None:
        ctx.evidence.append(f"factor {tiny_value:.6g} measured on the tiny model; no config field explains it")
        return tiny_value
    name, relation = match
    full = getattr(ctx.config, name, None)
    ctx.evidence.append(f"factor {tiny_value:.6g} = {relation.replace('x', name)}")
    if not isinstance(full, (int, float)):
        return tiny_value
    full = float(full)
    return {"x": full, "1/x": 1.0 / full, "x**-0.5": full**-0.5, "sqrt(x)": math.sqrt(full)}[relation]


# ------------------------------------------------------------ per-layer differences


def _module_signature(module: nn.Module, prefix: str) -> dict[str, str]:
    """Every sub-module of a layer part by path: its class and its own parameters' shapes."""
    signature = {}
    for name, sub in module.named_modules():
        path = f"{prefix}.{name}" if name else prefix
        params = ", ".join(f"{p}{tuple(t.shape)}" for p, t in sub.named_parameters(recurse=False))
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
        (ffn if is_ffn else rest).update(_module_signature(child, name))
    rest.update(_module_signature_own(layer))
    return ffn, rest


def _module_signature_own(layer: nn.Module) -> dict[str, str]:
    params = ", ".join(f"{p}{tuple(t.shape)}" for p, t in layer.named_parameters(recurse=False))
    return {"": f"{type(layer).__name__}[{params}]"}


def _layers_text(indices: list[int], total: int) -> str:
    shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
    return f"layer{'s' if len(indices) > 1 else ''} {shown} of {total}"


def per_layer_differences(ctx: Context) -> list[str]:
    """Parts of a layer that differ from layer 0's (from the first MoE layer's, for experts).

    The checklist describes layer 0; a bias, norm, QK norm, projection width or module
    kind that another layer has differently would be ported wrong, so each one is named
    ("per-layer difference: ...") and the family refused until an edit covers it. Read on
    the full-depth stack (tiny widths) where it builds, else on the tiny stack.
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
                if mine.get(path) == theirs.get(path):
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


# ------------------------------------------------------------ checkpoint modules

_ATTENTION_PARTS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo"}


def checkpoint_modules(ctx: Context) -> tuple[dict[str, str], dict[str, list[str]]]:
    """HF module -> Archon module, found by structure, for the modules the checkpoint holds.

    Layer modules are written with ``{}`` for the layer index (``gpt_neox.layers.{}.
    attention.dense`` -> ``layers.{}.attention.wo``); the embedding, final norm and LM head
    at the top (the head also when a tied checkpoint leaves it out). Roles come from the
    anatomy: the attention's projections by shape and name, a dense MLP's up and down
    projections by their widths. The second map holds a fused q/k/v projection -> the
    Archon projections it stacks (in q, k, v order; its row layout is in the checklist).
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
        if name is None or name not in saved_modules or not name.startswith(layer0):
            return None
        return f"{anatomy.layers_path}.{{}}.{name[len(layer0) :]}"

    for role, proj in _attention_projections(ctx).items():
        hf = template(proj.module)
        if hf is None:
            continue
        if role == "qkv":
            fused[hf] = [f"layers.{{}}.{part}" for part in ("attention.wq", "attention.wk", "attention.wv")]
        elif role in _ATTENTION_PARTS:
            mapping[hf] = f"layers.{{}}.{_ATTENTION_PARTS[role]}"
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
        elif len(ups) == 2:
            gates = [p for p in ups if "gate" in p.name.lower()]
            if len(gates) == 1:
                parts["w1"] = gates[0]
                parts["w3"] = next(p for p in ups if p is not gates[0])
        for part, proj in parts.items():
            hf = template(proj.module)
            if hf is not None:
                mapping[hf] = f"layers.{{}}.feed_forward.{part}"
    for module, archon, needs_saved in (
        (anatomy.embedding, "tok_embeddings", True),
        (anatomy.final_norm, "norm", True),
        (anatomy.lm_head, "output", False),
    ):
        name = names.get(id(module)) if module is not None else None
        if name and (name in saved_modules or not needs_saved):
            mapping[name] = archon
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
