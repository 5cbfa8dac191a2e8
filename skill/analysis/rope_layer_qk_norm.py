"""A QK norm held only by the layers that apply RoPE (Llama 4: ``use_qk_norm and use_rope``).

Llama 4 normalises queries and keys (a weightless L2 norm, after RoPE) on the layers that rotate
them and builds no norm on its NoPE layers. The layer stack shows it as a per-layer difference: the
attention of every NoPE layer lacks the norm module. Measured on the full-depth stack (tiny widths):
the layers whose attention lacks the QK norm are exactly the layers without RoPE, and the norm holds
no parameter (so no checkpoint key differs between layers either). Anything else stays a per-layer
difference, named and refused.
"""

from __future__ import annotations

from skill.analysis import modules as mt
from skill.analysis.detect import Context
from skill.features import AttentionFeatures, QKNormKind


def qk_norm_on_rope_layers(ctx: Context, attention: AttentionFeatures) -> set[str]:
    """The layer-relative paths of the weightless QK norm modules that exactly the NoPE layers
    lack (``self_attn.qk_norm``), or none."""
    name = ctx.anatomy.attention_name
    if attention.qk_norm is QKNormKind.NONE or not attention.nope_layers or name is None:
        return set()
    if attention.qk_norm_full_width or attention.mla is not None:
        return set()  # the edit guards the per-head norm of the dense references
    _, layers, _ = ctx.layer_stack()
    first = layers[0].get_submodule(name)
    norms = [
        child_name
        for child_name, child in first.named_children()
        if mt.is_norm(child) and not any(True for _ in child.parameters())
    ]
    if not norms:
        return set()
    lacking = {
        index for index, layer in enumerate(layers) if not any(hasattr(layer.get_submodule(name), n) for n in norms)
    }
    partial = {
        index
        for index, layer in enumerate(layers)
        if index not in lacking and not all(hasattr(layer.get_submodule(name), n) for n in norms)
    }
    if partial or lacking != set(attention.nope_layers):
        return set()
    ctx.evidence.append(
        f"QK norm ({', '.join(norms)}) only on the layers that apply RoPE: the {len(lacking)} NoPE layers lack it "
        "(full-depth stack)"
    )
    return {f"{name}.{norm}" for norm in norms}
