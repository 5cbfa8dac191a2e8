"""Differential attention (the Differential Transformer, HF's DiffLlama), measured on the real
HF modules.

Such an attention holds, besides its projections, four vectors of ``head_dim`` entries and a
weightless RMS norm over ``2 * head_dim``. Every query head ``h`` attends (one softmax, ``A_h``)
over the values of a *pair* of KV heads side by side, and query heads ``i`` and ``i + H/2``
form a pair whose outputs are subtracted:

    V_first(i)  = V[(i // n_rep) mod (KV/2)],  V_second(i) = V[(i // n_rep) mod (KV/2) + KV/2]
    out_h       = A_h [V_first(h) | V_second(h)]                        (2 * head_dim wide)
    lambda      = exp(a . b) - exp(c . d) + lambda_init(layer)
    y_i         = (1 - lambda_init(layer)) * rmsnorm(out_i - lambda * out_{i + H/2})

and the output projection reads ``[y_0 | ... | y_{H/2 - 1}]``. What the probe measures on every
layer of the full-depth stack, with the four vectors set to random values: which vectors pair
(and which pair is subtracted), the norm's epsilon, and that ``lambda_init`` follows the one
schedule the port writes (``0.8 - 0.6 * exp(-0.3 * layer)``, the paper's); the attention weights
``A`` are read from the forward's own softmax, the values from the value projection's output and
the result from the output projection's input, so no RoPE, mask or scale is assumed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from skill.analysis import modules as mt
from skill.analysis import probes
from skill.features import DifferentialAttention, NormKind
from skill.snippets.differential import differential_lambda_init

PROBE_LENGTH = 8
# The one lambda_init schedule the port writes (the Differential Transformer's, DiffLlama's): the
# probe measures HF against the very function the generated package runs.
LAMBDA_INIT = "0.8 - 0.6 * exp(-0.3 * layer)"
lambda_init = differential_lambda_init


def differential_parts(attention: nn.Module, head_dim: int) -> tuple[list[str], str] | None:
    """The attention's four ``head_dim`` vectors (in their module order) and its one weightless
    norm besides its QK norms (which may be weightless too), or None when it has not exactly
    those (it is then no differential attention)."""
    vectors = [
        name
        for name, param in attention.named_parameters(recurse=False)
        if param.ndim == 1 and param.numel() == head_dim
    ]
    qk = {pair[0] for pair in mt.qk_norms(attention) if pair is not None}
    norms = [
        name
        for name, child in attention.named_children()
        if mt.is_norm(child) and name not in qk and next(child.parameters(), None) is None
    ]
    if len(vectors) != 4 or len(norms) != 1:
        return None
    return vectors, norms[0]


@contextmanager
def _random_vectors(attentions: list[nn.Module], names: list[str]) -> Iterator[None]:
    """Each layer's four vectors set to distinct random values (restored afterwards), so the
    two exponentials differ from each other, from one and from layer to layer."""
    generator = torch.Generator().manual_seed(11)
    saved = [[getattr(a, n).detach().clone() for n in names] for a in attentions]
    try:
        with torch.no_grad():
            for attention in attentions:
                for name in names:
                    param = getattr(attention, name)
                    param.copy_(0.35 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
        yield
    finally:
        with torch.no_grad():
            for attention, values in zip(attentions, saved, strict=True):
                for name, value in zip(names, values, strict=True):
                    getattr(attention, name).copy_(value)


def _capture(
    model: nn.Module, attentions: list[nn.Module], v_name: str, o_name: str
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
    """(attention weights, value projection outputs, output projection inputs) per layer, in
    float64, each the first of its kind inside the layer's attention: the weights are recorded
    by the score-scale probe's recorder (``probes.SoftmaxWeights``), active while the module runs."""
    mode = probes.SoftmaxWeights()
    first_softmax: list[int] = []  # per layer entered: its first entry in mode.weights
    values: dict[int, torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}

    def enter(module: nn.Module, args: tuple) -> None:
        first_softmax.append(len(mode.weights))
        mode.active = True

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        mode.active = False

    def value(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            values.setdefault(len(first_softmax) - 1, output.detach().double())

    def projected(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            inputs.setdefault(len(first_softmax) - 1, args[0].detach().double())

    handles = []
    for attention in attentions:
        handles += [
            attention.register_forward_pre_hook(enter),
            attention.register_forward_hook(leave),
            getattr(attention, v_name).register_forward_hook(value),
            getattr(attention, o_name).register_forward_pre_hook(projected),
        ]
    try:
        with mode, torch.no_grad():
            model(input_ids=probes.tokens_for(model.config, PROBE_LENGTH), use_cache=False)
    except (TypeError, ValueError, RuntimeError):
        return None
    finally:
        for handle in handles:
            handle.remove()
    n = len(attentions)
    ends = [*first_softmax[1:], len(mode.weights)]
    if len(first_softmax) != n or any(s >= e for s, e in zip(first_softmax, ends, strict=True)):
        return None  # a layer ran no square softmax (or an attention ran more than once)
    if len(values) != n or len(inputs) != n:
        return None
    return (
        [mode.weights[i].double() for i in first_softmax],
        [values[i] for i in range(n)],
        [inputs[i] for i in range(n)],
    )


def closed_form(
    weights: torch.Tensor,
    value: torch.Tensor,
    vectors: list[torch.Tensor],
    pairing: tuple[int, int, int, int],
    init: float,
    eps: float,
    n_kv_heads: int,
) -> torch.Tensor:
    """The output projection's input by the formula of the module docstring, float64:
    ``weights`` ``[1, H, T, T]``, ``value`` ``[1, T, KV * d]``; ``pairing`` ``(a, b, c, d)``
    indexes ``vectors`` as ``lambda = exp(a . b) - exp(c . d) + init``."""
    heads, length = weights.shape[1], weights.shape[2]
    head_dim = value.shape[-1] // n_kv_heads
    v = value[0].view(length, n_kv_heads, head_dim).transpose(0, 1)  # [KV, T, d]
    v = v.repeat_interleave(heads // n_kv_heads, dim=0)  # [H, T, d]
    half = heads // 2
    pair_values = torch.cat([v[:half], v[half:]], dim=-1).repeat(2, 1, 1)  # [H, T, 2d]
    out = weights[0] @ pair_values  # [H, T, 2d]
    a, b, c, d = (vectors[i].double() for i in pairing)
    lam = torch.exp((a * b).sum()) - torch.exp((c * d).sum()) + init
    diff = out[:half] - lam * out[half:]
    normed = diff * torch.rsqrt(diff.pow(2).mean(-1, keepdim=True) + eps) * (1 - init)
    return normed.transpose(0, 1).reshape(length, -1)  # [T, H/2 * 2d]


# (a, b, c, d): the vectors whose products are added (a . b) and subtracted (c . d).
_PAIRINGS = [(p[0], p[1], p[2], p[3]) for p in itertools.permutations(range(4)) if p[0] < p[1] and p[2] < p[3]]


def measure_differential(
    model: nn.Module,
    attentions: list[nn.Module],
    v_name: str,
    o_name: str,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[DifferentialAttention | None, str | None]:
    """``(the measured attention, None)``, or ``(None, why not)`` in words for the report;
    ``v_name``/``o_name``: the value and output projections' names inside an attention."""
    parts = differential_parts(attentions[0], head_dim)
    if parts is None:
        return None, None
    names, norm_name = parts
    if n_kv_heads % 2:
        return None, f"differential attention over an odd number of KV heads ({n_kv_heads})"
    norm = getattr(attentions[0], norm_name)
    kind = probes.probe_norm_kind(norm, 2 * head_dim)
    eps = probes.probe_norm_eps(norm, 2 * head_dim, kind) if kind is NormKind.RMS_WEIGHTLESS else None
    if eps is None:
        return None, f"differential attention whose pair norm is {kind.value}, not a weightless RMS norm"
    with _random_vectors(attentions, names):
        captured = _capture(model, attentions, v_name, o_name)
        vectors = [[getattr(a, n).detach().clone() for n in names] for a in attentions]
    if captured is None:
        return None, "differential attention whose weights, values or output no probe reads"
    weights, values, inputs = captured
    layer0 = [
        p
        for p in _PAIRINGS
        if torch.allclose(
            closed_form(weights[0], values[0], vectors[0], p, lambda_init(0), eps, n_kv_heads),
            inputs[0][0],
            rtol=1e-4,
            atol=1e-5,
        )
    ]
    if len(layer0) != 1:
        return None, "differential attention that is not (softmax_1 - lambda softmax_2) V over head pairs"
    pairing = layer0[0]
    for layer in range(1, len(attentions)):
        want = closed_form(weights[layer], values[layer], vectors[layer], pairing, lambda_init(layer), eps, n_kv_heads)
        if not torch.allclose(want, inputs[layer][0], rtol=1e-4, atol=1e-5):
            return None, f"differential attention whose lambda_init schedule is not {LAMBDA_INIT} (layer {layer})"
    return (
        DifferentialAttention(
            lambda_vectors=[names[i] for i in pairing],
            norm=norm_name,
            norm_eps=eps,
            lambda_init=LAMBDA_INIT,
        ),
        None,
    )
