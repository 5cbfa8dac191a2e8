"""Reading a tiny instance's module tree: which module is what, by shape and kind.

transformers names the same parts differently across families (``self_attn`` /
``attn`` / ``self_attention``, ``q_proj`` / ``query`` / ``c_attn``). The anatomy here is
found by structure: the decoder stack is the module list with one entry per layer, a
norm is a module whose class is a norm, a projection is a module with a 2D weight, and
its role comes from its shape against the config's head counts and widths, with the
name as a tie-breaker.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# Token mixers that are not softmax attention: a layer holding one makes the model a
# hybrid, state-space or recurrent model.
_NON_ATTENTION_MIXER = re.compile(
    r"(Mamba|SSM(?![a-z])|Mixer|ShortConv|Recurrent|Rwkv|RWKV|LSTM|DeltaNet|LinearAttention|Lightning|RGLRU|Hyena|Retention)"
)
_ATTENTION = re.compile(r"(Attention|Attn)")
_NORM = re.compile(r"Norm", re.IGNORECASE)
_FFN = re.compile(r"(MLP|MoE|Moe|FeedForward|FFN|Expert|Sparse|Dense)")


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or bool(_NORM.search(type(module).__name__))


def weight_2d(module: nn.Module) -> torch.Tensor | None:
    """The 2D weight of a projection-like module (Linear, transformers' Conv1D, ...)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not isinstance(module, nn.Embedding):
        return weight
    return None


@dataclass
class Projection:
    """A projection by its (in, out) widths, whatever its storage orientation."""

    name: str
    module: nn.Module
    in_features: int
    out_features: int
    bias: bool
    orientation: str  # "out_in" (nn.Linear) or "in_out" (transformers Conv1D)


def projection(name: str, module: nn.Module) -> Projection | None:
    weight = weight_2d(module)
    if weight is None:
        return None
    bias = getattr(module, "bias", None)
    has_bias = isinstance(bias, torch.Tensor)
    if isinstance(module, nn.Linear):
        return Projection(name, module, module.in_features, module.out_features, has_bias, "out_in")
    if stores_in_out(module, weight):  # transformers Conv1D: y = x @ W + b, W of (in, out)
        return Projection(name, module, weight.shape[0], weight.shape[1], has_bias, "in_out")
    return Projection(name, module, weight.shape[1], weight.shape[0], has_bias, "out_in")


def stores_in_out(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether a projection that is no ``nn.Linear`` computes ``x @ W`` (``W`` stored
    ``(in, out)``, transformers' ``Conv1D``) rather than ``x @ W.T``: probed on one input,
    so a square weight is told apart too."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, weight.shape[0], generator=generator, dtype=weight.dtype)
    bias = getattr(module, "bias", None)
    try:
        with torch.no_grad():
            out = module(x)
    except (RuntimeError, TypeError, ValueError):
        return False
    expected = x @ weight.detach()
    if isinstance(bias, torch.Tensor):
        expected = expected + bias.detach()
    return isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)


def projections(module: nn.Module, recurse: bool = True) -> list[Projection]:
    found = []
    items = module.named_modules() if recurse else module.named_children()
    for name, child in items:
        if not name:
            continue
        proj = projection(name, child)
        if proj is not None and not is_norm(child):
            found.append(proj)
    return found


@dataclass
class LayerAnatomy:
    """The parts of one decoder layer and of the model around it."""

    layers_path: str
    layers: nn.ModuleList
    attention_name: str | None
    attention: nn.Module | None
    ffn_name: str | None
    ffn: nn.Module | None
    norms: dict[str, nn.Module] = field(default_factory=dict)
    embedding: nn.Module | None = None
    lm_head: nn.Module | None = None
    final_norm: nn.Module | None = None
    other_children: list[str] = field(default_factory=list)


def find_layers(model: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    """The module list of decoder layers: the first list with one entry per layer."""
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) == n_layers > 0
            and any(list(child.children()) for child in module)
        ):
            return name, module
    # Some configs count sub-layers (two attentions per block): take the first list of
    # blocks that hold an attention module.
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and any(map(is_attention, module[0].modules())):
            return name, module
    raise LookupError(f"no module list of {n_layers} decoder layers in {type(model).__name__}")


def non_attention_mixers(layers: nn.ModuleList) -> list[str]:
    """Class names of token mixers that are not attention (Mamba, linear attention, ...)."""
    found: list[str] = []
    for layer in layers:
        for _, module in layer.named_modules():
            name = type(module).__name__
            # A depthwise nn.Conv1d over the sequence is a convolutional token mixer;
            # transformers' Conv1D (a transposed Linear) is not.
            if (_NON_ATTENTION_MIXER.search(name) or isinstance(module, nn.Conv1d)) and name not in found:
                found.append(name)
    return found


def is_attention(module: nn.Module) -> bool:
    return bool(_ATTENTION.search(type(module).__name__)) and not is_norm(module)


def unwrapped_attention(name: str, module: nn.Module) -> tuple[str, nn.Module]:
    """The attention a layer's attention child computes with, and its dotted path in the layer.

    A child that holds no tensor of its own and only one module with parameters, itself an
    attention and no projection, is a wrapper (GPT-Neo's ``attn`` picks the local or global
    class and calls it as ``attn.attention``): the projections are the inner module's.
    """
    while not any(True for _ in module.parameters(recurse=False)):
        holders = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(holders) != 1:
            break
        inner_name, inner = holders[0]
        if not is_attention(inner) or weight_2d(inner) is not None:
            break
        name, module = f"{name}.{inner_name}", inner
    return name, module


def anatomy(model: PreTrainedModel, n_layers: int) -> LayerAnatomy:
    """Name the parts of layer 0 and the model's embedding, final norm and head."""
    path, layers = find_layers(model, n_layers)
    layer = layers[0]
    attention_name = attention = ffn_name = ffn = None
    norms: dict[str, nn.Module] = {}
    others: list[str] = []
    for name, child in layer.named_children():
        if is_norm(child):
            norms[name] = child
        elif attention is None and is_attention(child):
            attention_name, attention = unwrapped_attention(name, child)
        elif ffn is None and (_FFN.search(type(child).__name__) or name in ("mlp", "feed_forward", "ffn")):
            ffn_name, ffn = name, child
        elif list(child.parameters()):
            others.append(name)
    embedding = model.get_input_embeddings()
    lm_head = model.get_output_embeddings()
    final_norm = None
    layers_parent_path = path.rsplit(".", 1)[0] if "." in path else ""
    parent = model.get_submodule(layers_parent_path) if layers_parent_path else model
    for child in parent.children():
        if is_norm(child):
            final_norm = child  # the last norm beside the stack (the probes check it runs after it)
    return LayerAnatomy(
        path, layers, attention_name, attention, ffn_name, ffn, norms, embedding, lm_head, final_norm, others
    )


def norm_width(norm: nn.Module) -> int | None:
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.numel())
    shape = getattr(norm, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and shape:
        return int(shape[-1])
    dim = getattr(norm, "dim", None) or getattr(norm, "hidden_size", None)
    return int(dim) if isinstance(dim, int) else None


def _is_latent_norm_name(name: str) -> bool:
    return "_a_" in name or name.startswith(("kv_a", "q_a"))


def latent_norms(attention: nn.Module) -> list[tuple[str, nn.Module]]:
    """MLA's low-rank latent norms of an attention module (``q_a_layernorm``, ``kv_a_layernorm``)."""
    children = attention.named_children()
    return [(name, child) for name, child in children if is_norm(child) and _is_latent_norm_name(name)]


def qk_norms(attention: nn.Module) -> tuple[tuple[str, nn.Module] | None, tuple[str, nn.Module] | None]:
    """The query and key norms of an attention module (not MLA's low-rank latent norms)."""
    q = k = None
    for name, child in attention.named_children():
        if not is_norm(child) or _is_latent_norm_name(name):
            continue
        lowered = name.lower()
        if q is None and (lowered.startswith("q") or "query" in lowered):
            q = (name, child)
        elif k is None and (lowered.startswith("k") or "key" in lowered):
            k = (name, child)
    return q, k


def experts_module(ffn: nn.Module) -> tuple[str, nn.Module] | None:
    """The routed-experts container of an MoE block (not its shared experts)."""
    for name, child in ffn.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if "expert" in last and "shared" not in last and "gate" not in last:
            return name, child
    return None


def router_module(ffn: nn.Module, num_experts: int) -> tuple[str, nn.Module] | None:
    """The router: a module of the MoE block whose 2D weight has one row per expert."""
    for name, child in ffn.named_modules():
        if not name or "shared" in name:
            continue
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and num_experts in (weight.shape[0],):
            if "expert" in name.split(".")[0] and "gate" not in name and "router" not in name:
                continue
            return name, child
    return None


def layer_has_experts(layer: nn.Module) -> bool:
    return any(
        "expert" in name.rsplit(".", 1)[-1].lower() and "shared" not in name.lower()
        for name, _ in layer.named_modules()
    )
