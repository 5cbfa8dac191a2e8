"""Small numerical probes on a tiny instance, where config and modules say too little.

Each probe runs the real HF code on a few tokens and reads what it computes: whether a
norm centres its input or scales by ``1 + w``, where the block normalises relative to
its residual stream, by what factor embeddings and logits are scaled, and whether a
configured sliding window actually reaches the attention mask.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from skill.analysis.modules import LayerAnatomy, is_norm, projections
from skill.features import NormKind, NormPlacement

logger = logging.getLogger(__name__)

_GEN_SEED = 1234
# A sink logit no score reaches: its share of a softmax is exp(-1e4) = 0 in fp32.
_SILENT_SINK = -1e4
# The query-row probe's random fused weights: q, k, v stay far below any clip_qkv (OLMo's 8, DBRX's 8).
_QUERY_ROW_WEIGHT_SCALE = 0.05


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(_GEN_SEED)


@contextmanager
def _preserved(module: nn.Module) -> Iterator[None]:
    saved = {name: p.detach().clone() for name, p in module.named_parameters()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(saved[name])


def _norm_input(width: int, leading: tuple[int, ...] = (3,)) -> torch.Tensor:
    return torch.randn(*leading, width, generator=_generator()) * 3 + 1


def probe_norm_kind(norm: nn.Module, width: int) -> NormKind:
    """Classify a norm by its output: zero weight gives zeros unless it scales by ``1 + w``;
    with unit weight only LayerNorm gives zero-mean rows; a bias means LayerNorm with bias;
    a norm with neither weight nor bias (a parameter-less LayerNorm or RMS norm) is
    reported as weightless."""
    x = _norm_input(width)
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    with _preserved(norm), torch.no_grad():
        if isinstance(bias, torch.Tensor):
            bias.zero_()
        if isinstance(weight, torch.Tensor):
            weight.zero_()
            zero_out = _call_norm(norm, x)
            if not torch.allclose(zero_out, torch.zeros_like(zero_out), atol=1e-6):
                centred = float(zero_out.mean(-1).abs().max()) < 1e-4
                return NormKind.LAYER_NORM_ONE_PLUS_W if centred else NormKind.RMS_ONE_PLUS_W
            weight.fill_(1.0)
        out = _call_norm(norm, x)
    weightless = not any(True for _ in norm.parameters())
    centred = float(out.mean(-1).abs().max()) < 1e-4
    if centred:
        if weightless:
            return NormKind.LAYER_NORM_WEIGHTLESS
        return NormKind.LAYER_NORM if isinstance(bias, torch.Tensor) else NormKind.LAYER_NORM_NO_BIAS
    rms = out.pow(2).mean(-1).sqrt()
    if torch.allclose(rms, torch.ones_like(rms), atol=1e-3):
        return NormKind.RMS_WEIGHTLESS if weightless else NormKind.RMS
    return NormKind.OTHER


def probe_norm_eps(norm: nn.Module, width: int, kind: NormKind) -> float | None:
    """The epsilon a norm adds to the variance (mean square), measured: with a neutral
    weight (one, or zero for a ``1 + w`` norm) and zero bias, ``out = x_c / sqrt(v + eps)``
    for the centred (or raw) input ``x_c`` of variance ``v``, so ``eps = (x_c / out)**2 - v``.
    The input's variance (1e-6) is of the order of the usual epsilons, so they show;
    rounded to three significant digits. ``None`` for a norm this does not describe."""
    centred = kind in (
        NormKind.LAYER_NORM,
        NormKind.LAYER_NORM_NO_BIAS,
        NormKind.LAYER_NORM_WEIGHTLESS,
        NormKind.LAYER_NORM_ONE_PLUS_W,
    )
    if kind is NormKind.OTHER:
        return None
    x = torch.randn(2, width, generator=_generator(), dtype=torch.float32) * 1e-3
    if centred:
        x = x - x.mean(-1, keepdim=True)
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    with _preserved(norm), torch.no_grad():
        if isinstance(weight, torch.Tensor):
            weight.fill_(0.0 if kind in (NormKind.RMS_ONE_PLUS_W, NormKind.LAYER_NORM_ONE_PLUS_W) else 1.0)
        if isinstance(bias, torch.Tensor):
            bias.zero_()
        out = _call_norm(norm, x).double()
    xd = x.double()
    v = xd.pow(2).mean(-1, keepdim=True)
    ratio_sq = xd.pow(2).sum(-1, keepdim=True) / out.pow(2).sum(-1, keepdim=True).clamp_min(1e-300)
    eps = (ratio_sq - v).flatten()
    spread = float(eps.max() - eps.min())
    if not torch.isfinite(eps).all() or float(eps.min()) < 0 or spread > 1e-2 * float(eps.abs().max()) + 1e-12:
        return None  # rows disagree: not one epsilon on the variance
    value = float(eps.mean())
    return float(f"{value:.3g}") if value > 0 else 0.0


def _call_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = norm(x)
    return out[0] if isinstance(out, tuple) else out


def norm_is_centred(norm: nn.Module, width: int, leading: tuple[int, ...] = (3,)) -> bool:
    x = _norm_input(width, leading)
    with torch.no_grad():
        out = _call_norm(norm, x)
    return float(out.mean(-1).abs().max()) < 1e-4


def tokens_for(config: Any, length: int) -> torch.Tensor:
    vocab = int(getattr(config, "vocab_size", 256))
    ids = torch.randint(3, max(vocab - 1, 4), (1, length), generator=_generator())
    return ids


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits for one sequence, without a KV cache."""
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def probe_norm_placement(model: nn.Module, anatomy: LayerAnatomy, config: Any) -> NormPlacement | None:
    """Where layer 0 normalises (see :func:`probe_block_norms`)."""
    return probe_block_norms(model, anatomy, config)[0]


def probe_block_norms(
    model: nn.Module, anatomy: LayerAnatomy, config: Any
) -> tuple[NormPlacement | None, dict[str, str]]:
    """Where layer 0 normalises, and what each of its norm modules does, from the tensors
    its sub-modules receive and return.

    pre: the attention reads a norm of the layer input; post_sublayer: a norm reads the
    attention output and none reads the layer input; sandwich: both; parallel: the FFN
    reads (a norm of) the layer input, not the residual after attention; post_ln: a norm
    reads the layer input plus the attention output.

    Roles, by the norm module's name in the layer: ``pre_attention`` (reads the layer
    input, feeds the attention), ``post_attention`` (reads the attention output),
    ``pre_ffn`` (feeds the feed-forward), ``post_ffn`` (reads the feed-forward output);
    post-LN: ``attention_residual`` (reads the layer input plus the attention output) and
    ``ffn_residual`` (reads the feed-forward's input plus its output).
    """
    if anatomy.attention is None:
        return None, {}
    records: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []

    def hook(name: str):
        def run(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            first = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
            out = _output_tensor(output)
            if isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor) and name not in records:
                records[name] = (first.detach(), out.detach())

        return run

    layer = anatomy.layers[0]
    layer_input: dict[str, torch.Tensor] = {}

    def layer_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        if isinstance(first, torch.Tensor):
            layer_input.setdefault("x", first.detach())

    def layer_out_hook(module: nn.Module, args: tuple, output: Any) -> None:
        out = _output_tensor(output)
        if isinstance(out, torch.Tensor):
            layer_input.setdefault("out", out.detach())

    handles.append(layer.register_forward_pre_hook(layer_hook, with_kwargs=True))
    handles.append(layer.register_forward_hook(layer_out_hook))
    hooked = dict(layer.named_children())
    if anatomy.attention_name is not None and anatomy.attention is not None:
        hooked.setdefault(anatomy.attention_name, anatomy.attention)  # one inside a wrapper (attn.attention)
    for name, child in hooked.items():
        handles.append(child.register_forward_hook(hook(name), with_kwargs=True))
    try:
        with _preserved(layer):
            _distinct_norm_weights(anatomy)
            logits(model, tokens_for(config, 6))
    finally:
        for handle in handles:
            handle.remove()
    x = layer_input.get("x")
    if x is None or anatomy.attention_name not in records:
        return None, {}
    attn_in, attn_out = records[anatomy.attention_name]

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)

    norm_records = {n: records[n] for n in [*anatomy.norms, *_identity_norm_standins(anatomy)] if n in records}
    pre = any(same(n_in, x) and same(n_out, attn_in) for n_in, n_out in norm_records.values())
    ffn_in, ffn_out = _ffn_io(anatomy, records)
    # A norm of the attention output that is added back to the residual (not fed straight
    # to the FFN, as in blocks whose attention returns the residual sum itself).
    post_sub = any(
        same(n_in, attn_out) and not (ffn_in is not None and same(n_out, ffn_in))
        for n_in, n_out in norm_records.values()
    )
    layer_out = layer_input.get("out")

    def residual_sum(n_in: torch.Tensor) -> bool:
        """``n_in == x + c * attn_out`` for a constant ``c`` (1, or a residual multiplier)."""
        if n_in.shape != x.shape or attn_out.shape != x.shape:
            return False
        branch = (n_in - x).flatten().double()
        ref = attn_out.flatten().double()
        scale = float(branch @ ref / (ref @ ref).clamp_min(1e-30))
        return abs(scale) > 1e-6 and same(n_in, x + scale * attn_out)

    # Post-LN: a norm reads the residual sum after attention, and the layer ends on a norm's
    # output (a pre-norm block whose first norm is an identity returns a plain residual sum).
    post_ln = (
        any(residual_sum(n_in) for n_in, _ in norm_records.values())
        and layer_out is not None
        and any(same(n_out, layer_out) for _, n_out in norm_records.values())
        and not pre
    )
    parallel = False
    if ffn_in is not None and pre:
        parallel = same(ffn_in, attn_in) or any(
            same(n_in, x) and same(n_out, ffn_in) for n_in, n_out in norm_records.values()
        )
    roles: dict[str, str] = {}
    for name, (n_in, n_out) in norm_records.items():
        if post_ln and residual_sum(n_in):
            # Post-LN: the norm of the residual sum after attention (its output feeds the
            # FFN and is the residual), then the norm of the sum after the FFN.
            roles[name] = "attention_residual"
        elif post_ln and (
            (ffn_in is not None and ffn_out is not None and same(n_in, ffn_in + ffn_out))
            or (layer_out is not None and same(n_out, layer_out))
        ):
            # (Its output is the layer's: the FFN's projections may sit on the layer itself.)
            roles[name] = "ffn_residual"
        elif same(n_in, x) and same(n_out, attn_in):
            roles[name] = "pre_attention"
        elif same(n_in, attn_out) and not (ffn_in is not None and same(n_out, ffn_in)):
            # (Bloom's attention returns the residual sum: the norm of it feeds the FFN.)
            roles[name] = "post_attention"
        elif ffn_in is not None and same(n_out, ffn_in):
            roles[name] = "pre_ffn"
        elif ffn_out is not None and same(n_in, ffn_out):
            roles[name] = "post_ffn"
    if parallel:
        return NormPlacement.PARALLEL, roles
    if pre and post_sub:
        return NormPlacement.SANDWICH, roles
    if pre:
        return NormPlacement.PRE, roles
    if post_sub:
        return NormPlacement.POST_SUBLAYER, roles
    if post_ln:
        return NormPlacement.POST_LN, roles
    return None, roles


def _identity_norm_standins(anatomy: LayerAnatomy) -> list[str]:
    """Layer 0's identities where later layers hold a norm (ModernBERT-decoder's layer-0
    ``attn_norm``, the embeddings' norm standing in): read in its norm's place, so the
    block's structure shows; the per-layer difference names the missing norm."""
    later = anatomy.layers[1:]
    return [
        name
        for name, child in anatomy.layers[0].named_children()
        if isinstance(child, nn.Identity) and any(is_norm(getattr(layer, name, nn.Identity())) for layer in later)
    ]


def _ffn_io(
    anatomy: LayerAnatomy, records: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and output of layer 0's feed-forward, from the records of its children: its
    module's, or, when the layer holds the projections itself (OPT's ``fc1``/``fc2``), the
    first one's input and the last one's output in call order."""
    if anatomy.ffn_name is not None:
        return records.get(anatomy.ffn_name, (None, None))
    own = {p.name for p in projections(anatomy.layers[0], recurse=False) if p.module is not anatomy.attention}
    called = [name for name in records if name in own]
    if not called:
        return None, None
    return records[called[0]][0], records[called[-1]][1]


def _distinct_norm_weights(anatomy: LayerAnatomy) -> None:
    """Give each block norm of layer 0 its own random weight, so two norms of one input
    (a parallel block's attention and FFN norms, initialised alike) give different outputs."""
    generator = _generator()
    with torch.no_grad():
        for norm in anatomy.norms.values():
            weight = getattr(norm, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.is_floating_point():
                weight.copy_(1.0 + 0.5 * torch.rand(weight.shape, generator=generator))


def probe_is_causal(model: nn.Module, config: Any) -> bool:
    """Whether earlier positions are blind to later tokens (a decoder, not an encoder)."""
    tokens = tokens_for(config, 6)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 5) % int(config.vocab_size)
    a = logits(model, tokens)[0, :-1]
    b = logits(model, changed)[0, :-1]
    return bool(torch.allclose(a, b, atol=1e-6, rtol=0))


def _zero_output(module: nn.Module, args: tuple, output: Any) -> Any:
    return torch.zeros_like(output) if isinstance(output, torch.Tensor) else output


def probe_embedding_scale(model: nn.Module, anatomy: LayerAnatomy, config: Any) -> float | None:
    """Ratio of layer 0's input to the raw embedding rows; ``None`` when not a constant.

    Other embeddings (learned positions) and fixed position buffers (:func:`position_buffers`)
    are zeroed for the probe, and fixed position tables (sinusoidal:
    :func:`position_table_modules`) give zeros, so only the token
    embedding and any factor on it reach the layer.
    """
    embedding = anatomy.embedding
    weight = getattr(embedding, "weight", None)
    if embedding is None or not isinstance(weight, torch.Tensor):
        return None
    tokens = tokens_for(config, 5)
    captured: dict[str, torch.Tensor] = {}

    def on_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        if isinstance(first, torch.Tensor):
            captured.setdefault("x", first.detach())

    others = [m for m in model.modules() if isinstance(m, nn.Embedding) and m is not embedding]
    handle = anatomy.layers[0].register_forward_pre_hook(on_layer, with_kwargs=True)
    silenced = [
        module.register_forward_hook(_zero_output)
        for module in position_table_modules(model, anatomy, int(weight.shape[-1]))
    ]
    tables = list(position_buffers(model, anatomy, int(weight.shape[-1])).values())
    try:
        saved = [m.weight.detach().clone() for m in others]
        saved_tables = [table.clone() for table in tables]
        with torch.no_grad():
            for m in others:
                m.weight.zero_()
            for table in tables:
                table.zero_()
        logits(model, tokens)
    finally:
        handle.remove()
        for hook in silenced:
            hook.remove()
        with torch.no_grad():
            for m, w in zip(others, saved, strict=True):
                m.weight.copy_(w)
            for table, kept in zip(tables, saved_tables, strict=True):
                table.copy_(kept)
    if "x" not in captured:
        return None
    rows = weight[tokens].detach()
    x = captured["x"]
    if x.shape != rows.shape:
        return None
    mask = rows.abs() > 1e-4
    ratio = x[mask] / rows[mask]
    mean = float(ratio.mean())
    if float(ratio.std()) > 1e-3 * max(abs(mean), 1e-6):
        return None
    return mean


def position_buffers(model: nn.Module, anatomy: LayerAnatomy, width: int) -> dict[str, torch.Tensor]:
    """Fixed position tables a module holding the layer stack keeps as non-persistent buffers
    (CTRL's ``transformer.pos_encoding``, ``[n_positions, d_model]``, added to the embeddings):
    2-D float buffers of the hidden width, named for positions, that no checkpoint holds.
    Owner module path -> the buffer."""
    found: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not any(child is anatomy.layers for child in module.children()):
            continue
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if (
                "pos" in buffer_name.lower()
                and buffer_name in module._non_persistent_buffers_set
                and buffer.ndim == 2
                and buffer.shape[-1] == width
                and buffer.is_floating_point()
            ):
                found.setdefault(name, buffer)
    return found


def position_table_modules(model: nn.Module, anatomy: LayerAnatomy, width: int) -> list[nn.Module]:
    """Modules outside the layer stack that hold a fixed ``[rows, width]`` table as a buffer
    and no parameter (a sinusoidal position table), in module order."""
    layers = set(anatomy.layers.modules())
    return [
        module
        for module in model.modules()
        if module not in layers
        and not any(True for _ in module.parameters(recurse=False))
        and any(b.ndim == 2 and b.shape[-1] == width and b.is_floating_point() for b in module.buffers(recurse=False))
    ]


def probe_sinusoidal_offset(
    model: nn.Module,
    anatomy: LayerAnatomy,
    config: Any,
    table: Callable[[int, int], torch.Tensor],
    length: int = 6,
    max_offset: int = 8,
) -> int | None:
    """The row offset of a fixed position table: with the token embeddings zeroed, layer 0's
    input for a fresh sequence is the position rows alone; position ``p`` reads row
    ``p + offset`` of ``table(rows, width)``. ``None`` when no offset explains them."""
    embedding = anatomy.embedding
    weight = getattr(embedding, "weight", None)
    if embedding is None or not isinstance(weight, torch.Tensor):
        return None
    captured: dict[str, torch.Tensor] = {}

    def on_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        if isinstance(first, torch.Tensor):
            captured.setdefault("x", first.detach())

    handle = anatomy.layers[0].register_forward_pre_hook(on_layer, with_kwargs=True)
    try:
        with _preserved(embedding), torch.no_grad():
            weight.zero_()
            logits(model, tokens_for(config, length))
    finally:
        handle.remove()
    if "x" not in captured:
        return None
    rows = captured["x"][0].double()
    expected = table(length + max_offset, rows.shape[-1]).double()
    for offset in range(max_offset + 1):
        if torch.allclose(rows, expected[offset : offset + length], rtol=1e-5, atol=1e-5):
            return offset
    return None


def final_norm_after_stack(model: nn.Module, anatomy: LayerAnatomy, config: Any) -> nn.Module | None:
    """The anatomy's final-norm candidate if it runs after the last layer, else None: a norm
    beside the layer stack may be the embedding norm (TrOCR's ``layernorm_embedding``), and
    a post-LN stack (TrOCR, OPT with ``do_layer_norm_before=False``) has no final norm."""
    norm = anatomy.final_norm
    if norm is None:
        return None
    state = {"after_last": False, "ran_after": False}

    def on_last(module: nn.Module, args: tuple, output: Any) -> None:
        state["after_last"] = True

    def on_norm(module: nn.Module, args: tuple, output: Any) -> None:
        state["ran_after"] = state["ran_after"] or state["after_last"]

    handles = [anatomy.layers[-1].register_forward_hook(on_last), norm.register_forward_hook(on_norm)]
    try:
        logits(model, tokens_for(config, 4))
    finally:
        for handle in handles:
            handle.remove()
    return norm if state["ran_after"] else None


def modules_before_first_layer(model: nn.Module, anatomy: LayerAnatomy, config: Any) -> list[str]:
    """Modules (outside the layer stack) whose forward runs after the token embedding and
    before layer 0: what transforms the embeddings on their way in (an embedding norm, a
    projection). Embedding tables and parameter-less modules (dropout) are left out, but
    not a weightless norm (NanoChat normalises its embeddings with one)."""
    embedding = anatomy.embedding
    layers = set(anatomy.layers.modules())
    candidates = {
        name: module
        for name, module in model.named_modules()
        if name
        and module is not embedding
        and module not in layers
        and not isinstance(module, nn.Embedding)
        and (any(True for _ in module.parameters(recurse=False)) or is_norm(module))
    }
    order: list[str] = []
    state = {"embedded": embedding is None, "in_layers": False}

    def on_embedding(module: nn.Module, args: tuple, output: Any) -> None:
        state["embedded"] = True

    def on_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
        state["in_layers"] = True

    def on_module(name: str):
        def run(module: nn.Module, args: tuple, output: Any) -> None:
            if state["embedded"] and not state["in_layers"] and name not in order:
                order.append(name)

        return run

    handles = [anatomy.layers[0].register_forward_pre_hook(on_layer, with_kwargs=True)]
    if embedding is not None:
        handles.append(embedding.register_forward_hook(on_embedding))
    handles += [m.register_forward_hook(on_module(n)) for n, m in candidates.items()]
    try:
        logits(model, tokens_for(config, 4))
    finally:
        for handle in handles:
            handle.remove()
    return order


def probe_position_offset(model: nn.Module, table: nn.Embedding, config: Any, length: int = 6) -> int | None:
    """The row offset of a learned position table: for a fresh sequence the table's output
    at position ``p`` is row ``p + offset`` (0 for GPT-2, 2 for OPT); ``None`` when the
    output is no contiguous run of rows."""
    captured: dict[str, torch.Tensor] = {}

    def on_table(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            captured.setdefault("out", output.detach())

    handle = table.register_forward_hook(on_table)
    try:
        logits(model, tokens_for(config, length))
    finally:
        handle.remove()
    out = captured.get("out")
    if out is None or out.shape[-1] != table.weight.shape[1]:
        return None
    rows = out.reshape(-1, out.shape[-1])[:length]
    weight = table.weight.detach()
    for offset in range(weight.shape[0] - rows.shape[0] + 1):
        if torch.equal(rows, weight[offset : offset + rows.shape[0]]):
            return offset
    return None


class SoftmaxWeights(TorchFunctionMode):
    """Records the output of every softmax over the last dim while ``active`` (set by hooks on
    one attention module): its attention weights, for a model that returns none.

    ``sink_columns``: a softmax over that many more columns than rows is recorded too, without
    its last columns (gpt-oss's sink logit joins each row as the last column)."""

    def __init__(self, sink_columns: int = 0) -> None:
        super().__init__()
        self.active = False
        self.sink_columns = sink_columns
        self.weights: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        softmax = func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax)
        if (
            self.active
            and softmax
            and isinstance(out, torch.Tensor)
            and out.ndim == 4
            and 0 <= out.shape[-1] - out.shape[-2] <= self.sink_columns
        ):
            self.weights.append(out.detach()[..., : out.shape[-2]])
        return out


def attention_weights(
    model: nn.Module, attentions: list[nn.Module], tokens: torch.Tensor, sink_columns: int = 0
) -> list[torch.Tensor] | None:
    """``[batch, heads, q, k]`` weights of each of ``attentions`` (the attention modules of the
    stack's first layers, in order): what the model returns with ``output_attentions``, else the
    first softmax computed inside each module (``sink_columns``: as :class:`SoftmaxWeights`)."""
    try:
        out = model(input_ids=tokens, use_cache=False, output_attentions=True)
    except (TypeError, ValueError, RuntimeError):
        out = None
    returned = getattr(out, "attentions", None)
    head = list(returned[: len(attentions)]) if returned else []
    if len(head) == len(attentions) and all(isinstance(a, torch.Tensor) for a in head):
        return head
    mode = SoftmaxWeights(sink_columns)
    per_module: list[list[torch.Tensor]] = []

    def enter(module: nn.Module, args: tuple) -> None:
        mode.weights = []
        mode.active = True

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        mode.active = False
        per_module.append(mode.weights[:1])

    handles = [h for m in attentions for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with mode:
            model(input_ids=tokens, use_cache=False)
    except (TypeError, ValueError, RuntimeError) as exc:
        logger.debug("the attention-weights forward failed: %s", exc)
        return None
    finally:
        for handle in handles:
            handle.remove()
    if len(per_module) != len(attentions) or not all(per_module):
        return None
    return [weights[0] for weights in per_module]


def _layer0_attention_weights(model: nn.Module, attention: nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """``[batch, heads, q, k]`` weights of layer 0's ``attention`` (:func:`attention_weights`)."""
    weights = attention_weights(model, [attention], tokens)
    return weights[0] if weights else None


def probe_score_scale(
    model: nn.Module, attention: nn.Module, q_proj: nn.Module, k_proj: nn.Module, config: Any, length: int = 8
) -> float | None:
    """The factor layer 0's attention multiplies ``q . k`` by before the softmax.

    The query and key projections are pinned to known outputs, so each head's log-weights
    of the last query are ``scale * (q . k_j)`` plus one constant; the scale is their
    least-squares slope. ``None`` when the weights are not there or not of that form (the
    scores also hold a rotation, a norm or a position bias that moves them).
    """
    heads = int(config.num_attention_heads)
    generator = _generator()
    pinned: dict[str, torch.Tensor] = {}

    def pin(name: str):
        def run(module: nn.Module, args: tuple, output: Any) -> Any:
            if not isinstance(output, torch.Tensor):
                return output
            if name not in pinned:
                pinned[name] = 0.5 * torch.randn(output.shape, generator=generator, dtype=output.dtype)
            return pinned[name]

        return run

    handles = [q_proj.register_forward_hook(pin("q")), k_proj.register_forward_hook(pin("k"))]
    try:
        with torch.no_grad():
            weights = _layer0_attention_weights(model, attention, tokens_for(config, length))
    finally:
        for handle in handles:
            handle.remove()
    if weights is None or set(pinned) != {"q", "k"} or weights.shape[1] != heads:
        return None
    q, k = pinned["q"][0].double(), pinned["k"][0].double()  # [L, heads * d], [L, kv_heads * d]
    if q.shape[-1] % heads or k.shape[-1] % (q.shape[-1] // heads):
        return None
    width = q.shape[-1] // heads
    kv_heads = k.shape[-1] // width
    if heads % kv_heads:
        return None
    q = q.view(length, heads, width)
    k = k.view(length, kv_heads, width).repeat_interleave(heads // kv_heads, dim=1)
    dots = torch.einsum("hd,jhd->hj", q[-1], k)  # the last query against every key, per head
    last = weights[0, :, -1].double()
    if bool((last <= 0).any()):
        return None
    logs = last.log()
    x = dots - dots.mean(dim=-1, keepdim=True)
    y = logs - logs.mean(dim=-1, keepdim=True)
    slopes = (x * y).sum(dim=-1) / (x * x).sum(dim=-1)
    scale = slopes.mean()
    if not torch.allclose(y, scale * x, atol=1e-4, rtol=0):
        return None
    return float(scale)


def probe_alibi_slopes(model: nn.Module, anatomy: LayerAnatomy, config: Any, length: int = 8) -> list[float] | None:
    """Per-head slopes of a bias linear in the key position on layer 0's attention scores.

    With every parameter of layer 0's attention zeroed, its scores are the position bias
    alone, so in each head the last query's weights on keys ``j`` and ``j + 1`` differ by a
    factor ``exp(slope)``. The weights are the ones the model returns with
    ``output_attentions``, or (a remote-code model that returns none) the softmax computed
    inside the attention. A sliding window hides the keys behind it: the log-ratios are
    read over the keys the last query sees, which must be the last two or more. ``None``
    when neither weight source is there, or the log-ratios are not one constant per head
    (no linear bias)."""
    attention = anatomy.attention
    if attention is None:
        return None
    with _preserved(attention), torch.no_grad():
        for param in attention.parameters():
            param.zero_()
        weights = _layer0_attention_weights(model, attention, tokens_for(config, length))
    if weights is None:
        return None
    last = weights[0, :, -1].double()  # [H, L]: the last query's weights on every key
    seen = last > 0
    first = int(seen[0].long().argmax())
    if not bool(seen[:, first:].all()) or bool(seen[:, :first].any()) or last.shape[-1] - first < 2:
        return None
    last = last[:, first:]
    steps = last[:, 1:].log() - last[:, :-1].log()
    slopes = steps[:, :1]
    if not torch.allclose(steps, slopes.expand_as(steps), rtol=1e-4, atol=1e-5):
        return None
    return [float(x) for x in slopes[:, 0]]


def probe_logit_multiplier(
    model: nn.Module, anatomy: LayerAnatomy, config: Any, final_softcap: float | None = None
) -> float | None:
    """Constant factor between the logits and ``lm_head(final_norm(h))``; ``None`` if not constant.

    Measured from the final norm's output, so a factor applied between the norm and the
    head (MiniCPM divides the hidden states before ``lm_head``) counts as well as one on
    the logits; when that ratio is no constant (a module between them), or the model has no
    final norm, from the head's own input. With ``final_softcap`` (the logits soft-capped
    last, ``cap * tanh(logits / cap)``) the cap is undone first, so a factor before it shows.
    """
    head = anatomy.lm_head
    if head is None:
        return None
    captured: dict[str, torch.Tensor] = {}

    def on_head(module: nn.Module, args: tuple) -> None:
        captured["h"] = args[0].detach()

    def on_norm(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            captured["normed"] = output.detach()

    handles = [head.register_forward_pre_hook(on_head)]
    if anatomy.final_norm is not None:
        handles.append(anatomy.final_norm.register_forward_hook(on_norm))
    try:
        out = logits(model, tokens_for(config, 4))
    finally:
        for handle in handles:
            handle.remove()
    if final_softcap:
        out = torch.atanh((out / final_softcap).clamp(-1 + 1e-6, 1 - 1e-6)) * final_softcap
    for source in ("normed", "h"):
        if source not in captured:
            continue
        with torch.no_grad():
            try:
                plain = head(captured[source])
            except RuntimeError:
                continue
        ratio = _constant_ratio(out, plain)
        if ratio is not None:
            return ratio
    return None


def head_reads_final_norm(model: nn.Module, anatomy: LayerAnatomy, config: Any) -> bool | None:
    """Whether the LM head's input is the final norm's output (or a constant multiple of it,
    as MiniCPM's division before ``lm_head``); ``False`` when a module transforms it in
    between (ModernBERT-decoder's dense, activation and norm), ``None`` when either is not
    reached."""
    head, norm = anatomy.lm_head, anatomy.final_norm
    if head is None or norm is None:
        return None
    captured: dict[str, torch.Tensor] = {}

    def on_head(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            captured.setdefault("head", args[0].detach())

    def on_norm(module: nn.Module, args: tuple, output: Any) -> None:
        out = _output_tensor(output)
        if out is not None and "head" not in captured:
            # Its last call before the head (NanoChat's one norm also runs on the embeddings).
            captured["norm"] = out.detach()

    handles = [head.register_forward_pre_hook(on_head), norm.register_forward_hook(on_norm)]
    try:
        logits(model, tokens_for(config, 4))
    finally:
        for handle in handles:
            handle.remove()
    if "head" not in captured or "norm" not in captured:
        return None
    return _constant_ratio(captured["head"], captured["norm"]) is not None


def _constant_ratio(out: torch.Tensor, plain: torch.Tensor) -> float | None:
    """``out / plain`` when it is one constant over the entries that are not tiny."""
    mask = plain.abs() > 1e-3
    if plain.shape != out.shape or not bool(mask.any()):
        return None
    ratio = out[mask] / plain[mask]
    mean = float(ratio.mean())
    if float(ratio.std()) > 1e-3 * max(abs(mean), 1e-6):
        return None
    return mean


def probe_residual_multiplier(model: nn.Module, anatomy: LayerAnatomy, config: Any) -> float | None:
    """The factor on layer 0's residual branches: ``layer(x) - x`` over the branch output.

    The attention's output is replaced by a fixed tensor and the feed-forward's by zeros,
    so a pre-norm block returns ``x + r * branch``; ``None`` when that is not a constant
    multiple (post-norm blocks, anything but a scaled add).
    """
    attention, ffn = anatomy.attention, anatomy.ffn
    if attention is None or ffn is None:
        return None
    captured: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)

    def on_layer(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        if isinstance(first, torch.Tensor):
            captured.setdefault("x", first.detach())

    def after_layer(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        out = _output_tensor(output)
        if isinstance(out, torch.Tensor):
            captured.setdefault("y", out.detach())

    def fixed(out: torch.Tensor) -> torch.Tensor:
        if "branch" not in captured:
            captured["branch"] = torch.randn(out.shape, generator=generator, dtype=out.dtype) + 2.0
        return captured["branch"]

    def on_attention(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (fixed(output[0]), *output[1:])
        return fixed(output) if isinstance(output, torch.Tensor) else output

    def on_ffn(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output) if isinstance(output, torch.Tensor) else output

    layer = anatomy.layers[0]
    handles = [
        layer.register_forward_pre_hook(on_layer, with_kwargs=True),
        layer.register_forward_hook(after_layer, with_kwargs=True),
        attention.register_forward_hook(on_attention),
        ffn.register_forward_hook(on_ffn),
    ]
    try:
        logits(model, tokens_for(config, 5))
    except Exception as exc:  # a forward that cannot take the replaced outputs names no factor
        logger.debug("residual probe failed: %s", exc)
        return None
    finally:
        for handle in handles:
            handle.remove()
    if not {"x", "y", "branch"} <= set(captured) or captured["y"].shape != captured["branch"].shape:
        return None
    return _constant_ratio(captured["y"] - captured["x"], captured["branch"])


def probe_window_reaches_all_layers(model: nn.Module, config: Any, window: int, n_layers: int) -> bool:
    """Whether the last token is blind to the first beyond every layer's window combined.

    With every layer windowed the receptive field is ``n_layers * (window - 1)``; a
    sequence longer than that must give the same last logits when the first token
    changes. One full-attention layer (or a window the mask ignores) breaks that.
    """
    length = n_layers * window + 4
    tokens = tokens_for(config, length)
    changed = tokens.clone()
    changed[0, 0] = (changed[0, 0] + 7) % int(config.vocab_size)
    a = logits(model, tokens)[0, -1]
    b = logits(model, changed)[0, -1]
    return bool(torch.allclose(a, b, atol=1e-6, rtol=0))


def probe_value_rows(
    model: nn.Module, attention: nn.Module, fused: Any, out_proj: Any, config: Any
) -> torch.Tensor | None:
    """Which row of a fused q/k/v projection feeds each value feature, per query head.

    One token (position 0, so no rotation; attention over one key is that key's value):
    the attention input is replaced by the unit vector ``e_0`` and row ``r`` of the fused
    weight by ``(r + 1) / n * e_0`` for ``n`` rows (bias zeroed), so the output projection's
    input holds, at (query head, feature), the code of the row of the value it attends to.
    The codes stay within (0, 1]: a ``clip_qkv`` clamp (OLMo, DBRX: 8) leaves them alone,
    where the row numbers themselves would be clamped to the clip. Attention
    sinks (parameters named ``*sink*``, as the sinks detection reads them) are pushed far
    below any score for the probe: a sink would keep part of the one key's weight and scale
    the codes off the integers. ``fused`` and ``out_proj`` are
    :class:`~skill.analysis.modules.Projection` s. Returns the ``[n_values]`` row indices
    (``None`` when the probe cannot read them).
    """
    captured: dict[str, torch.Tensor] = {}

    def unit_input(module: nn.Module, args: tuple, kwargs: dict):
        first = input_tensor(args, kwargs)
        if first is None:
            return None
        unit = torch.zeros_like(first)
        unit[..., 0] = 1.0
        if args and isinstance(args[0], torch.Tensor):
            return (unit, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": unit}

    def on_out(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            captured.setdefault("v", args[0].detach())

    weight = fused.module.weight
    bias = getattr(fused.module, "bias", None)
    with _preserved(attention), torch.no_grad():
        weight.zero_()
        code = torch.arange(1, fused.out_features + 1, dtype=weight.dtype) / fused.out_features
        if fused.orientation == "out_in":
            weight[:, 0] = code
        else:
            weight[0, :] = code
        if isinstance(bias, torch.Tensor):
            bias.zero_()
        for name, param in attention.named_parameters():
            if "sink" in name:
                param.fill_(_SILENT_SINK)
        handles = [
            attention.register_forward_pre_hook(unit_input, with_kwargs=True),
            out_proj.module.register_forward_pre_hook(on_out),
        ]
        try:
            logits(model, tokens_for(config, 1))
        except (TypeError, ValueError, RuntimeError) as exc:
            logger.debug("fused q/k/v probe failed: %s", exc)
            return None
        finally:
            for handle in handles:
                handle.remove()
    values = captured.get("v")
    if values is None:
        return None
    numbers = values.reshape(-1) * fused.out_features
    rows = numbers.round()
    if not torch.allclose(numbers, rows, atol=1e-3):
        return None
    return rows.long() - 1


def probe_query_rows(
    model: nn.Module,
    attention: nn.Module,
    fused: Any,
    out_proj: Any,
    config: Any,
    n_heads: int,
    bypassed: Sequence[nn.Module] = (),
) -> tuple[list[set[int]], list[set[int]]] | None:
    """Per query head: the rows of a fused q/k/v projection that feed its query, and those
    that feed its keys or values.

    Two tokens (positions 0 and 1); the attention input is replaced by the unit vectors
    ``e_0`` and ``e_1`` and the fused weight by small seeded random values (bias zeroed;
    small so that a ``clip_qkv`` clamp, whose gradient is zero where it binds, never does). The
    gradient of one head's output at token 1 reaches column 0 of a row only through
    token 0's key or value (token 0's query feeds token 0 alone), and column 1 of a row
    through token 1's query, key or value: rows with a column-1 gradient and none in
    column 0 are the head's query rows, rows with a column-0 gradient its key and value
    rows. Returns ``(query rows, key-or-value rows)`` per head, or ``None`` when the probe
    cannot run (fewer than two input columns, no output reached).

    Each module of ``bypassed`` returns its input unchanged during the probe: the QK norms,
    since a full-width one normalises every head's query (or key) features together and
    so sends each head's gradient to the rows of all the others.
    """
    captured: dict[str, torch.Tensor] = {}

    def unit_inputs(module: nn.Module, args: tuple, kwargs: dict):
        first = input_tensor(args, kwargs)
        if first is None or first.shape[-1] < 2 or first.shape[-2] < 2:
            return None
        unit = torch.zeros_like(first)
        unit[..., 0, 0] = 1.0
        unit[..., 1, 1] = 1.0
        if args and isinstance(args[0], torch.Tensor):
            return (unit, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": unit}

    def on_out(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            captured.setdefault("o", args[0])

    weight = fused.module.weight
    bias = getattr(fused.module, "bias", None)
    queries: list[set[int]] = []
    keys_values: list[set[int]] = []
    with _preserved(attention):
        with torch.no_grad():
            weight.copy_(_QUERY_ROW_WEIGHT_SCALE * torch.randn(weight.shape, generator=_generator()))
            if isinstance(bias, torch.Tensor):
                bias.zero_()
        handles = [
            attention.register_forward_pre_hook(unit_inputs, with_kwargs=True),
            out_proj.module.register_forward_pre_hook(on_out),
            *(module.register_forward_hook(_pass_input_through) for module in bypassed),
        ]
        try:
            with torch.enable_grad():
                model(input_ids=tokens_for(config, 2), use_cache=False)
                out = captured.get("o")
                if out is None or not out.requires_grad or out.shape[-1] % n_heads:
                    return None
                per_head = out.reshape(-1, out.shape[-2], n_heads, out.shape[-1] // n_heads)[0, 1]
                mix = torch.randn(per_head.shape, generator=_generator())
                for head in range(n_heads):
                    (grad,) = torch.autograd.grad((per_head[head] * mix[head]).sum(), weight, retain_graph=True)
                    rows = grad if fused.orientation == "out_in" else grad.T
                    from_first, from_second = rows[:, 0] != 0, rows[:, 1] != 0
                    queries.append(set((from_second & ~from_first).nonzero().flatten().tolist()))
                    keys_values.append(set(from_first.nonzero().flatten().tolist()))
        except (TypeError, ValueError, RuntimeError) as exc:
            logger.debug("fused q/k/v query-row probe failed: %s", exc)
            return None
        finally:
            for handle in handles:
                handle.remove()
    return queries, keys_values


def _pass_input_through(module: nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook that makes ``module`` the identity (its first input as its output)."""
    return args[0] if args and isinstance(args[0], torch.Tensor) else output


def probe_qk_norm_kind(norm: nn.Module, width: int) -> NormKind:
    if not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return NormKind.OTHER
    return probe_norm_kind(norm, width)


def matching_field(config: Any, target: float, *, tolerance: float = 1e-3) -> tuple[str, str] | None:
    """A numeric config field whose value explains ``target``: (field, relation).

    Relations: ``"x"`` (target == v), ``"1/x"``, ``"x**-0.5"``, ``"sqrt(x)"``.
    """
    for name, value in sorted(vars(config).items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value in (0, 1):
            continue
        value = float(value)
        for relation, derived in (
            ("x", value),
            ("1/x", 1.0 / value),
            ("x**-0.5", value**-0.5 if value > 0 else math.nan),
            ("sqrt(x)", math.sqrt(value) if value > 0 else math.nan),
        ):
            if math.isclose(derived, target, rel_tol=tolerance):
                return name, relation
    return None


__all__ = [
    "RELATIONS",
    "is_norm",
    "logits",
    "matching_field",
    "norm_is_centred",
    "perturbed_values",
    "position_table_modules",
    "probe_block_norms",
    "probe_embedding_scale",
    "probe_is_causal",
    "probe_logit_multiplier",
    "probe_norm_kind",
    "probe_norm_placement",
    "probe_qk_norm_kind",
    "probe_residual_multiplier",
    "probe_rotary_layers",
    "probe_sinusoidal_offset",
    "probe_value_rows",
    "probe_window_reaches_all_layers",
    "relation_of",
    "rotary_modules",
    "tokens_for",
]


def probe_topk_weights_sum_to_one(model: nn.Module, anatomy: LayerAnatomy, config: Any, top_k: int) -> bool | None:
    """Whether the routing weights handed to the experts sum to one per token (to one
    constant: a routed scaling factor may multiply them after the renormalisation).

    Reads the float ``[tokens, top_k]`` argument of the routed-experts module's forward
    (the weights every transformers MoE block passes with the expert indices); a top-k
    softmax and a renormalised softmax both sum to one, a plain softmax over all
    experts does not. ``None`` when no such argument is seen.
    """
    from skill.analysis.modules import experts_module, layer_has_experts

    layer = next((layer for layer in anatomy.layers if layer_has_experts(layer)), None)
    if layer is None or top_k <= 0:
        return None
    found = experts_module(layer)
    if found is None:
        return None
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        for value in [*args, *kwargs.values()]:
            if (
                isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and value.dim() == 2
                and value.shape[-1] == top_k
            ):
                captured.append(value.detach())
                return

    handle = found[1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        logits(model, tokens_for(config, 6))
    finally:
        handle.remove()
    if not captured:
        return None
    # Renormalised weights sum to the same constant for every token: one, or the routed
    # scaling factor applied after the renormalisation (whatever field names it).
    sums = captured[0].sum(-1)
    return bool(torch.allclose(sums, sums[:1].expand_as(sums), atol=1e-4) and sums[0].abs() > 1e-6)


# --------------------------------------------------------------- rotary per layer


def input_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The hidden states a module receives: its first positional tensor, else ``hidden_states``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def _unit_rms_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    """The inputs with ``hidden`` rescaled to unit RMS per token: what a pre-norm block's
    attention sees. A post-sublayer block feeds its attention the raw embeddings (``std``
    0.02 at init), where the scores are near zero and the softmax near uniform whatever the
    positions, so a rotation would move the output by ~1e-6 of itself and go unseen."""
    scaled = hidden / hidden.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
    if args and args[0] is hidden:
        return (scaled, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": scaled}


def _output_tensor(output: Any) -> torch.Tensor | None:
    """A module's main output: the tensor first in the tuple or list (GPT-1's blocks and
    attention return lists) many HF modules return, or the tensor itself."""
    out = output[0] if isinstance(output, (tuple, list)) and output else output
    return out if isinstance(out, torch.Tensor) else None


def _pin(args: tuple, kwargs: dict, saved: torch.Tensor, only_first: bool, saved_inputs: dict[str, Any]):
    """Replace a module's inputs by the baseline run's: its hidden states, or every
    non-integer tensor (hidden states, masks), so only position ids can differ."""
    if only_first:
        if args and isinstance(args[0], torch.Tensor):
            return (saved, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": saved}
    new_args = tuple(
        saved_inputs.get(f"arg{i}", a) if isinstance(a, torch.Tensor) and not _is_integer(a) else a
        for i, a in enumerate(args)
    )
    new_kwargs = {
        k: saved_inputs.get(k, v) if isinstance(v, torch.Tensor) and not _is_integer(v) else v
        for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype is torch.bool)


def _reverse_positions(output: Any, length: int, flipped: list[int]) -> Any:
    """The rotary module's output for the positions in reverse order: every tensor flipped
    along its axes of the probe's sequence length (cos/sin or complex frequencies)."""
    if isinstance(output, torch.Tensor):
        dims = [d for d, size in enumerate(output.shape) if size == length]
        if not dims:
            return output
        flipped.append(len(dims))
        return output.flip(dims)
    if isinstance(output, tuple):
        return tuple(_reverse_positions(o, length, flipped) for o in output)
    if isinstance(output, list):
        return [_reverse_positions(o, length, flipped) for o in output]
    return output


ROTARY_PROBE_LENGTH = 11  # odd, so no head or rotary width has the sequence's length


def rotary_modules(model: nn.Module) -> list[nn.Module]:
    return [m for n, m in model.named_modules() if "Rotary" in type(m).__name__ or n.endswith("rotary_emb")]


def probe_rotary_layers(model: nn.Module, attentions: list[nn.Module], config: Any) -> tuple[list[bool], str] | None:
    """Which attention modules rotate queries and keys by position: per layer, whether its
    output changes when only the positions change.

    Each attention module is fed the hidden states it saw in a baseline run, rescaled to
    unit RMS per token whatever the block's norm placement, so a change in an earlier layer
    does not propagate and the scores are large enough for a rotation to show. Positions change in one of two ways: the
    rotary module's output is replaced by that of the reversed positions (families with
    a shared rotary module), or, without one, the ``position_ids`` are reversed while
    every non-integer input of each attention (hidden states, masks) stays pinned.
    Returns the per-layer flags and the method, or ``None`` when neither perturbation
    reaches any attention output (the probe cannot tell).
    """
    length = ROTARY_PROBE_LENGTH
    tokens = tokens_for(config, length)
    baseline_positions = torch.arange(length).unsqueeze(0)
    inputs: dict[int, dict[str, Any]] = {}
    outputs: dict[int, torch.Tensor] = {}

    def record(index: int):
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if index in inputs:
                return None
            first = input_tensor(args, kwargs)
            if first is not None:
                args, kwargs = _unit_rms_hidden(args, kwargs, first)
            saved = {f"arg{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
            saved.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            hidden = input_tensor(args, kwargs)
            if hidden is not None:
                saved["__hidden__"] = hidden
            inputs[index] = saved
            return args, kwargs

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            out = _output_tensor(output)
            if out is not None and index not in outputs:
                outputs[index] = out.detach()

        return pre, post

    handles = []
    for index, attention in enumerate(attentions):
        pre, post = record(index)
        handles.append(attention.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(attention.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=tokens, position_ids=baseline_positions, use_cache=False)
    except (TypeError, ValueError, RuntimeError) as exc:
        logger.debug("rotary probe baseline failed: %s", exc)
        return None
    finally:
        for handle in handles:
            handle.remove()
    if len(outputs) != len(attentions) or any("__hidden__" not in inputs.get(i, {}) for i in range(len(attentions))):
        return None
    baseline = dict(outputs)

    def rerun(use_rotary: bool) -> list[bool] | None:
        outputs.clear()
        flipped: list[int] = []
        hooks = []
        if use_rotary:
            for rotary in rotary_modules(model):
                hooks.append(rotary.register_forward_hook(lambda m, a, o: _reverse_positions(o, length, flipped)))
        for index, attention in enumerate(attentions):
            saved = inputs[index]

            def pin(module: nn.Module, args: tuple, kwargs: dict, saved: dict = saved):
                return _pin(args, kwargs, saved["__hidden__"], use_rotary, saved)

            hooks.append(attention.register_forward_pre_hook(pin, with_kwargs=True))
            _, post = record(index)
            hooks.append(attention.register_forward_hook(post, with_kwargs=True))
        positions = baseline_positions if use_rotary else baseline_positions.flip(-1)
        try:
            with torch.no_grad():
                model(input_ids=tokens, position_ids=positions, use_cache=False)
        except (TypeError, ValueError, RuntimeError) as exc:
            logger.debug("rotary probe rerun failed: %s", exc)
            return None
        finally:
            for hook in hooks:
                hook.remove()
        if use_rotary and not flipped:
            return None
        if len(outputs) != len(attentions):
            return None
        flags = []
        for index in range(len(attentions)):
            a, b = baseline[index], outputs[index]
            scale = float(a.abs().max()) or 1.0
            flags.append(a.shape != b.shape or float((a - b).abs().max()) > 1e-4 * scale)
        return flags if any(flags) else None

    if rotary_modules(model):
        flags = rerun(use_rotary=True)
        if flags is not None:
            return flags, "rotary module output reversed"
    flags = rerun(use_rotary=False)
    if flags is not None:
        return flags, "position_ids reversed"
    return None


# ------------------------------------------------------------------ config scalars

RELATIONS = {
    "x": lambda v: v,
    "1/x": lambda v: 1.0 / v,
    "x**-0.5": lambda v: v**-0.5,
    "sqrt(x)": lambda v: v**0.5,
}


def relation_of(old_value: float | None, new_value: float, old_factor: float, new_factor: float) -> str | None:
    """The relation ``factor = r(field)`` that explains a factor's move when the field moved."""
    for name, relation in RELATIONS.items():
        try:
            if old_value is None or old_value == 0:
                expected = relation(new_value)
                if math.isclose(expected, new_factor, rel_tol=1e-3):
                    return name
            elif math.isclose(relation(new_value) / relation(old_value), new_factor / old_factor, rel_tol=1e-3):
                return name
        except (ZeroDivisionError, ValueError):
            continue
    return None


def perturbed_values(value: Any) -> list[Any]:
    """Values to move a scalar field to, keeping its type (strict configs check it): up for a
    factor, then far down for a clamp, which no tiny activation reaches at its own value
    (a ``clip_qkv`` of 4 or 5.5 leaves a random tiny model's q, k, v alone; 0.2 does not)."""
    if value is None:
        return [0.05, 3]
    if isinstance(value, int):
        return [max(value + 1, round(value * 1.37))]
    return [value * 1.37, value * 0.05] if value else [0.5]


def _layer_siblings(params: Mapping[str, torch.Tensor], name: str) -> list[str]:
    """``name`` and the same parameter of every other layer (the first index varies)."""
    pattern = re.compile("^" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name), count=1) + "$")
    return [n for n in params if pattern.match(n)]


def _in_memory(params: Mapping[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> str | None:
    """The parameter a checkpoint key loads into: the same name, else the one tensor of that
    shape under the key's parent module (a checkpoint may name it differently, same layout)."""
    if key in params and tuple(params[key].shape) == tuple(shape):
        return key
    parent = key.rsplit(".", 2)[0]
    matches = [n for n, p in params.items() if n.startswith(parent + ".") and tuple(p.shape) == tuple(shape)]
    return matches[0] if len(matches) == 1 else None


def probe_gate_up_order(
    model: nn.Module,
    config: Any,
    up_key: str,
    up_shape: tuple[int, ...],
    axis: int,
    down_key: str,
    down_shape: tuple[int, ...],
) -> str | None:
    """How a fused expert tensor stacks its gate (activated) and up positions along ``axis``:
    ``"concatenated"`` (gate first, then up) or ``"interleaved"`` (gate even, up odd), each
    with ``"_up_first"`` when the up part leads (``"concatenated_up_first"``: up, then gate).

    Zeroing the gate positions of every layer's tensor (and of its bias) makes the logits
    independent of the up positions whatever the activation (``act(0) == 0``); the wrong
    partition leaves both kinds and the logits move. Where zeroing either part works (a
    SwiGLU, linear in up), scaling the up part by 2 and the down projection by 1/2 keeps
    the logits only when the scaled part is up. ``None`` when nothing fits.
    """
    params = dict(model.named_parameters())
    up_name, down_name = _in_memory(params, up_key, up_shape), _in_memory(params, down_key, down_shape)
    if up_name is None or down_name is None:
        return None
    ups, downs = _layer_siblings(params, up_name), _layer_siblings(params, down_name)
    biases = [n + "_bias" if n + "_bias" in params else n.rsplit(".", 1)[0] + ".bias" for n in ups]
    biases = [b for b in biases if b in params and params[b].dim() == 2]
    width = up_shape[axis]
    positions = torch.arange(width)
    partitions = {
        "concatenated": (positions[: width // 2], positions[width // 2 :]),
        "interleaved": (positions[0::2], positions[1::2]),
    }
    tokens = tokens_for(config, 12)
    gen = _generator()

    def run(zeroed: torch.Tensor | None, random: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            for name in ups:
                p = params[name]
                p.index_copy_(axis, random, torch.randn(p.index_select(axis, random).shape, generator=gen))
                if zeroed is not None:
                    p.index_fill_(axis, zeroed, 0.0)
                if scale is not None:
                    p.index_copy_(axis, scale, p.index_select(axis, scale) * 2)
            for name in biases:
                if zeroed is not None:
                    params[name].index_fill_(1, zeroed, 0.0)
                if scale is not None:
                    params[name].index_copy_(1, scale, params[name].index_select(1, scale) * 2)
            if scale is not None:
                for name in downs:
                    params[name].mul_(0.5)
            return logits(model, tokens)

    def seeded_downs() -> None:
        with torch.no_grad():
            for name in downs:
                params[name].copy_(torch.randn(params[name].shape, generator=_generator()) * 0.5)

    zero_kills: dict[str, list[str]] = {}
    with _preserved(model):
        seeded_downs()
        for order, (first, second) in partitions.items():
            for part, (zeroed, rest) in (("first", (first, second)), ("second", (second, first))):
                a, b = run(zeroed, rest), run(zeroed, rest)
                if torch.allclose(a, b, atol=1e-6):
                    zero_kills.setdefault(order, []).append(part)
    fits = [order for order, parts in zero_kills.items() if parts]
    if len(fits) != 1:
        return None
    order = fits[0]
    if zero_kills[order] == ["first"]:
        return order  # only zeroing the first part kills the output: it is the gate
    if zero_kills[order] == ["second"]:
        return f"{order}_up_first"  # only zeroing the second part kills it: the up part comes first

    def scaling_keeps(part: torch.Tensor) -> bool:
        """The same random weights twice (the generator re-seeded), the second time ``part``
        doubled and the down projection halved: only an up part (linear) keeps the logits."""
        with _preserved(model):
            gen.manual_seed(_GEN_SEED)
            seeded_downs()
            plain = run(None, positions)
            gen.manual_seed(_GEN_SEED)
            seeded_downs()
            scaled = run(None, positions, scale=part)
        return torch.allclose(plain, scaled, atol=1e-5, rtol=1e-4)

    first, second = partitions[order]
    if scaling_keeps(second):
        return order
    return f"{order}_up_first" if scaling_keeps(first) else None


# Gate functions a gated attention output may apply to its gate projection's output.
OUTPUT_GATE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softplus": torch.nn.functional.softplus,
}


def probe_output_gate_function(
    model: nn.Module, gate: nn.Module, out_proj: nn.Module, config: Any, channels: torch.Tensor | None = None
) -> str | None:
    """The function ``f`` with ``out_proj``'s input ``= attention output * f(gate(x))``.

    The gate projection's output is pinned to a constant ``c`` (every head, every
    element) and the output projection's input is read on its first call: the attention
    output does not depend on the gate, so two constants give inputs whose ratio is
    ``f(c1) / f(c2)`` everywhere. ``None`` when no entry of
    :data:`OUTPUT_GATE_FUNCTIONS` explains it (the projection is no multiplicative gate).
    ``channels``: the gate's output channels when the projection also yields others (a
    query projection whose rows hold each head's query and gate); only those are pinned.
    """
    tokens = tokens_for(config, 5)

    def read(value: float) -> torch.Tensor | None:
        captured: dict[str, torch.Tensor] = {}

        def pin(module: nn.Module, args: tuple, output: Any) -> Any:
            found = _output_tensor(output)
            if found is None:
                return output
            if channels is None:
                return torch.full_like(found, value)
            pinned = found.clone()
            pinned[..., channels] = value
            return pinned

        def on_out(module: nn.Module, args: tuple) -> None:
            if "x" not in captured and args and isinstance(args[0], torch.Tensor):
                captured["x"] = args[0].detach().double()

        handles = [gate.register_forward_hook(pin), out_proj.register_forward_pre_hook(on_out)]
        try:
            logits(model, tokens)
        finally:
            for handle in handles:
                handle.remove()
        return captured.get("x")

    constants = (0.7, -1.3, 2.1)
    inputs = [x for x in (read(c) for c in constants) if x is not None]
    if len(inputs) != len(constants) or not bool(inputs[0].abs().gt(1e-6).any()):
        return None
    for name, fn in OUTPUT_GATE_FUNCTIONS.items():
        f = [float(fn(torch.tensor(c, dtype=torch.float64))) for c in constants]
        if all(torch.allclose(inputs[i] * f[0], inputs[0] * f[i], rtol=1e-4, atol=1e-6) for i in (1, 2)):
            return name
    return None


def count_calls(model: nn.Module, module: nn.Module, config: Any) -> int:
    """How many times ``module`` runs in one forward of ``model`` over a few tokens."""
    calls = [0]

    def count(_module: nn.Module, _args: tuple) -> None:
        calls[0] += 1

    handle = module.register_forward_pre_hook(count)
    try:
        logits(model, tokens_for(config, 4))
    finally:
        handle.remove()
    return calls[0]


def modules_not_run(model: nn.Module, modules: dict[str, nn.Module], config: Any) -> list[str]:
    """The names of ``modules`` whose forward never runs in one forward of ``model``."""
    ran: set[str] = set()

    def seen(name: str):
        def hook(_module: nn.Module, _args: tuple) -> None:
            ran.add(name)

        return hook

    handles = [module.register_forward_pre_hook(seen(name)) for name, module in modules.items()]
    try:
        logits(model, tokens_for(config, 4))
    finally:
        for handle in handles:
            handle.remove()
    return [name for name in modules if name not in ran]


def probe_clip_after_qk_norm(model: nn.Module, q_norm: nn.Module, config: Any, limit: float) -> bool | None:
    """Whether q is clamped after its QK norm (OLMoE) rather than before it, on a tiny model
    whose config sets the clamp to ``limit`` (pass one far below the projection's values):
    clamped first, the norm never sees a value beyond ``limit``; normalised first, it sees
    the raw projection. ``None`` when the norm never runs."""
    seen: list[float] = []

    def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = input_tensor(args, kwargs)
        if x is not None:
            seen.append(float(x.detach().abs().max()))

    handle = q_norm.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(tokens_for(config, 5))
    finally:
        handle.remove()
    if not seen:
        return None
    return max(seen) > limit * (1 + 1e-6)


# --------------------------------------------------------------- grouped routing


def _moe_block(anatomy: LayerAnatomy) -> nn.Module | None:
    """The first layer's MoE block: the child of a layer that holds the routed experts."""
    from skill.analysis.modules import experts_module, layer_has_experts

    layer = next((layer for layer in anatomy.layers if layer_has_experts(layer)), None)
    if layer is None:
        return None
    return next((c for c in layer.children() if experts_module(c) is not None and not is_norm(c)), None)


def _routing_capture(top_k: int, captured: dict[str, torch.Tensor]):
    """A forward pre-hook for the routed-experts module: keeps, from the first call handed
    both, the ``[tokens, top_k]`` expert indices and float weights in ``captured``
    (``"indices"``, ``"weights"``)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        values = [
            v
            for v in [*args, *kwargs.values()]
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[-1] == top_k
        ]
        index = next((v for v in values if _is_integer(v)), None)
        weights = next((v for v in values if v.is_floating_point()), None)
        if index is not None and weights is not None and not captured:
            captured["indices"] = index.detach().clone()
            captured["weights"] = weights.detach().clone()

    return hook


def route_designed_logits(
    anatomy: LayerAnatomy, num_experts: int, top_k: int, designed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The experts (``[tokens, top_k]`` indices) and weights HF's MoE block hands its experts
    when the router's logits are ``designed`` (``[tokens, num_experts]``).

    The router's 2D weight is set so that one-hot hidden states give exactly those logits;
    any other per-expert vector of the block (a score-correction bias, the router's own
    bias) is zeroed, so the logits alone decide. The model's weights are changed: call it
    on a model built for the probe. ``None`` when the block, its router or the experts'
    arguments are not found.
    """
    from skill.analysis.modules import experts_module, router_module

    block = _moe_block(anatomy)
    if block is None:
        return None
    router = router_module(block, num_experts)
    experts = experts_module(block)
    if router is None or experts is None:
        return None
    weight = router[1].weight
    if not isinstance(weight, torch.Tensor):
        return None
    tokens, width = designed.shape[0], int(weight.shape[1])
    if tokens > width:
        return None
    captured: dict[str, torch.Tensor] = {}
    hook = _routing_capture(top_k, captured)

    with torch.no_grad():
        for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
            if tensor.dim() == 1 and tensor.numel() == num_experts and not name.startswith(experts[0]):
                tensor.zero_()
        weight.zero_()
        weight[:, :tokens] = designed.T.to(weight.dtype)
        hidden = torch.eye(tokens, width).unsqueeze(0)
        handle = experts[1].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            block(hidden)
        except Exception as exc:  # forwards raise several exception types on odd inputs
            logger.debug("the MoE block refused the designed routing input: %s", exc)
            return None
        finally:
            handle.remove()
    return (captured["indices"], captured["weights"]) if captured else None


# Two groups of four experts, logits chosen so the rules disagree: group 0 holds the single
# best expert, group 1 the better pair. Scored by its best expert group 0 wins, by the sum of
# its two best group 1 wins (softmax or sigmoid scores alike); with no group limit the top-2
# takes one expert of each.
GROUP_RULE_LOGITS = (3.0, 0.0, 0.0, 0.0, 2.5, 2.5, 0.0, 0.0)


def probe_group_rule(anatomy: LayerAnatomy) -> str | None:
    """How a group-limited router scores a group, read off the experts HF's MoE block picks.

    Call it on a model whose config has 8 experts in 2 groups, 1 group kept and top-2
    routing. ``"max"`` (the group's best expert, DeepSeek-V2's group_limited_greedy),
    ``"sum_top2"`` (its two best, DeepSeek-V3's noaux_tc), ``None`` when the picks show no
    group limit (or the probe cannot run).
    """
    routed = route_designed_logits(anatomy, 8, 2, torch.tensor([GROUP_RULE_LOGITS]))
    if routed is None:
        return None
    chosen = set(routed[0][0].tolist())
    if 0 in chosen and chosen <= {0, 1, 2, 3}:
        return "max"
    if chosen == {4, 5}:
        return "sum_top2"
    return None


def routing_weights(anatomy: LayerAnatomy, num_experts: int, top_k: int) -> torch.Tensor | None:
    """The weights HF's MoE block gives its top-k experts for a fixed set of designed router
    logits (distinct, spread values), in expert order; ``None`` when the probe cannot run."""
    # Asymmetric: no two sigmoid scores sum to one, no two softmax rows renormalise alike;
    # the third row is the first one sharpened, so its top-k holds more of the softmax mass
    # (without renormalisation the rows' sums differ).
    logits = torch.stack(
        [
            torch.linspace(-1.7, 1.3, num_experts).roll(1),
            torch.linspace(-0.9, 2.1, num_experts).flip(-1),
            torch.linspace(-5.1, 3.9, num_experts).roll(2),
        ]
    )
    routed = route_designed_logits(anatomy, num_experts, top_k, logits)
    if routed is None:
        return None
    index, weights = routed
    order = index.argsort(dim=-1)
    return weights.gather(-1, order)


# ------------------------------------------------------------------ MoE router probes


def _expert_indices_and_weights(model: nn.Module, layer: nn.Module, config: Any, top_k: int, length: int = 6):
    """The routed-experts module's ``[tokens, top_k]`` expert indices and float weights in
    one forward of ``model`` (either ``None`` when no such argument is seen)."""
    from skill.analysis.modules import experts_module

    found = experts_module(layer)
    if found is None:
        return None, None
    captured: dict[str, torch.Tensor] = {}
    handle = found[1].register_forward_pre_hook(_routing_capture(top_k, captured), with_kwargs=True)
    try:
        with torch.no_grad():
            logits(model, tokens_for(config, length))
    except (TypeError, ValueError, RuntimeError) as exc:
        logger.debug("expert routing probe failed: %s", exc)
        return None, None
    finally:
        handle.remove()
    return captured.get("indices"), captured.get("weights")


def probe_selection_bias_placement(
    model: nn.Module, layer: nn.Module, router: nn.Module, bias: torch.Tensor, config: Any, top_k: int
) -> str:
    """Where a per-expert selection bias enters the router's top-k: ``"scores"`` (added to the
    scored experts, after the softmax or sigmoid: AReaL's ``expert_bias``) or ``"logits"``
    (added to the router logits before the score function). ``""`` when the probe cannot tell.

    The bias is set, for the first token, to ``-logits + eps * rank(logits)``: on the logits
    it leaves ``eps * rank``, which picks the experts of the highest logits; on the scores it
    leaves ``score(l) - l + eps * rank``, which decreases in ``l`` (a sigmoid's or softmax's
    slope is below one), so it picks the experts of the lowest logits.
    """
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or top_k <= 0 or 2 * top_k > bias.numel():
        return ""
    seen: dict[str, torch.Tensor] = {}

    def on_router(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = input_tensor(args, kwargs)
        if first is not None:
            seen.setdefault("x", first.detach().reshape(-1, first.shape[-1])[0].float())

    saved = bias.detach().clone()
    handle = router.register_forward_pre_hook(on_router, with_kwargs=True)
    try:
        with torch.no_grad():
            bias.zero_()
            logits(model, tokens_for(config, 6))
            handle.remove()
            x = seen.get("x")
            if x is None or x.shape[-1] != weight.shape[1]:
                return ""
            router_logits = weight.float() @ x
            linear_bias = getattr(router, "bias", None)
            if isinstance(linear_bias, torch.Tensor) and linear_bias.shape == router_logits.shape:
                router_logits = router_logits + linear_bias.float()
            spread = float(router_logits.max() - router_logits.min())
            if spread <= 0:
                return ""
            ranks = router_logits.argsort().argsort().float()
            eps = spread / (100.0 * bias.numel())
            bias.copy_((-router_logits + eps * ranks).to(bias.dtype))
            indices, _ = _expert_indices_and_weights(model, layer, config, top_k)
    except (TypeError, ValueError, RuntimeError) as exc:
        logger.debug("selection-bias probe failed: %s", exc)
        return ""
    finally:
        handle.remove()
        with torch.no_grad():
            bias.copy_(saved)
    if indices is None:
        return ""
    picked = set(indices[0].tolist())
    order = router_logits.argsort(descending=True).tolist()
    if picked == set(order[:top_k]):
        return "logits"
    if picked == set(order[-top_k:]):
        return "scores"
    return ""


def probe_renormalises_without_field(
    model: nn.Module, layer: nn.Module, config: Any, top_k: int, field: str = "norm_topk_prob"
) -> bool | None:
    """Whether the routed weights still sum to one constant per token with ``field`` set to
    False on every module of ``layer`` that holds it (and on the model's config): ``True``
    when the router renormalises whatever the field says for this config's scoring
    (a softmax over the top-k logits), ``None`` when no module holds the field or no weights
    are seen."""
    holders = [m for m in layer.modules() if isinstance(getattr(m, field, None), bool)]
    configs = [c for c in {id(c): c for c in (config, getattr(model, "config", None))}.values() if c is not None]
    configs = [c for c in configs if isinstance(getattr(c, field, None), bool)]
    if not holders:
        return None
    saved = [(m, getattr(m, field)) for m in (*holders, *configs)]
    try:
        for m, _ in saved:
            setattr(m, field, False)
        _, weights = _expert_indices_and_weights(model, layer, config, top_k)
    finally:
        for m, value in saved:
            setattr(m, field, value)
    if weights is None:
        return None
    sums = weights.float().sum(-1)
    return bool(torch.allclose(sums, sums[:1].expand_as(sums), atol=1e-4) and sums[0].abs() > 1e-6)


# A head width for the rotation probe: even, and wide enough that the half-split partner of
# dimension 0 (index 4) and its interleaved partner (index 1) differ.
_ROTATION_PROBE_DIM = 8


def probe_rotation(apply_rotary: Callable[..., Any]) -> tuple[str, bool] | None:
    """The pairing and direction of a HF rotary function ``apply_rotary(q, k, cos, sin)``
    (transformers' ``apply_rotary_pos_emb`` signature), read from what it computes:
    ``(pairing, reversed)`` with pairing ``"half"`` (dimension ``i`` rotates with
    ``i + d/2``) or ``"interleaved"`` (``2i`` with ``2i + 1``), and ``reversed`` true when
    the rotation goes the other way: transformers' ``rotate_half`` is ``(x1, x2) -> (-x2, x1)``,
    nanochat's ``(x2, -x1)``, which is the standard rotation by minus the angle.

    With ``cos = 1, sin = 0`` the function only lays the features out (a layout some
    implementations permute); with ``cos = 0, sin = 1`` it also turns every pair by a quarter
    turn. The quarter turn of unit vector ``e_0``, read against the layout of each ``e_j``,
    is ``+1`` at ``e_0``'s partner for the standard direction and ``-1`` for the reversed
    one, whatever the layout. ``None`` when the function does not take that signature or
    computes no rotation of pairs.
    """
    dim = _ROTATION_PROBE_DIM
    basis = torch.eye(dim).view(dim, 1, 1, dim)  # [batch, heads, seq, dim]: one unit vector per batch row
    ones, zeros = torch.ones(dim, 1, dim), torch.zeros(dim, 1, dim)  # [batch, seq, dim]
    try:
        with torch.no_grad():
            layout = apply_rotary(basis, basis, ones, zeros)[0]
            turned = apply_rotary(basis, basis, zeros, ones)[0]
    except Exception as exc:  # a rotary function of another signature or layout
        logger.debug("rotation probe: %s(q, k, cos, sin) raised %s", getattr(apply_rotary, "__name__", "?"), exc)
        return None
    if not isinstance(layout, torch.Tensor) or layout.shape != basis.shape or turned.shape != basis.shape:
        return None
    # Row j: the quarter turn of e_0 against the layout of e_j.
    inner = (layout.reshape(dim, dim) @ turned.reshape(dim, dim)[0]).tolist()
    partners = [j for j, value in enumerate(inner) if abs(value) > 0.5]
    if len(partners) != 1 or abs(abs(inner[partners[0]]) - 1.0) > 1e-5:
        return None
    partner = partners[0]
    if partner not in (1, dim // 2):
        return None
    return ("interleaved" if partner == 1 else "half"), inner[partner] < 0


# ------------------------------------------------------- absolute positions beyond RoPE

ABSOLUTE_PROBE_LENGTH = 6


def pinned_rope_logits(
    model: nn.Module,
    config: Any,
    start: int,
    length: int = ABSOLUTE_PROBE_LENGTH,
    query_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    query_modules: list[nn.Module] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The logits of the same tokens at positions ``0, 1, ...`` and at ``start, start + 1, ...``
    with every rotary module's output in the second run replaced by the one it gave in the
    first. RoPE then sees the same angles in both runs: what still differs reads the absolute
    position (Ministral3's query scale ``1 + beta * log(1 + floor(p / period))``). ``None``
    without a rotary module to pin, or when a run fails.

    ``query_scale`` (positions ``[1, T]`` -> factors ``[1, T]``) multiplies the output of each
    of ``query_modules`` (the query projections) in the second run: a factor on the queries
    written out, to compare a model without it against one that applies it itself."""
    rotaries = rotary_modules(model)
    if not rotaries:
        return None
    tokens = tokens_for(config, length)
    # Every call's output, in order: a rotary module may run once per layer type (Gemma3).
    near_outputs: dict[int, list[Any]] = {}
    replayed: dict[int, int] = {}

    def keep(index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            near_outputs.setdefault(index, []).append(output)

        return hook

    def replay(index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            calls = near_outputs.get(index, [])
            call = replayed.get(index, 0)
            replayed[index] = call + 1
            return calls[call] if call < len(calls) else output

        return hook

    def scaled(positions: torch.Tensor):
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            assert query_scale is not None
            return output * query_scale(positions).to(output.dtype).unsqueeze(-1)

        return hook

    def run(positions: torch.Tensor, far: bool) -> torch.Tensor | None:
        handles = [rotary.register_forward_hook((replay if far else keep)(i)) for i, rotary in enumerate(rotaries)]
        if far and query_scale is not None:
            handles += [module.register_forward_hook(scaled(positions)) for module in query_modules or []]
        try:
            with torch.no_grad():
                return model(input_ids=tokens, position_ids=positions, use_cache=False).logits
        except Exception as exc:  # a forward with a zeroed config value raises several exception types
            logger.debug("absolute-position probe failed: %s", exc)
            return None
        finally:
            for handle in handles:
                handle.remove()

    near = run(torch.arange(length).unsqueeze(0), far=False)
    if near is None or not near_outputs:
        return None
    far = run(torch.arange(start, start + length).unsqueeze(0), far=True)
    if far is None or far.shape != near.shape:
        return None
    return near, far


# ------------------------------------------------------------------ weight tying


def probe_head_is_embedding(model: nn.Module) -> bool | None:
    """Whether the LM head's weight is the token embedding's: the same tensor, or one that
    follows a change of the embedding (a head that copies it). ``None`` without both.

    transformers ties by its class's ``_tied_weights_keys`` when the config says so; a
    remote-code class without them keeps its own head whatever ``tie_word_embeddings`` is."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    embedding_weight = getattr(embedding, "weight", None)
    head_weight = getattr(head, "weight", None)
    if not isinstance(embedding_weight, torch.Tensor) or not isinstance(head_weight, torch.Tensor):
        return None
    if head_weight is embedding_weight or head_weight.data_ptr() == embedding_weight.data_ptr():
        return True
    if head_weight.shape != embedding_weight.shape:
        return False
    with _preserved(embedding), torch.no_grad():
        embedding_weight.add_(torch.randn(embedding_weight.shape, generator=_generator()))
        return bool(torch.equal(head_weight, embedding_weight))


# ------------------------------------------------------------ embedding rows without gradient


def probe_frozen_embedding_row(model: nn.Module, row: int, other: int) -> bool | None:
    """Whether the token embedding gives row ``row`` no gradient through its lookup while
    row ``other`` gets one (``nn.Embedding``'s ``padding_idx``): both ids are looked up and
    a random projection of the output is back-propagated. ``None`` when the embedding has
    no weight or neither row is reached."""
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor) or max(row, other) >= weight.shape[0]:
        return None
    tokens = torch.tensor([[other, row, other, row]])
    with torch.enable_grad():
        out = embedding(tokens)
        out = out[0] if isinstance(out, tuple) else out
        projection = torch.randn(out.shape, generator=_generator(), dtype=out.dtype)
        (grad,) = torch.autograd.grad((out * projection).sum(), weight, allow_unused=True)
    if grad is None or not bool(grad[other].abs().gt(0).any()):
        return None
    return not bool(grad[row].abs().gt(0).any())
