"""What a family is, measured: config fields, checkpoint keys and behavioural probes.

Features are read from what the family *does*, never from its name: the checkpoint's
keys say which projections have biases and which norms exist; a probe on a tiny HF
instance says whether the norm scales by ``w`` or ``1 + w`` and whether the embedding
output is scaled before the first layer. The porting steps choose their edits from this
profile, so a new family with the same features ports by the same edits.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

from skill.analysis.detect import rotary_interleaved
from skill.analysis.source_scan import scan_model_source
from skill.porting.edit_adapter_map import detect_fused_keys
from skill.porting.hf_source import checkpoint_keys, generalised_keys, load_config
from skill.tiny_model import build_tiny_model, tiny_config

logger = logging.getLogger(__name__)

LAYER = "model.layers.{}."
# Activations the edits can write, by the names transformers' ACT2FN uses.
ACTIVATIONS = {"silu": "F.silu", "gelu_pytorch_tanh": 'functools.partial(F.gelu, approximate="tanh")', "gelu": "F.gelu"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class FamilyProfile(BaseModel):
    """The features of one family that decide the code of its Archon port."""

    model_type: str
    config_class: str
    hf_keys: list[str] = Field(description="checkpoint keys, layer and expert indices as {}")
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: Literal["none", "per_head", "full"] = "none"
    norm: Literal["rms", "rms_offset", "layernorm"] = "rms"
    block: Literal["pre_norm", "sandwich", "post_norm"] = "pre_norm"
    mlp: Literal["gated", "plain"] = "gated"
    activation: str = "silu"
    activation_field: str | None = None
    norm_eps_field: str = "rms_norm_eps"
    sliding_window: bool = False
    sliding_layer_types: bool = False
    attn_softcap: bool = False
    final_softcap: bool = False
    query_pre_attn_scalar: bool = False
    embedding_scale: Literal["none", "sqrt_dim", "multiplier"] = "none"
    multipliers: list[str] = Field(default_factory=list, description="scalar multiplier config fields")
    rope_type: str = "default"
    partial_rotary: bool = False
    rotary_interleaved: bool = Field(
        default=False, description="RoPE rotates adjacent feature pairs (x0, x1), (x2, x3), ... instead of the halves"
    )
    moe: bool = False
    shared_expert: bool = False
    router_renormalizes: bool = Field(
        default=False, description="the router rescales its top-k weights to sum to 1 (probed on a tiny instance)"
    )
    router_norm_field: bool = Field(default=False, description="the config says so itself (norm_topk_prob)")
    tied: bool = False
    unsupported: list[str] = Field(default_factory=list, description="features no edit supports, named")


def _probe_norm(norm: torch.nn.Module, width: int) -> Literal["rms", "rms_offset", "layernorm"]:
    """Classify a norm by what it computes: zero weight gives zeros unless it scales by
    ``1 + w``; unit weight gives zero-mean rows only for LayerNorm."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)) * 3 + 1
    saved = {name: p.detach().clone() for name, p in norm.named_parameters()}
    try:
        with torch.no_grad():
            for p in norm.parameters():
                p.zero_()
            zero_out = norm(x)
            if not torch.allclose(zero_out, torch.zeros_like(zero_out), atol=1e-6):
                return "rms_offset"
            norm.weight.fill_(1.0)
            unit_out = norm(x)
    finally:
        with torch.no_grad():
            for name, p in norm.named_parameters():
                p.copy_(saved[name])
    return "layernorm" if float(unit_out.mean(-1).abs().max()) < 1e-4 else "rms"


MOE_MODULES = ("mlp", "block_sparse_moe")


def _probe_router_renormalizes(model: torch.nn.Module) -> bool | None:
    """Whether layer 0's router returns top-k weights that sum to 1 per token.

    The router is the ``gate`` module with one row per expert; its second output is the
    routing weights (transformers 5 routers return logits, weights, indices).
    """
    # Found by shape, not by name: transformers 5 may name a module differently in memory
    # (``mlp``) than on disk (``block_sparse_moe``).
    layer = model.model.layers[0]
    router = next(
        (
            module
            for name, module in layer.named_modules()
            if name.split(".")[-1] == "gate"
            and "shared" not in name
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.ndim == 2
            and module.weight.shape[0] > 1
        ),
        None,
    )
    if router is None:
        return None
    width = router.weight.shape[1]
    hidden = torch.randn(7, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = router(hidden)
    if not isinstance(out, tuple) or len(out) < 2 or not isinstance(out[1], torch.Tensor):
        return None
    weights = out[1].float()
    if weights.shape[-1] >= router.weight.shape[0]:
        return None  # dense scores over every expert: not a top-k output
    return bool(torch.allclose(weights.sum(-1), torch.ones(weights.shape[0]), atol=1e-5))


def _probe_embedding_scale(model: torch.nn.Module, config: Any) -> float:
    """Ratio of the first layer's input to the embedding rows (1.0 when unscaled).

    Compared with the raw rows, not the embedding module's output, because some
    families scale inside their embedding module.
    """
    inner = model.model
    tokens = torch.arange(5).unsqueeze(0) % config.vocab_size
    captured: dict[str, torch.Tensor] = {}

    def on_layer(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        captured["layer"] = args[0] if args else kwargs["hidden_states"]

    handle = inner.layers[0].register_forward_pre_hook(on_layer, with_kwargs=True)
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        handle.remove()
    rows = inner.embed_tokens.weight[tokens].detach()
    mask = rows.abs() > 1e-6
    return float((captured["layer"][mask] / rows[mask]).mean())


@functools.lru_cache(maxsize=16)
def detect_family(source: str) -> FamilyProfile:
    """Measure ``source``'s features (a model_type or a config path)."""
    config = load_config(source)
    keys = generalised_keys(checkpoint_keys(source))
    keyset = set(keys)
    tiny = tiny_config(config)
    model = build_tiny_model(tiny)
    unsupported: list[str] = []

    def has(suffix: str) -> bool:
        return LAYER + suffix in keyset

    qk_norm: Literal["none", "per_head", "full"] = "none"
    if has("self_attn.q_norm.weight"):
        q_norm = model.model.layers[0].self_attn.q_norm
        width = q_norm.weight.shape[0]
        q_width = model.model.layers[0].self_attn.q_proj.weight.shape[0]
        qk_norm = "per_head" if width < q_width else "full"
    norm_kind = _probe_norm(model.model.norm, tiny.hidden_size)
    if has("pre_feedforward_layernorm.weight"):
        block: Literal["pre_norm", "sandwich", "post_norm"] = "sandwich"
    elif not has("input_layernorm.weight"):
        block = "post_norm"
    else:
        block = "pre_norm"
    activation_field = next((f for f in ("hidden_activation", "hidden_act") if getattr(config, f, None)), None)
    activation = getattr(config, activation_field) if activation_field else "silu"
    if activation not in ACTIVATIONS:
        unsupported.append(f"activation {activation!r}")
    eps_field = next((f for f in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps") if hasattr(config, f)), None)
    if eps_field is None:
        unsupported.append("norm epsilon field (none of rms_norm_eps, layer_norm_eps, norm_epsilon)")
    layer_types = getattr(config, "layer_types", None) or []
    sliding_window = bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
    sliding_layer_types = sliding_window and "sliding_attention" in layer_types and "full_attention" in layer_types
    if sliding_window and layer_types and "sliding_attention" not in layer_types:
        sliding_window = False
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type not in ROPE_TYPES:
        unsupported.append(f"rope_type {rope_type!r}")
    partial = float(rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0)
    partial = float(getattr(config, "partial_rotary_factor", partial) or partial)
    if partial != 1.0 and rope_type != "default":
        unsupported.append(f"partial rotary (factor {partial}) together with {rope_type} scaling")
    # The analyser's own test (config flag, or the rotary helpers' code: ::2, repeat_interleave).
    interleaved = rotary_interleaved(config, scan_model_source(model))
    if interleaved and (partial != 1.0 or rope_type != "default"):
        other = "partial rotary" if partial != 1.0 else f"{rope_type} scaling"
        unsupported.append(f"interleaved rotary pairing together with {other}")
    multipliers = [
        f for f in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
        if getattr(config, f, None) is not None
    ]
    scale = _probe_embedding_scale(model, tiny)
    if "embedding_multiplier" in multipliers:
        embedding_scale: Literal["none", "sqrt_dim", "multiplier"] = "multiplier"
    elif math.isclose(scale, 1.0, rel_tol=1e-4):
        embedding_scale = "none"
    elif math.isclose(scale, math.sqrt(tiny.hidden_size), rel_tol=1e-3):
        embedding_scale = "sqrt_dim"
    else:
        embedding_scale = "none"
        unsupported.append(f"embedding scaled by {scale:.4g} (neither 1 nor sqrt(hidden_size))")
    moe = any(".experts.{}." in k for k in keys)
    if moe:
        if not any(k.startswith(LAYER + prefix + ".experts.{}.") for k in keys for prefix in MOE_MODULES):
            unsupported.append(f"MoE experts stored under another module than {' or '.join(MOE_MODULES)}")
        else:
            renormalizes = _probe_router_renormalizes(model)
            if renormalizes is None:
                unsupported.append("MoE router whose output the engine cannot read (expected scores per token)")
            elif hasattr(config, "norm_topk_prob") and bool(config.norm_topk_prob) != renormalizes:
                unsupported.append("MoE router that renormalises differently from its norm_topk_prob field")
    # Fused q/k/v and gate/up tensors are split by the adapter (found by shape); a key
    # that only looks fused by name but has no such shape stays unsupported.
    fused = detect_fused_keys(checkpoint_keys(source), tiny)
    odd = [k for k in keys if k.endswith(("qkv_proj.weight", "gate_up_proj.weight")) and k not in fused]
    if odd:
        unsupported.append(f"fused projections on disk whose shape is no q/k/v or gate/up stack {odd}")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        unsupported.append(f"pretraining_tp={config.pretraining_tp}")
    return FamilyProfile(
        model_type=config.model_type,
        config_class=type(config).__name__,
        hf_keys=keys,
        qkv_bias=has("self_attn.q_proj.bias"),
        o_bias=has("self_attn.o_proj.bias"),
        mlp_bias=has("mlp.down_proj.bias") or has("mlp.c_proj.bias"),
        qk_norm=qk_norm,
        norm=norm_kind,
        block=block,
        mlp="plain" if has("mlp.c_fc.weight") else "gated",
        activation=activation,
        activation_field=activation_field,
        norm_eps_field=eps_field or "rms_norm_eps",
        sliding_window=sliding_window,
        sliding_layer_types=sliding_layer_types,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) is not None,
        final_softcap=getattr(config, "final_logit_softcapping", None) is not None,
        query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None) is not None,
        embedding_scale=embedding_scale,
        multipliers=multipliers,
        rope_type=rope_type,
        partial_rotary=partial != 1.0,
        rotary_interleaved=interleaved,
        moe=moe,
        shared_expert=LAYER + "mlp.shared_expert_gate.weight" in keyset,
        router_renormalizes=bool(moe and _probe_router_renormalizes(model)),
        router_norm_field=hasattr(config, "norm_topk_prob"),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        unsupported=unsupported,
    )
