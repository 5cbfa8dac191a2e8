"""The generated HF model is itself right: the self-check every fuzzed family passes first.

A family's port can only be judged against a correct HF implementation, so before a seed
is ported its own model is checked, from the files in its folder:

- it loads with no missing, unexpected or mismatched key, and its weights are the files';
- forward and backward run, logits, loss and every gradient are finite;
- it is causal: logits up to a position ignore every later token;
- each norm computes its kind's closed form (RMS, (1 + w), weightless, LayerNorm...);
- RoPE rotates each feature pair by ``position * inv_freq`` in the family's pairing and
  direction, leaves the non-rotary features alone, and its frequencies are
  ``theta ** (-2i / d)`` (divided by the factor for linear scaling);
- the attention of layer 0 equals an independent re-implementation of the spec (q/k/v
  layout, QK norm and its placement, RoPE or NoPE, scale, soft-cap, ALiBi, window, sinks);
- the block of layer 0 wires its norms, branches and ``residual_multiplier`` as the
  placement says; a MoE block routes and combines as the spec says;
- sliding windows mask what the window excludes, chunks what the chunk excludes; ALiBi slopes are ``2 ** (-8 i / n)``;
- the head is tied exactly when the spec says; logits are transformed (divided,
  multiplied, soft-capped) as the config says; the embedding is scaled as it says.

Each check raises :class:`FamilyCheckError` naming what differs: a generator bug.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.fuzz.naming import NamingScheme, scheme_for
from tests.fuzz.spec import FamilySpec, NormKind

ATOL = 1e-5


class FamilyCheckError(AssertionError):
    """The generated HF model does not do what its spec says (a generator bug)."""


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        raise FamilyCheckError(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    bound = ATOL + rtol * want.abs()
    excess = ((got - want).abs() - bound).max()
    if excess > 0:
        raise FamilyCheckError(f"{name}: differs by {(got - want).abs().max():.3e} from its closed form")


def load_folder(folder: Path) -> PreTrainedModel:
    model, info = AutoModelForCausalLM.from_pretrained(
        str(folder),
        trust_remote_code=True,
        local_files_only=True,
        dtype=torch.float32,
        attn_implementation="eager",
        output_loading_info=True,
    )
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise FamilyCheckError(f"from_pretrained of the folder: {problems}")
    return model.eval()


def _tokens(spec: FamilySpec, shape: tuple[int, int], seed: int) -> torch.Tensor:
    tokens = torch.randint(3, spec.vocab_size, shape, generator=torch.Generator().manual_seed(seed))
    if spec.pad_token_id is not None:
        tokens[tokens == spec.pad_token_id] = spec.pad_token_id + 3
    return tokens


# --------------------------------------------------------------------------- whole model


def check_weights_are_the_files(model: PreTrainedModel, folder: Path) -> None:
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(str(file)))
    state = model.state_dict()
    for key, tensor in saved.items():
        if key not in state:
            raise FamilyCheckError(f"saved key {key} is no state of the loaded model")
        _close(f"loaded {key}", state[key], tensor, rtol=0.0)


def check_forward_backward(model: PreTrainedModel, spec: FamilySpec) -> None:
    tokens = _tokens(spec, (2, 24), 1)
    out = model(input_ids=tokens, labels=tokens)
    if not torch.isfinite(out.logits).all() or not torch.isfinite(out.loss):
        raise FamilyCheckError("forward: non-finite logits or loss")
    out.loss.backward()
    for name, param in model.named_parameters():
        if param.grad is None:
            if "experts" in name:
                continue  # an expert no token was routed to
            raise FamilyCheckError(f"backward: {name} got no gradient")
        if not torch.isfinite(param.grad).all():
            raise FamilyCheckError(f"backward: non-finite gradient of {name}")
    model.zero_grad(set_to_none=True)


def check_causal(model: PreTrainedModel, spec: FamilySpec) -> None:
    tokens = _tokens(spec, (1, 24), 2)
    changed = tokens.clone()
    changed[:, 12:] = _tokens(spec, (1, 12), 3)
    with torch.no_grad():
        a = model(input_ids=tokens).logits[:, :12]
        b = model(input_ids=changed).logits[:, :12]
    # Not bit-equal: a MoE block batches other rows per expert when later tokens change.
    moved = float((a - b).abs().max())
    if moved > 1e-4 * (1.0 + float(a.abs().max())):
        raise FamilyCheckError(f"not causal: changing tokens 12.. moved earlier logits by {moved:.3e}")


def check_tying(model: PreTrainedModel, spec: FamilySpec, folder: Path) -> None:
    head = model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight
    tied = head.data_ptr() == embedding.data_ptr()
    if tied != (spec.tying == "tied"):
        raise FamilyCheckError(f"head {'is' if tied else 'is not'} tied to the embedding; the spec says {spec.tying}")
    if spec.tying != "tied":
        keys = set()
        for file in folder.glob("*.safetensors"):
            keys |= set(load_file(str(file)))
        naming = scheme_for(spec)
        if f"{naming.head}.weight" not in keys:
            raise FamilyCheckError(f"untied head {naming.head}.weight missing from the checkpoint")


def check_logits_transform(model: PreTrainedModel, spec: FamilySpec) -> None:
    """Logits = softcap(head(h) / logits_scaling or * logit_scale), as the config says."""
    captured: dict[str, torch.Tensor] = {}
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, out: captured.__setitem__("head", out))
    try:
        with torch.no_grad():
            logits = model(input_ids=_tokens(spec, (1, 16), 4)).logits
    finally:
        handle.remove()
    want = captured["head"]
    sc = spec.scalars
    if sc.logits == "divide":
        want = want / sc.logits_value
    elif sc.logits == "multiply":
        want = want * sc.logits_value
    if sc.final_softcap is not None:
        want = torch.tanh(want / sc.final_softcap) * sc.final_softcap
    _close("logits after the head", logits, want)


def check_embedding_scale(model: PreTrainedModel, spec: FamilySpec, naming: NamingScheme) -> None:
    stack = model.get_submodule(naming.stack_path)
    layers = getattr(stack, naming.layers)
    captured: dict[str, torch.Tensor] = {}
    handle = layers[0].register_forward_pre_hook(lambda m, args: captured.__setitem__("x", args[0]))
    tokens = _tokens(spec, (1, 16), 5)
    try:
        with torch.no_grad():
            model(input_ids=tokens)
    finally:
        handle.remove()
    with torch.no_grad():
        want = model.get_input_embeddings()(tokens)
        sc = spec.scalars
        if sc.embedding_scale == "sqrt_dim":
            want = want * torch.tensor(spec.hidden_size**0.5, dtype=want.dtype)
        elif sc.embedding_scale == "multiplier":
            want = want * sc.embedding_multiplier
        if spec.positions == "learned":
            want = want + getattr(stack, naming.positions)(torch.arange(16)[None])
    _close("layer 0's input (scaled embeddings)", captured["x"], want)


# ------------------------------------------------------------------------------- norms


def norm_kind_of(module: nn.Module) -> NormKind | None:
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm) and "LayerNorm1P" in name:
        return "layer_norm_one_plus_w"
    if isinstance(module, nn.LayerNorm):
        if module.weight is None:
            return "layer_norm_weightless"
        return "layer_norm" if module.bias is not None else "layer_norm_no_bias"
    if "ZeroCenteredRMSNorm" in name:
        return "rms_one_plus_w"
    if "WeightlessRMSNorm" in name or (isinstance(module, nn.RMSNorm) and module.weight is None):
        return "rms_weightless"
    if "RMSNorm" in name:
        return "rms"
    return None


def _norm_closed_form(kind: NormKind, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None)
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    w = None if weight is None else weight.detach().double()
    if kind.startswith("rms"):
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    if kind in ("rms_one_plus_w", "layer_norm_one_plus_w"):
        y = y * (1.0 + w)
    elif w is not None:
        y = y * w
    if bias is not None:
        y = y + bias.detach().double()
    return y


def check_norms(model: PreTrainedModel, spec: FamilySpec) -> None:
    generator = torch.Generator().manual_seed(6)
    qk = spec.attention.qk_norm
    for name, module in model.named_modules():
        kind = norm_kind_of(module)
        if kind is None:
            continue
        last = name.rsplit(".", 1)[-1]
        if last.startswith(("q_a", "kv_a")):
            expected: NormKind = "rms"
        elif last.startswith(("q_", "k_")) and qk is not None:
            expected = qk.kind
        elif last == "pair_norm":
            expected = "rms_weightless"  # differential attention's, whatever the block norms are
        else:
            expected = spec.norm.kind
        if kind != expected:
            raise FamilyCheckError(f"{name} computes {kind}; the spec says {expected}")
        width = int(module.normalized_shape[0]) if isinstance(module, nn.LayerNorm) else _norm_width(module)
        x = torch.randn(3, width, generator=generator) * 3.0 + 1.0
        with torch.no_grad():
            _close(f"norm {name} ({kind})", module(x), _norm_closed_form(kind, module, x))


def _norm_width(module: nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if weight is not None:
        return int(weight.numel())
    if isinstance(module, nn.RMSNorm):
        return int(module.normalized_shape[0])
    return int(module.hidden_size)


# -------------------------------------------------------------------------------- RoPE


def _modeling_module(model: PreTrainedModel) -> ModuleType:
    return sys.modules[type(model).__module__]


def _rotary(model: PreTrainedModel, naming: NamingScheme) -> nn.Module:
    return model.get_submodule(f"{naming.stack_path}.rotary_emb")


def _rotary_dim(spec: FamilySpec) -> tuple[int, int]:
    """(head width RoPE reads, rotated features)."""
    assert spec.rope is not None
    if spec.mla is not None:
        return spec.mla.qk_rope_head_dim, spec.mla.qk_rope_head_dim
    head = spec.attention.head_dim
    return head, int(head * spec.rope.partial_factor)


def rotate_closed_form(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    spec: FamilySpec,
    scale: float,
    *,
    pairing: str,
    direction: str,
) -> torch.Tensor:
    """RoPE by its definition: each pair ``(a, b)`` of the rotated features turned by
    ``angle = position * inv_freq[i]`` (by ``-angle`` when reversed), times ``scale``."""
    x = x.double()
    out = x.clone()
    n = inv_freq.numel()
    angle = positions.double()[:, None] * inv_freq.double()[None, :]  # (P, n)
    cos, sin = torch.cos(angle) * scale, torch.sin(angle) * scale
    sign = 1.0 if direction == "standard" else -1.0
    for i in range(n):
        a, b = (i, i + n) if pairing == "half" else (2 * i, 2 * i + 1)
        xa, xb = x[..., a], x[..., b]
        out[..., a] = xa * cos[:, i] - sign * xb * sin[:, i]
        out[..., b] = xb * cos[:, i] + sign * xa * sin[:, i]
    return out


def check_rope(model: PreTrainedModel, spec: FamilySpec, naming: NamingScheme) -> None:
    rope = spec.rope
    assert rope is not None
    rotary = _rotary(model, naming)
    head, rotated = _rotary_dim(spec)
    inv_freq = rotary.inv_freq.detach().double()
    if inv_freq.numel() * 2 != rotated:
        raise FamilyCheckError(f"RoPE has {inv_freq.numel()} frequencies for {rotated} rotated features")
    if rope.scaling in ("default", "linear"):
        want = rope.theta ** (-torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
        if rope.scaling == "linear":
            want = want / 4.0
        _close("RoPE inverse frequencies", inv_freq, want)
    positions = torch.arange(20)
    x = torch.randn(1, 20, head, generator=torch.Generator().manual_seed(7))
    cos, sin = rotary(x, positions[None])
    apply = _modeling_module(model).apply_rotary_pos_emb
    q = torch.randn(1, 2, 20, head, generator=torch.Generator().manual_seed(8))
    k = torch.randn(1, 1, 20, head, generator=torch.Generator().manual_seed(9))
    scale = float(rotary.attention_scaling)
    if spec.mla is not None and spec.mla.rope_interleave:
        apply = _modeling_module(model).apply_rotary_pos_emb_interleave
    got_q, got_k = apply(q, k, cos, sin)
    pairing = "interleaved" if (spec.mla is not None and spec.mla.rope_interleave) else rope.pairing
    if spec.mla is not None:
        pairing = "interleaved" if spec.mla.rope_interleave else "half"
    want_q = rotate_closed_form(q, positions, rotary.inv_freq, spec, scale, pairing=pairing, direction=rope.direction)
    want_k = rotate_closed_form(k, positions, rotary.inv_freq, spec, scale, pairing=pairing, direction=rope.direction)
    if spec.mla is not None and spec.mla.rope_interleave:
        # DeepSeek's helper returns the rotated pairs de-interleaved: (a0, a1, ..., b0, b1, ...).
        order = torch.cat([torch.arange(0, head, 2), torch.arange(1, head, 2)])
        want_q, want_k = want_q[..., order], want_k[..., order]
    _close("RoPE of q", got_q, want_q)
    _close("RoPE of k", got_k, want_k)


# --------------------------------------------------------------------------- attention


def check_window_mask(model: PreTrainedModel, spec: FamilySpec) -> None:
    mask = _modeling_module(model).causal_mask(None, 1, 16, torch.float32, "cpu", spec.attention.window_size)
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    allowed = (j <= i) & (i - j < spec.attention.window_size)
    if not torch.equal(mask[0, 0] == 0, allowed):
        raise FamilyCheckError("sliding-window mask lets through other keys than the window's")


def check_chunk_mask(model: PreTrainedModel, spec: FamilySpec) -> None:
    chunk = spec.attention.chunk_size
    mask = _modeling_module(model).causal_mask(None, 1, 3 * chunk + 2, torch.float32, "cpu", chunk=chunk)
    i, j = torch.meshgrid(torch.arange(3 * chunk + 2), torch.arange(3 * chunk + 2), indexing="ij")
    if not torch.equal(mask[0, 0] == 0, (j <= i) & (i // chunk == j // chunk)):
        raise FamilyCheckError("chunked mask lets through other keys than the chunk's")


def check_window_reach(model: PreTrainedModel, spec: FamilySpec) -> None:
    """Every layer windowed: token 0 reaches no further than n_layers * (window - 1) positions."""
    w, layers = spec.attention.window_size, spec.n_layers
    length = layers * (w - 1) + 4
    tokens = _tokens(spec, (1, length), 10)
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % spec.vocab_size or 3
    with torch.no_grad():
        a = model(input_ids=tokens).logits[0, layers * (w - 1) + 1 :]
        b = model(input_ids=changed).logits[0, layers * (w - 1) + 1 :]
    if float((a - b).abs().max()) > 1e-4 * (1.0 + float(a.abs().max())):
        raise FamilyCheckError("sliding window: token 0 reaches beyond n_layers * (window - 1)")


def alibi_closed_form(heads: int) -> torch.Tensor:
    """2 ** (-8 i / n) for i = 1..n when n is a power of two, Press et al.'s interleaving otherwise."""

    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(heads).is_integer():
        return torch.tensor(powers(heads), dtype=torch.float64)
    closest = 2 ** math.floor(math.log2(heads))
    return torch.tensor(powers(closest) + powers(2 * closest)[0::2][: heads - closest], dtype=torch.float64)


def _qkv(spec: FamilySpec, naming: NamingScheme, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Flat q, k, v of ``x``, by the spec's own definition of the projections' layout."""
    att = spec.attention
    h, kv, d = att.n_heads, att.n_kv_heads, att.head_dim
    if att.fused_qkv == "none":
        q, k, v = (getattr(attn, n)(x) for n in (naming.q, naming.k, naming.v))
    else:
        fused = getattr(attn, naming.qkv)
        weight, bias = fused.weight, fused.bias
        rows = torch.arange(weight.shape[0])
        if att.fused_qkv == "stacked":
            q_rows, k_rows, v_rows = rows[: h * d], rows[h * d : (h + kv) * d], rows[(h + kv) * d :]
        else:
            group = h // kv + 2
            per = rows.view(kv, group, d)
            q_rows, k_rows, v_rows = per[:, :-2].reshape(-1), per[:, -2].reshape(-1), per[:, -1].reshape(-1)
        q, k, v = (F.linear(x, weight[r], None if bias is None else bias[r]) for r in (q_rows, k_rows, v_rows))
    if att.clip_qkv is not None:
        q, k, v = (t.clamp(-att.clip_qkv, att.clip_qkv) for t in (q, k, v))
    return q, k, v


def reference_attention(
    spec: FamilySpec, naming: NamingScheme, attn: nn.Module, x: torch.Tensor, layer: int, rope: Callable | None
) -> torch.Tensor:
    """Layer ``layer``'s attention of ``x`` computed from the spec, not from the generated forward."""
    att = spec.attention
    b, s, _ = x.shape
    h, kv, d = att.n_heads, att.n_kv_heads, att.head_dim
    q, k, v = _qkv(spec, naming, attn, x)
    qk = att.qk_norm
    norms = [m for n, m in attn.named_children() if norm_kind_of(m) is not None and n != "pair_norm"]
    if qk is not None and qk.width == "full_width":
        q, k = norms[0](q), norms[1](k)
    q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
    uses_rope = spec.positions == "rope"
    if att.nope == "per_layer_field":
        uses_rope = bool(att.rope_layers[layer])
    elif att.nope == "layer_type":
        uses_rope = att.layer_types[layer] == "sliding_attention"
    # Llama 4's QK norm is on the layers that apply RoPE only.
    per_head = qk is not None and qk.width == "per_head" and (uses_rope or not qk.rope_layers_only)
    after = per_head and qk is not None and qk.after_rope and spec.positions == "rope"
    if per_head and not after:
        q, k = norms[0](q), norms[1](k)
    if uses_rope and rope is not None:
        q, k = rope(q), rope(k)
    if after:
        q, k = norms[0](q), norms[1](k)
    k = k.repeat_interleave(h // kv, dim=1)
    v = v.repeat_interleave(h // kv, dim=1)
    if att.scale == "query_pre_attn_scalar":
        scale = att.scale_value**-0.5
    elif att.scale == "attention_multiplier":
        scale = att.scale_value
    else:
        scale = d**-0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    if att.softcap is not None:
        scores = torch.tanh(scores / att.softcap) * att.softcap
    i = torch.arange(s)
    if spec.positions == "alibi":
        scores = scores + alibi_closed_form(h).to(scores.dtype)[:, None, None] * (i[None, :] - i[:, None])
    allowed = i[None, :] <= i[:, None]
    windowed = att.window == "all" or (att.window == "some" and att.layer_types[layer] == "sliding_attention")
    if windowed:
        allowed = allowed & (i[:, None] - i[None, :] < att.window_size)
    if att.chunk == "all" or (att.chunk == "some" and att.layer_types[layer] == "chunked_attention"):
        allowed = allowed & (i[:, None] // att.chunk_size == i[None, :] // att.chunk_size)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if att.sinks:
        sink = attn.sinks.view(1, h, 1, 1).expand(b, h, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = differential_closed_form(spec, attn, probs, v, layer) if att.differential else probs @ v
    return getattr(attn, naming.o)(out.transpose(1, 2).reshape(b, s, -1))


def differential_closed_form(
    spec: FamilySpec, attn: nn.Module, probs: torch.Tensor, v: torch.Tensor, layer: int
) -> torch.Tensor:
    """Differential attention by its definition, pair by pair: heads ``i`` and ``i + H/2``
    both read ``[v_i | v_{i + H/2}]``; the pair's output is ``(1 - l0) * rmsnorm(first - lambda *
    second)`` with ``lambda = exp(q1 . k1) - exp(q2 . k2) + l0``, ``l0 = 0.8 - 0.6 exp(-0.3 layer)``."""
    half = spec.attention.n_heads // 2
    init = 0.8 - 0.6 * math.exp(-0.3 * layer)
    lam = torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
    pairs = []
    for i in range(half):
        values = torch.cat([v[:, i], v[:, i + half]], dim=-1)
        diff = probs[:, i] @ values - (lam + init) * (probs[:, i + half] @ values)
        normed = diff * torch.rsqrt(diff.pow(2).mean(-1, keepdim=True) + attn.pair_norm.eps)
        pairs.append((1 - init) * normed)
    return torch.stack(pairs, dim=1)


def check_attention(model: PreTrainedModel, spec: FamilySpec, naming: NamingScheme) -> None:
    stack = model.get_submodule(naming.stack_path)
    layers = getattr(stack, naming.layers)
    x = torch.randn(1, 14, spec.hidden_size, generator=torch.Generator().manual_seed(11))
    masks = _masks(model, spec, 14)
    position_embeddings = stack.rotary_emb(x, torch.arange(14)[None]) if spec.positions == "rope" else None
    for index, layer in enumerate(layers):
        attn = getattr(layer, naming.attention)
        rope = None
        if position_embeddings is not None:
            cos, sin = position_embeddings
            apply = _modeling_module(model).apply_rotary_pos_emb
            rope = lambda t, cos=cos, sin=sin, apply=apply: apply(t, t, cos, sin)[0]  # noqa: E731
        with torch.no_grad():
            got = attn(x, position_embeddings, masks[layer.attention_type])
            want = reference_attention(spec, naming, attn, x, index, rope)
        _close(f"attention of layer {index}", got, want, rtol=1e-4)


def _masks(model: PreTrainedModel, spec: FamilySpec, seq: int) -> dict[str, torch.Tensor]:
    causal = _modeling_module(model).causal_mask
    masks = {"full_attention": causal(None, 1, seq, torch.float32, "cpu")}
    if spec.attention.window != "none":
        masks["sliding_attention"] = causal(None, 1, seq, torch.float32, "cpu", spec.attention.window_size)
    if spec.attention.chunk != "none":
        masks["chunked_attention"] = causal(None, 1, seq, torch.float32, "cpu", chunk=spec.attention.chunk_size)
    return masks


# ------------------------------------------------------------------------------- block


def check_block(model: PreTrainedModel, spec: FamilySpec, naming: NamingScheme) -> None:
    """Layer 0's output from its sub-modules' outputs, by the placement's formula."""
    stack = model.get_submodule(naming.stack_path)
    layer = getattr(stack, naming.layers)[0]
    from tests.fuzz.blocks import ffn_attr

    ffn_name = ffn_attr(spec, naming)
    if ffn_name is None:
        return  # OPT's inline feed-forward has no module to observe
    attn, ffn = getattr(layer, naming.attention), getattr(layer, ffn_name)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(key: str):  # type: ignore[no-untyped-def]
        return lambda m, args, out: seen.__setitem__(key, (args[0], out))

    handles = [attn.register_forward_hook(record("attn")), ffn.register_forward_hook(record("ffn"))]
    x = torch.randn(1, 12, spec.hidden_size, generator=torch.Generator().manual_seed(12))
    masks = _masks(model, spec, 12)
    pe = stack.rotary_emb(x, torch.arange(12)[None]) if spec.positions == "rope" else None
    try:
        with torch.no_grad():
            y = layer(x, pe, masks[layer.attention_type])
    finally:
        for handle in handles:
            handle.remove()
    norms = {role: getattr(layer, n) for role, n in naming.norms[spec.norm.placement].items() if hasattr(layer, n)}
    m = spec.scalars.residual_multiplier or 1.0
    (a_in, a_out), (f_in, f_out) = seen["attn"], seen["ffn"]
    with torch.no_grad():
        match spec.norm.placement:
            case "pre":
                _close("attention input", a_in, norms["attn_in"](x))
                h = x + m * a_out
                _close("feed-forward input", f_in, norms["ffn_in"](h))
                _close("block output", y, h + m * f_out)
            case "sandwich":
                _close("attention input", a_in, norms["attn_in"](x))
                h = x + m * norms["attn_out"](a_out)
                _close("feed-forward input", f_in, norms["ffn_in"](h))
                _close("block output", y, h + m * norms["ffn_out"](f_out))
            case "post_sublayer":
                _close("attention input", a_in, x)
                h = x + m * norms["attn_out"](a_out)
                _close("feed-forward input", f_in, h)
                _close("block output", y, h + m * norms["ffn_out"](f_out))
            case "post_ln":
                _close("attention input", a_in, x)
                h = norms["attn_out"](x + m * a_out)
                _close("feed-forward input", f_in, h)
                _close("block output", y, norms["ffn_out"](h + m * f_out))
            case "parallel":
                _close("attention input", a_in, norms["attn_in"](x))
                ffn_norm = norms["attn_in"] if spec.norm.shared_parallel_norm else norms["ffn_in"]
                _close("feed-forward input", f_in, ffn_norm(x))
                _close("block output", y, x + m * a_out + m * f_out)


# --------------------------------------------------------------------------------- MoE


def reference_routing(spec: FamilySpec, logits: torch.Tensor, correction: torch.Tensor | None) -> torch.Tensor:
    """The dense ``(tokens, experts)`` weight matrix the spec's router gives, token by token."""
    moe = spec.moe
    assert moe is not None
    logits = logits.double()
    weights = torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        scores = torch.softmax(logits[t], -1) if moe.scoring == "softmax" else torch.sigmoid(logits[t])
        choice = scores + (correction.double() if correction is not None else 0.0)
        if moe.n_group > 1:
            size = moe.n_experts // moe.n_group
            group_scores = [sorted(choice[g * size : (g + 1) * size].tolist())[-2:] for g in range(moe.n_group)]
            kept = sorted(range(moe.n_group), key=lambda g: -sum(group_scores[g]))[: moe.topk_group]
            choice = torch.tensor([c if e // size in kept else 0.0 for e, c in enumerate(choice.tolist())])
        chosen = sorted(range(moe.n_experts), key=lambda e: -float(choice[e]))[: moe.top_k]
        kept_scores = scores[chosen]
        if moe.norm_topk_prob:
            kept_scores = kept_scores / (kept_scores.sum() + 1e-20)
        if moe.routed_scaling_factor is not None:
            kept_scores = kept_scores * moe.routed_scaling_factor
        weights[t, chosen] = kept_scores
    return weights


def _expert(spec: FamilySpec, experts: nn.Module, e: int, x: torch.Tensor, act: Callable) -> torch.Tensor:
    moe = spec.moe
    assert moe is not None
    if moe.layout == "per_expert":
        return experts[e](x)
    gate_up, down = experts.gate_up_proj[e], experts.down_proj[e]
    if moe.layout == "fused_out_in":
        gate_up, down = gate_up.T, down.T  # stored (out, in)
    product = x @ gate_up
    if moe.gate_up_order.startswith("concatenated"):
        first, second = product[..., : moe.moe_intermediate_size], product[..., moe.moe_intermediate_size :]
    else:
        first, second = product[..., 0::2], product[..., 1::2]
    gate, up = (second, first) if moe.gate_up_order.endswith("up_first") else (first, second)
    return (act(gate) * up) @ down


def check_moe(model: PreTrainedModel, spec: FamilySpec, naming: NamingScheme) -> None:
    moe = spec.moe
    assert moe is not None
    from tests.fuzz.blocks import ffn_attr

    stack = model.get_submodule(naming.stack_path)
    layers = getattr(stack, naming.layers)
    for index in spec.moe_layers:
        block = getattr(layers[index], ffn_attr(spec, naming))  # type: ignore[arg-type]
        correction = getattr(block.gate, "e_score_correction_bias", None)
        logits = torch.randn(32, moe.n_experts, generator=torch.Generator().manual_seed(13)) * 2.0
        idx, weights = block.route(logits)
        dense = torch.zeros(32, moe.n_experts, dtype=torch.float64).scatter(1, idx, weights.double())
        _close(f"routing of layer {index}", dense, reference_routing(spec, logits, correction))

        x = torch.randn(1, 10, spec.hidden_size, generator=torch.Generator().manual_seed(14))
        with torch.no_grad():
            got = block(x)
            flat = x.view(-1, spec.hidden_size)
            route = reference_routing(spec, block.gate(flat).float(), correction)
            act = block.experts.act_fn if moe.layout != "per_expert" else block.experts[0].act_fn
            want = torch.zeros_like(flat)
            for e in range(moe.n_experts):
                rows = route[:, e] != 0
                if rows.any():
                    want[rows] += route[rows, e, None].float() * _expert(spec, block.experts, e, flat[rows], act)
            if moe.n_shared_experts and moe.shared_style == "deepseek":
                want = want + block.shared_experts(flat)
            elif moe.n_shared_experts:
                gate = torch.sigmoid(block.shared_expert_gate(flat)) if moe.shared_gate else 1.0
                want = want + gate * block.shared_expert(flat)
        _close(f"MoE block of layer {index}", got, want.view_as(got), rtol=1e-4)


# --------------------------------------------------------------------------------- all


def check_family(spec: FamilySpec, folder: str | Path) -> list[str]:
    """Run every check that applies to ``spec`` on the model in ``folder``; the names of
    those that ran. Raises :class:`FamilyCheckError` on the first that fails."""
    folder = Path(folder)
    naming = scheme_for(spec)
    model = load_folder(folder)
    checks: list[tuple[str, Callable[[], None]]] = [
        ("weights are the files", lambda: check_weights_are_the_files(model, folder)),
        ("forward and backward", lambda: check_forward_backward(model, spec)),
        ("causal", lambda: check_causal(model, spec)),
        ("tying", lambda: check_tying(model, spec, folder)),
        ("logits transform", lambda: check_logits_transform(model, spec)),
        ("embedding scale", lambda: check_embedding_scale(model, spec, naming)),
        ("norms", lambda: check_norms(model, spec)),
        ("block wiring", lambda: check_block(model, spec, naming)),
    ]
    if spec.rope is not None:
        checks.append(("rope", lambda: check_rope(model, spec, naming)))
    if spec.mla is None:
        checks.append(("attention", lambda: check_attention(model, spec, naming)))
    if spec.attention.window != "none" and spec.mla is None:
        checks.append(("window mask", lambda: check_window_mask(model, spec)))
        if spec.attention.window == "all":
            checks.append(("window reach", lambda: check_window_reach(model, spec)))
    if spec.attention.chunk != "none":
        checks.append(("chunk mask", lambda: check_chunk_mask(model, spec)))
    if spec.positions == "alibi":
        checks.append(
            (
                "alibi slopes",
                lambda: _close(
                    "ALiBi slopes",
                    _modeling_module(model).build_alibi_slopes(spec.attention.n_heads),
                    alibi_closed_form(spec.attention.n_heads),
                ),
            )
        )
    if spec.moe is not None:
        checks.append(("moe", lambda: check_moe(model, spec, naming)))
    for name, check in checks:
        try:
            check()
        except FamilyCheckError:
            raise
        except Exception as exc:  # a check that cannot even run is the generator's fault too
            raise FamilyCheckError(f"{name}: {type(exc).__name__}: {exc}") from exc
    return [name for name, _ in checks]
