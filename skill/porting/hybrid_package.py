"""A hybrid family's package, from a copy of the qwen3_5 reference.

The analysis takes a hybrid only where the qwen3_5 reference computes it: its Gated DeltaNet
by the outputs of the family's own mixer (:mod:`skill.analysis.linear_attention`), everything
else on the family's attention-only twin, against the reference's values. So the copy's
modules, RoPE and parallel layout are the family's, and what a family of another model type
may still need is written here:

- args (:func:`hybrid_args`): the family's rule for which layers are MoE (Qwen3-Next's
  ``decoder_sparse_step`` and ``mlp_only_layers``), and its router's renormalisation read from
  the config where HF reads it (``norm_topk_prob``) instead of Qwen3.5's fixed one;
- adapter (:func:`text_adapter`, :func:`apply_mixer_row_blocks`): the text model's
  conversion alone (released Qwen3.5 checkpoints' multimodal namespace is the reference's
  own), and checkpoint weights that stack several of the reference's projections split and
  re-stacked by the measured layout (Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, per key
  head).

What else could differ is refused by the analysis, by name (``hybrid_limits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from skill.codemod.cst import (
    insert_class_statement_after,
    prune_unused_imports,
    remove_class,
    remove_from_all,
    remove_function,
    rename_identifiers,
    replace_function,
    replace_in_function,
    set_call_kwarg,
    set_class_fields,
    set_docstring,
    upsert_method,
)
from skill.codemod.document import Document
from skill.features import DELTANET_PROJECTIONS, LinearAttentionLayers
from skill.porting.common import PackageLayout
from skill.snippets import snippet_method
from skill.snippets.moe_layers import RULES as MOE_LAYER_RULES

if TYPE_CHECKING:
    from skill.porting.edit_args import ArgField
    from skill.porting.plan import PortPlan

# The reference a hybrid's package is copied from.
HYBRID_REFERENCE = "qwen3_5"
# The reference's statement fixing its router's renormalisation (Qwen3.5-MoE ignores norm_topk_prob).
_FIXED_ROUTE_NORM = "moe_args.route_norm = True"
# Every part of the reference's projections, in the order the projections stack them.
_PART_ORDER = "".join(part for parts in DELTANET_PROJECTIONS.values() for part in parts)


def hybrid_edit_names(plan: PortPlan, layers: LinearAttentionLayers) -> list[str]:
    """What this module writes on the copy for the family (the package header names them):
    ``stacked_mixer_weights``, ``moe_layer_rule``, ``router_norm_from_config``."""
    names = ["stacked_mixer_weights"] if layers.fused else []
    if plan.moe and plan.moe_layer_rule != "all":
        names.append("moe_layer_rule")
    if plan.moe and not plan.route_norm:
        names.append("router_norm_from_config")
    return names


def hybrid_args(doc: Document, args_class: str, plan: PortPlan, rule_fields: Sequence[ArgField]) -> Document:
    """The copied args with the family's MoE layer rule and renormalisation.

    ``rule_fields``: the args fields the rule reads (``edit_args.moe_layer_fields``)."""
    if "moe_layer_rule" in plan.hybrid_edits:
        spec = {f.name: f"{f.annotation} = {f.default_source or repr(f.default)}" for f in rule_fields}
        doc = set_class_fields(doc, args_class, spec)
        for f in rule_fields:
            doc = set_call_kwarg(doc, "cls", f.name, f.expression)
        rule = snippet_method("moe_layers", MOE_LAYER_RULES[plan.moe_layer_rule], "is_moe_layer")
        doc = replace_function(doc, args_class, "is_moe_layer", rule)
    if "router_norm_from_config" in plan.hybrid_edits:
        # HF renormalises as the config says; AReaL's MoEArgs.from_hf_config reads norm_topk_prob.
        doc = replace_in_function(doc, args_class, "from_hf_config", _FIXED_ROUTE_NORM, "")
    return doc


def text_adapter(doc: Document, layout: PackageLayout, config_class: str) -> Document:
    """The copied adapter's text-model conversion as the family's adapter class: the subclass for
    released Qwen3.5 checkpoints (their multimodal namespace, their vision and MTP keys) goes."""
    adapter, text = layout.adapter_class, layout.adapter_class.removesuffix("StateDictAdapter") + "TextStateDictAdapter"
    doc = remove_class(doc, adapter)
    doc = remove_function(doc, "_checkpoint_keys")
    doc = remove_from_all(doc, [adapter])
    doc = rename_identifiers(doc, [(text, adapter)])
    doc = set_docstring(
        doc,
        None,
        f"{layout.names.camel} state dicts: Archon names <-> HuggingFace checkpoint names.\n\n"
        "Every key renamed, the MoE experts stacked from and split into one 2D tensor per expert\n"
        "(AReaL's ``MoEWeightConverter``), an unknown key refused by name, completeness checked\n"
        "against the model these args build. A layer holds either the gated attention of the\n"
        "full-attention layers or the Gated DeltaNet of the linear-attention layers, so each\n"
        "layer's keys are checked against the model, not the map.",
    )
    doc = set_docstring(
        doc,
        adapter,
        f"Renames {layout.names.camel} weights between Archon and HF checkpoints and stacks/splits MoE experts.\n\n"
        f"``model_config`` is a transformers ``{config_class}`` or a :class:`{layout.args_class}`. Every HF key\n"
        "must be in ``from_hf_map`` (``None`` drops it); anything else raises ``KeyError`` naming the key, so a\n"
        "checkpoint never loads with weights silently lost. Map entries with two ``{}`` (layer, expert) are\n"
        "the per-expert keys.",
    )
    return prune_unused_imports(doc)


def stacked_mixer_map(layers: LinearAttentionLayers, layer_template: str) -> dict[str, list[str]]:
    """Checkpoint key template of each stacked mixer weight -> the Archon projections it holds,
    in the order they stack once unstacked (``layer_template``: ``"model.layers.{}."``)."""
    stacked: dict[str, list[str]] = {}
    for weight in layers.fused:
        key = f"{layer_template}{layers.mixer_name}.{weight.hf_name}"
        stacked[key] = [f"layers.{{}}.linear_attn.{projection}.weight" for projection in weight.projections]
    return stacked


def _row_blocks_literal(layers: LinearAttentionLayers, layer_template: str) -> str:
    lines = ["mixer_row_blocks: ClassVar[dict[str, tuple[str, ...]]] = {"]
    for weight in sorted(layers.fused, key=lambda w: w.hf_name):
        parts = ", ".join(f'"{part}"' for part in weight.parts)
        lines.append(f'    "{layer_template}{layers.mixer_name}.{weight.hf_name}": ({parts}),')
    lines.append("}")
    return "\n".join(lines) + "\n"


_MIXER_BLOCKS = '''
def _mixer_blocks(self, template: str) -> tuple[int, list[int], list[int]]:
    """How the checkpoint stacks a mixer weight: its groups{grouping}, each part's rows in a
    group, and the parts' order once whole (q, k, v, z, b, a: as the projections stack them)."""
    args = self.model_args
    parts = self.mixer_row_blocks[template]
    groups = {groups}
    value_heads = args.linear_num_value_heads // groups
    key_rows = args.linear_num_key_heads // groups * args.linear_key_head_dim
    value_rows = value_heads * args.linear_value_head_dim
    rows = {{"q": key_rows, "k": key_rows, "v": value_rows, "z": value_rows, "b": value_heads, "a": value_heads}}
    order = sorted(range(len(parts)), key=lambda i: "{part_order}".index(parts[i]))
    return groups, [rows[part] for part in parts], order
'''

_UNSTACK = """
if template in self.mixer_row_blocks:
    # The checkpoint stacks the Gated DeltaNet's row blocks otherwise than Archon's projections.
    value = _unstack_rows(value, *self._mixer_blocks(template))
"""

_RESTACK = """
if template in self.mixer_row_blocks:
    return _stack_rows(stacked, *self._mixer_blocks(template))
"""


# apply_fused_adapter's ``regroup`` for stacked mixer weights: unstack before the split, restack after the concat.
STACKED_MIXER_REGROUP = (_UNSTACK, _RESTACK, ("_unstack_rows", "_stack_rows"))


def apply_mixer_row_blocks(
    doc: Document, layout: PackageLayout, layers: LinearAttentionLayers, layer_template: str
) -> Document:
    """After ``apply_fused_adapter`` took :func:`stacked_mixer_map` with
    :data:`STACKED_MIXER_REGROUP`: the measured layout, as a literal, and the method reading it."""
    grouped = {weight.grouped for weight in layers.fused}
    if len(grouped) != 1:
        raise ValueError("stacked mixer weights grouped by key head beside whole ones: no adapter edit writes both")
    by_key_head = grouped.pop()
    comment = (
        "# The mixer weights the checkpoint stacks, and the row blocks each holds in turn"
        + (" within\n# each key head's group" if by_key_head else "\n#")
        + " (measured against HF's forward).\n"
    )
    doc = insert_class_statement_after(
        doc, layout.adapter_class, "fused_from_hf_map", comment + _row_blocks_literal(layers, layer_template)
    )
    blocks = _MIXER_BLOCKS.format(
        grouping=" (the key heads)" if by_key_head else " (one)",
        groups="args.linear_num_key_heads" if by_key_head else "1",
        part_order=_PART_ORDER,
    )
    return upsert_method(doc, layout.adapter_class, "_mixer_blocks", blocks.strip() + "\n", after="_archon_rows")
