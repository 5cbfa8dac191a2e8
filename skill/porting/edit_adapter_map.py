"""Step 6: ``from_hf_map`` of the state-dict adapter, derived from the checkpoint's keys."""

from __future__ import annotations

import logging
import re

from pydantic import Field

from skill.codemod import StagedTree
from skill.codemod.cst import CodemodError, edit_dict_literal, read_dict_literal
from skill.porting.common import PackageLayout, PackageRequest, StepResult, require_file, staged, write_if_changed
from skill.porting.hf_source import checkpoint_keys, generalised_keys, load_config

logger = logging.getLogger(__name__)

# HF module path (inside ``model.layers.{}.`` or at the top) -> Archon module path.
# Context-free entries; the norms around a block depend on which norms the checkpoint
# has and are chosen by ``_norm_names``.
LAYER_MODULES: dict[str, str] = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.c_fc": "feed_forward.w1",
    "mlp.c_proj": "feed_forward.w2",
    "mlp.gate": "moe.router.gate",
    "block_sparse_moe.gate": "moe.router.gate",
    "mlp.shared_expert.gate_proj": "moe.shared_experts.w1",
    "mlp.shared_expert.up_proj": "moe.shared_experts.w3",
    "mlp.shared_expert.down_proj": "moe.shared_experts.w2",
    "mlp.shared_expert_gate": "moe.shared_expert_gate",
}
# Per-expert 2D checkpoint tensors; Archon stacks a layer's experts into one 3D parameter
# (named without ".weight"), so these map layer and expert index to that parameter.
EXPERT_MODULES: dict[str, str] = {
    "mlp.experts.{}.gate_proj": "moe.experts.w1",
    "mlp.experts.{}.up_proj": "moe.experts.w3",
    "mlp.experts.{}.down_proj": "moe.experts.w2",
    "block_sparse_moe.experts.{}.w1": "moe.experts.w1",
    "block_sparse_moe.experts.{}.w3": "moe.experts.w3",
    "block_sparse_moe.experts.{}.w2": "moe.experts.w2",
}
# A MoE family's dense layers (mlp_only_layers, decoder_sparse_step) use the dense MLP;
# a tiny checkpoint may have none, so their entries are added whenever experts exist.
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TOP_MODULES: dict[str, str] = {
    "model.embed_tokens": "tok_embeddings",
    "model.norm": "norm",
    "lm_head": "output",
}
# Keys a checkpoint may hold that are recomputed at run time.
RUNTIME_BUFFERS: dict[str, None] = {
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
}
LAYER_PREFIX = "model.layers.{}."
_PARAM_SUFFIX = re.compile(r"^(?P<module>.+)\.(?P<param>weight|bias)$")


class UnmappedKeyError(ValueError):
    """HF checkpoint keys no rule maps to an Archon parameter."""


def _norm_names(layer_modules: set[str]) -> dict[str, str]:
    """Archon names of a block's norms from which norms the checkpoint holds.

    Pre-norm blocks (``input_layernorm`` + ``post_attention_layernorm``) use
    ``attention_norm``/``ffn_norm``. With ``pre_feedforward_layernorm`` the
    ``post_attention_layernorm`` normalises the attention output (sandwich norm); without
    ``input_layernorm`` both norms sit after their sub-layer (post-norm).
    """
    names = {"input_layernorm": "attention_norm"}
    sandwich = "pre_feedforward_layernorm" in layer_modules
    post_norm = "input_layernorm" not in layer_modules
    if sandwich or post_norm:
        names["post_attention_layernorm"] = "post_attention_norm"
        names["pre_feedforward_layernorm"] = "ffn_norm"
        names["post_feedforward_layernorm"] = "post_ffn_norm"
    else:
        names["post_attention_layernorm"] = "ffn_norm"
        names["post_feedforward_layernorm"] = "post_ffn_norm"
    return names


def derive_from_hf_map(hf_keys: list[str], dense_layers: bool = True) -> dict[str, str | None]:
    """HF key (``{}`` for indices) -> Archon key for every key of a checkpoint.

    Raises ``UnmappedKeyError`` listing every key no rule covers.
    """
    keys = generalised_keys(hf_keys)
    layer_modules = {
        _PARAM_SUFFIX.match(k[len(LAYER_PREFIX) :]).group("module")  # type: ignore[union-attr]
        for k in keys
        if k.startswith(LAYER_PREFIX) and _PARAM_SUFFIX.match(k[len(LAYER_PREFIX) :])
    }
    layer_rules = {**LAYER_MODULES, **_norm_names(layer_modules)}
    mapping: dict[str, str | None] = {}
    unmapped: list[str] = []
    for key in keys:
        if key in RUNTIME_BUFFERS:
            mapping[key] = None
            continue
        inner = key[len(LAYER_PREFIX) :] if key.startswith(LAYER_PREFIX) else None
        match = _PARAM_SUFFIX.match(inner if inner is not None else key)
        if match is None:
            unmapped.append(key)
            continue
        module, param = match.group("module"), match.group("param")
        if inner is not None and module in EXPERT_MODULES:
            mapping[key] = f"layers.{{}}.{EXPERT_MODULES[module]}"
            continue
        target = layer_rules.get(module) if inner is not None else TOP_MODULES.get(module)
        if target is None:
            unmapped.append(key)
            continue
        mapping[key] = f"layers.{{}}.{target}.{param}" if inner is not None else f"{target}.{param}"
    if unmapped:
        raise UnmappedKeyError(
            f"no Archon parameter for HF checkpoint key(s) {unmapped}; the engine has no edit that "
            "creates these modules (fused or renamed layouts need an adapter edit)."
        )
    if any(".experts.{}." in k for k in keys) and dense_layers:
        for module in DENSE_MLP:
            mapping.setdefault(f"{LAYER_PREFIX}{module}.weight", f"layers.{{}}.{LAYER_MODULES[module]}.weight")
    mapping.update({k: v for k, v in RUNTIME_BUFFERS.items() if k not in mapping})
    # A tied checkpoint has no lm_head; the adapter fills it from the embedding, so the
    # entry stays for to_hf of untied fine-tunes and for the tying fill-in.
    mapping.setdefault("lm_head.weight", "output.weight")
    # A critic's value head (Archon models only; HF checkpoints of a critic carry it too).
    mapping.setdefault("score.weight", "score.weight")
    return dict(sorted(mapping.items()))


class EditAdapterMapRequest(PackageRequest):
    source: str | None = Field(
        default=None,
        description="model_type or config path whose checkpoint keys to derive the map from; "
        "omit to edit entries only",
    )
    add: dict[str, str | None] = Field(
        default_factory=dict, description="entries to add or change: HF key -> Archon key (None drops the key)"
    )
    remove: list[str] = Field(default_factory=list, description="HF keys whose entries to remove")


class EditAdapterMapResult(StepResult):
    from_hf_map: dict[str, str | None]
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)


MAP_TARGETS = ("self.from_hf_map", "from_hf_map")


def _map_target(source: str) -> str:
    for target in MAP_TARGETS:
        try:
            read_dict_literal(source, target)
            return target
        except CodemodError:
            continue
    raise CodemodError(
        "the adapter has no dict literal assigned to self.from_hf_map or from_hf_map; "
        "the reference's adapter shape is required."
    )


def edit_adapter_map(request: EditAdapterMapRequest) -> EditAdapterMapResult:
    """Derive the adapter's from_hf_map from the HF checkpoint keys of `source` (the keys
    save_pretrained writes), or add/remove single entries; edits the dict literal in place,
    keeping comments. Fails naming any checkpoint key with no Archon parameter."""
    with staged(request.workspace) as tree:
        return apply_edit_adapter_map(tree, request)


def apply_edit_adapter_map(tree: StagedTree, request: EditAdapterMapRequest) -> EditAdapterMapResult:
    layout = PackageLayout.for_name(request.model_name)
    text = require_file(tree, layout.adapter, "run copy_reference first.")
    target = _map_target(text)
    current = read_dict_literal(text, target)
    remove = set(request.remove)
    wanted: dict[str, str | None] = dict(current)
    if request.source is not None:
        config = load_config(request.source)
        dense_layers = any(hasattr(config, f) for f in ("mlp_only_layers", "decoder_sparse_step"))
        derived = derive_from_hf_map(list(checkpoint_keys(request.source)), dense_layers=dense_layers)
        # Keep explicit drops (runtime buffers); everything else comes from the checkpoint.
        wanted = {k: v for k, v in current.items() if v is None}
        wanted.update(derived)
    wanted.update(request.add)
    for key in remove:
        wanted.pop(key, None)
    stale = [k for k in current if k not in wanted]
    new_text = edit_dict_literal(text, target, set_entries=wanted, remove=stale)
    changed: list[str] = []
    write_if_changed(tree, layout.adapter, new_text, changed)
    added = sorted(k for k in wanted if current.get(k, object()) != wanted[k])
    return EditAdapterMapResult(
        from_hf_map=read_dict_literal(new_text, target), added=added, removed=sorted(stale), changed_files=changed
    )
