"""A dense family on the deepseek_v3 (MLA) reference: its MoE removed from args and adapter.

The model's block is the ``dense_layers`` edit of :mod:`skill.porting.model_edits`; the
args and the state-dict adapter of the copied reference also carry MoE machinery
(``MoEArgs``, the leading-dense rule, expert stacking) that a family without experts must
not keep (a ported package has no flags for features its family lacks). Each rewrite
names the reference text it replaces and fails when the copy does not hold it exactly
once, so a changed reference is caught here, not in a generated package. Applied twice,
nothing changes.
"""

from __future__ import annotations

from skill.codemod.cst import (
    CodemodError,
    Document,
    class_field_names,
    prune_unused_imports,
    remove_function,
    remove_method,
    remove_statements,
    replace_in_function,
    replace_text,
    set_class_fields,
)
from skill.porting.mla_router import BALANCING_KWARGS_DOC, REFERENCE_CALL

# (reference text, dense text): plain replacements in the copied args module.
_ARGS_TEXT = (
    (
        (
            "    MoE: layer ``i`` is sparse iff ``moe_args`` is set and ``i >= first_k_dense_replace``;\n"
            "    its routed and shared experts are ``moe_inter_dim`` wide, the leading dense layers'\n"
            "    MLPs ``hidden_dim``. The"
        ),
        "    Every layer's MLP is a dense SwiGLU ``hidden_dim`` wide; there are no experts.\n    The",
    ),
    (
        "    moe_inter_dim: int = 2048\n    moe_args: MoEArgs | None = None\n    first_k_dense_replace: int = 3\n",
        "",
    ),
)
_ARGS_CLASS_FIELDS = ("moe_inter_dim", "moe_args", "first_k_dense_replace")


def _replace_once(text: Document, old: str, new: str, where: str) -> Document:
    if old not in text:
        if new and new in text:
            return text  # applied
        if not new:
            return text
        raise CodemodError(f"the copied {where} does not hold the reference's text {old.strip()[:60]!r}.")
    if text.code.count(old) != 1:
        raise CodemodError(f"the copied {where} holds {old.strip()[:60]!r} more than once.")
    return replace_text(text, old, new)


def dense_args(text: Document, args_class: str) -> Document:
    """The deepseek_v3 args without MoE: no MoEArgs, expert widths, layer rule or helpers."""
    for old, new in _ARGS_TEXT:
        text = _replace_once(text, old, new, "args")
    for name in _ARGS_CLASS_FIELDS:
        text = remove_statements_in_class(text, args_class, name)
    if "def moe_enabled" in text:
        text = remove_method(text, args_class, "moe_enabled")
    if "def is_moe_layer" in text:
        text = remove_method(text, args_class, "is_moe_layer")
    if "def _moe_args" in text:
        text = remove_function(text, "_moe_args")
    text = remove_statements(
        text,
        lambda code: any(line.startswith("_REQUIRED_MOE_HF_FIELDS") for line in code.splitlines()),
    )
    for statement in ('has_experts = bool(getattr(hf_config, "n_routed_experts", None))',):
        text = replace_in_function(text, args_class, "from_hf_config", statement, "")
    text = replace_in_function(
        text,
        args_class,
        "from_hf_config",
        "required = _REQUIRED_HF_FIELDS + (_REQUIRED_MOE_HF_FIELDS if has_experts else ())",
        "required = _REQUIRED_HF_FIELDS",
    )
    for keyword in (
        'moe_inter_dim=getattr(hf_config, "moe_intermediate_size", None) or cls.moe_inter_dim,',
        f"moe_args={REFERENCE_CALL},",
        'first_k_dense_replace=getattr(hf_config, "first_k_dense_replace", None) or 0,',
    ):
        text = _replace_once(text, f"            {keyword}\n", "", "args")
    text = _replace_once(
        text,
        BALANCING_KWARGS_DOC,
        "(outputs of a critic's ``score`` head, default 1). Any other keyword (such as\n"
        "        ``router_dtype``: there is no router) is ignored, as\n"
        "        AReaL's own ``from_hf_config`` ignores it. ``eos_token_id`` of ``None`` keeps the\n"
        "        default; a list takes its first id.",
        "args",
    )
    return prune_unused_imports(text)


def remove_statements_in_class(text: Document, class_name: str, field: str) -> Document:
    """Drop the annotated field ``field`` of ``class_name`` (a no-op when absent)."""
    if field not in class_field_names(text, class_name):
        return text
    return set_class_fields(text, class_name, {}, remove=[field])


# The deepseek_v3 adapter's MoE pieces and what a dense family keeps of them.
_ADAPTER_TEXT = (
    (
        (
            "-> ``kv_norm``, ...); the router's ``e_score_correction_bias`` is the MoE's\n"
            "``expert_bias`` buffer. Published checkpoints also hold"
        ),
        "-> ``kv_norm``, ...). Published checkpoints may also hold",
    ),
    (
        (
            "``n_layers``. Checkpoints store one 2D tensor per expert and projection\n"
            "(``model.layers.{L}.mlp.experts.{E}.gate_proj.weight``); Archon stacks a layer's\n"
            "experts into 3D ``layers.{L}.moe.experts.w1``/``w2``/``w3``. The split/stack uses only\n"
            "AReaL's ``MoEWeightConverter`` API (``*_offline`` for plain tensors, ``*_dtensor`` for\n"
            "expert-sharded DTensors), so this package drops into AReaL unchanged.\n"
        ),
        "``n_layers``. Every layer's MLP is dense: there are no experts to stack or split.\n",
    ),
    (
        (
            "    it); anything else raises ``KeyError`` naming the key, so a checkpoint never loads\n"
            "    with weights silently lost. Map entries with two ``{}`` (layer, expert) are the\n"
            "    per-expert keys.\n"
        ),
        (
            "    it); anything else raises ``KeyError`` naming the key, so a checkpoint never loads\n"
            "    with weights silently lost.\n"
        ),
    ),
    (
        "Archon and HF checkpoints and stacks/splits MoE experts.",
        "Archon and HF checkpoints.",
    ),
    ('# ".12." inside a key: a layer (or expert) index.', '# ".12." inside a key: a layer index.'),
    (
        '        for index in indices:  # an expert template keeps its expert "{}" (it names all experts)\n',
        "        for index in indices:\n",
    ),
    (
        'f"(n_layers={self.model_args.n_layers}, moe={self.moe_enabled}): {unexpected}. "',
        'f"(n_layers={self.model_args.n_layers}): {unexpected}. "',
    ),
)
_ADAPTER_INIT_STATEMENTS = (
    "self.moe_enabled = self.model_args.moe_enabled",
    "self.num_experts = self.model_args.moe_args.num_experts if self.model_args.moe_args is not None else 0",
    (
        "self._expert_templates = {\n"
        '    archon: hf for hf, archon in self.from_hf_map.items() if archon is not None and hf.count("{}") == 2\n'
        "}"
    ),
    "self._moe_converter = MoEWeightConverter()",
    "self._moe_state = MoEConversionState()",
)
_FROM_HF_EXPERTS = (
    ("hf_template, indices = _abstract(hf_key)", ""),
    (
        'if hf_template.count("{}") != 2:\n    state_dict[archon_key] = value\n    continue',
        "state_dict[archon_key] = value",
    ),
    ("archon_template = self.from_hf_map[hf_template]", ""),
    ("experts_by_layer.setdefault(layer_id, {}).setdefault(archon_template, {})[expert_id] = value", ""),
    ("experts_by_layer: dict[str, dict[str, dict[int, Any]]] = {}", ""),
    ("state_dict.update(self._stack_experts(experts_by_layer))", ""),
)


# Nested inside from_hf's loop, with its layout (a statement with a multi-line call).
_EXPERT_ID_CHECK = (
    "            # A per-expert 2D weight: collect it for stacking.\n"
    "            layer_id, expert_id = indices[0], int(indices[1])\n"
    "            if not self.moe_enabled or expert_id >= self.num_experts:\n"
    "                raise KeyError(\n"
    '                    f"HF checkpoint key {hf_key!r} names expert {expert_id}, but the config has "\n'
    '                    f"{self.num_experts} experts per layer."\n'
    "                )\n"
)


def dense_adapter(text: Document, adapter_class: str) -> Document:
    """The deepseek_v3 adapter without expert stacking: every key maps one to one."""
    for old, new in _ADAPTER_TEXT:
        text = _replace_once(text, old, new, "adapter")
    for statement in _ADAPTER_INIT_STATEMENTS:
        text = replace_in_function(text, adapter_class, "__init__", statement, "")
    text = _replace_once(text, _EXPERT_ID_CHECK, "", "adapter")
    for old, new in _FROM_HF_EXPERTS:
        text = replace_in_function(text, adapter_class, "from_hf", old, new)
    text = replace_in_function(
        text,
        adapter_class,
        "convert_single_to_hf",
        "experts = self._split_experts(name, tensor)",
        "",
    )
    text = replace_in_function(
        text, adapter_class, "convert_single_to_hf", "if experts is not None:\n    return experts", ""
    )
    for method in ("_split_experts", "_stack_experts"):
        if f"def {method}(" in text:
            text = remove_method(text, adapter_class, method)
    text = replace_text(
        text, "    # -- MoE experts -------------------------------------------------------------------\n\n", ""
    )
    text = replace_text(text, "        # What to_hf of expert-sharded DTensors records for the matching from_hf.\n", "")
    return prune_unused_imports(text)


def is_moe_entry(archon_target: str | None) -> bool:
    """A ``from_hf_map`` entry of the block's MoE (router, experts, shared experts)."""
    return archon_target is not None and ".moe." in archon_target
