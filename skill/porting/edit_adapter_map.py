"""Step 6: ``from_hf_map`` of the state-dict adapter, derived from the checkpoint's keys."""

from __future__ import annotations

import logging
import re
import textwrap
from typing import TYPE_CHECKING, Any

from pydantic import Field

from skill.analysis.reference import EDITABLE_REFERENCES
from skill.codemod import StagedTree
from skill.codemod.cst import (
    CodemodError,
    Document,
    edit_dict_literal,
    insert_after_statement_assigning,
    insert_at_loop_head,
    insert_before_class,
    insert_class_statement_after,
    loop_body_code,
    prune_unused_imports,
    read_dict_literal,
    remove_method,
    replace_in_function,
    replace_text,
    set_docstring,
    upsert_function,
    upsert_method,
)
from skill.errors import HAND_PORT_POINTER
from skill.features import BLOCK_NORM_NAMES, ExpertLayout, GateUpOrder, MoEFeatures, PositionKind, WeightOrientation
from skill.porting.adapter_ignore_patterns import apply_ignore_patterns_adapter
from skill.porting.common import (
    PackageLayout,
    PackageRequest,
    StepResult,
    require_file,
    require_package,
    staged,
    write_if_changed,
)
from skill.porting.dense_mla import dense_adapter, is_moe_entry
from skill.porting.hf_source import checkpoint_keys, generalise_key, load_config
from skill.porting.hybrid_package import STACKED_MIXER_REGROUP, apply_mixer_row_blocks, stacked_mixer_map, text_adapter
from skill.porting.mla_router import is_correction_bias_entry, no_correction_bias_adapter
from skill.snippets import snippet
from skill.snippets.differential import DifferentialLambda
from skill.tiny_model import tiny_config

if TYPE_CHECKING:
    from skill.analysis.report import ArchitectureReport

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
    "self_attn.query_layernorm": "attention.q_norm",  # HunYuan
    "self_attn.key_layernorm": "attention.k_norm",
    "self_attn.q_layernorm": "attention.q_norm",  # Persimmon
    "self_attn.k_layernorm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.c_fc": "feed_forward.w1",
    "mlp.c_proj": "feed_forward.w2",
    # GPT-2-era names (gpt2, gpt_bigcode: attn.c_proj; OPT: out_proj, fc1/fc2 held by the layer).
    "attn.c_proj": "attention.wo",
    "self_attn.out_proj": "attention.wo",
    "fc1": "feed_forward.w1",
    "fc2": "feed_forward.w2",
    # The pre-norm layout of OPT/BioGPT/XGLM, whose FFN (fc1/fc2 held by the layer) the norm
    # probe cannot give a role to; a probed role overrides these.
    "self_attn_layer_norm": "attention_norm",
    "final_layer_norm": "ffn_norm",
    "mlp.act_fn": "feed_forward.act_fn",  # a learned activation's parameters (xIELU)
    "mlp.gate": "moe.router.gate",
    "mlp.router.gate": "moe.router.gate",
    "block_sparse_moe.gate": "moe.router.gate",
    "mlp.router": "moe.router.gate",
    "mlp.gate.wg": "moe.router.gate",  # HunYuan-MoE's router Linear inside its gate module
    "block_sparse_moe.router.layer": "moe.router.gate",
    "block_sparse_moe.router": "moe.router.gate",  # a router holding its weight itself (GraniteMoeSWA)
    "mlp.shared_expert.gate_proj": "moe.shared_experts.w1",
    "mlp.shared_expert.up_proj": "moe.shared_experts.w3",
    "mlp.shared_expert.down_proj": "moe.shared_experts.w2",
    "mlp.shared_expert_gate": "moe.shared_expert_gate",
    # DeepSeek-style shared experts (AReaL's num_shared_experts): one MLP, several experts wide.
    "mlp.shared_experts.gate_proj": "moe.shared_experts.w1",
    "mlp.shared_experts.up_proj": "moe.shared_experts.w3",
    "mlp.shared_experts.down_proj": "moe.shared_experts.w2",
    "mlp.shared_mlp.gate_proj": "moe.shared_experts.w1",
    "mlp.shared_mlp.up_proj": "moe.shared_experts.w3",
    "mlp.shared_mlp.down_proj": "moe.shared_experts.w2",
}
# The router's score-correction bias (its checkpoint key inside a layer is measured by the
# analysis): AReaL's MoE buffer that shifts expert selection, never the weights.
CORRECTION_BIAS_TARGET = "moe.expert_bias"
# Parameters held by a layer's module itself, not by a Linear or norm inside it.
LAYER_PARAMETERS: dict[str, str] = {
    "self_attn.sinks": "attention.sinks",
    "self_attn.softmax_offset": "attention.sinks",  # Flint's sinks, as its checkpoints name them
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
    # GPT-2-era names (gpt2, gpt_bigcode; OPT's decoder).
    "transformer.wte": "tok_embeddings",
    "transformer.word_embeddings": "tok_embeddings",
    "transformer.ln_f": "norm",
    "model.decoder.embed_tokens": "tok_embeddings",
    "model.decoder.final_layer_norm": "norm",
}
# The Archon parameter of a learned absolute-position table (the report names its key).
POSITION_TABLE = "pos_embeddings.weight"
# Keys a checkpoint may hold that are recomputed at run time: a layer's rotary table, which
# transformers' attention modules held (and saved) before the table moved to the model
# (modeling_utils still ignores ``rotary_emb.inv_freq`` on load). The llama layout's name; a
# family's own is :func:`rotary_buffer_keys`.
RUNTIME_BUFFERS: dict[str, None] = {
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
}
ATTENTION_PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
LAYER_PREFIX = "model.layers.{}."
# Tensor names a checkpoint module holds: weights and biases, and a learned activation's
# parameters and constants (xIELU's alpha_p, alpha_n, beta, eps).
_PARAM_SUFFIX = re.compile(r"^(?P<module>.+)\.(?P<param>weight|bias|alpha_p|alpha_n|beta|eps)$")


class UnmappedKeyError(ValueError):
    """HF checkpoint keys no rule maps to an Archon parameter."""


def unmapped_keys_error(keys: list[str], why: str) -> UnmappedKeyError:
    """The one refusal of keys with no Archon parameter: ``why`` no rule maps them, the fix
    (``add``, on the CLI ``--add``, in the same call) and the hand-port pointer, last."""
    return UnmappedKeyError(
        f"no Archon parameter for HF checkpoint key(s) {keys}: {why}. If a hand edit created their "
        "Archon parameters, map each one with `add` in this same call (HF key -> Archon key, `{}` for "
        f"the layer index; CLI: `--add HF_KEY=ARCHON_KEY`) ({HAND_PORT_POINTER})"
    )


# Archon parameters a fused checkpoint tensor holds, stacked along dim 0 in this order.
FUSED_QKV_PARTS = ("attention.wq", "attention.wk", "attention.wv")
FUSED_GATE_UP_PARTS = ("feed_forward.w1", "feed_forward.w3")


def fused_rows(config: Any) -> dict[int, tuple[str, ...]]:
    """Row count of a fused projection -> the Archon modules it stacks, from the config.

    A fused q/k/v projection has ``(n_heads + 2 * n_kv_heads) * head_dim`` rows, a fused
    gate/up projection ``2 * intermediate_size``; found by shape, never by module name.
    """
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    rows: dict[int, tuple[str, ...]] = {}
    if hidden and heads:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        rows[(heads + 2 * kv_heads) * head_dim] = FUSED_QKV_PARTS
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate and 2 * intermediate not in rows:
        rows[2 * intermediate] = FUSED_GATE_UP_PARTS
    return rows


_EXPERT_INDEX = re.compile(r"(?<=\.experts)\.\d+(?=\.)")


def layer_generaliser(layer_prefix: str = LAYER_PREFIX, literal_inner: bool = False):
    """A function that writes a key's layer index (after ``layer_prefix``, ``{}`` for the
    index) and expert index as ``{}``: ``transformer.h.3.mlp.w`` -> ``transformer.h.{}.mlp.w``.
    Every other number is written as ``{}`` too, unless ``literal_inner``: then it stays, so
    the positions of an ``nn.Sequential`` (CTRL's ``ffn.0``, ``ffn.2``) stay apart."""
    stack = re.compile("^" + re.escape(layer_prefix).replace(re.escape("{}"), r"\d+"))

    def generalise(key: str) -> str:
        key = stack.sub(layer_prefix, key, count=1)
        return _EXPERT_INDEX.sub(".{}", key) if literal_inner else generalise_key(key)

    return generalise


def has_inner_index(key: str, layer_prefix: str = LAYER_PREFIX) -> bool:
    """Whether an abstract key holds an index that is neither the layer's nor an expert's."""
    inner = key[len(layer_prefix) :] if key.startswith(layer_prefix) else key
    return "{}" in _EXPERT_INDEX.sub("", inner.replace(".experts.{}.", ".experts.0."))


# The adapter's runtime key abstraction when the map keeps Sequential positions literal:
# only the layer stack's index (HF's and Archon's ``layers``) and an expert's become ``{}``.
_LAYER_ONLY_INDEX = r"""_INDEX = re.compile(r"(?:(?<=^{hf_stack})|(?<=^layers)|(?<=\.experts))\.(\d+)(?=\.)")"""
_ALL_INDICES = r"""_INDEX = re.compile(r"\.(\d+)(?=\.)")"""


def detect_fused_keys(
    shapes: dict[str, tuple[int, ...]],
    config: Any,
    known_modules: set[str] | None = None,
    layer_prefix: str = LAYER_PREFIX,
    transposed: frozenset[str] | set[str] = frozenset(),
) -> dict[str, list[str]]:
    """Layer keys (``{}`` for the layer) that stack several Archon parameters -> those parameters.

    Only keys no rename rule covers are candidates; a candidate is fused when its first
    dimension is the row count of a fused q/k/v or gate/up projection (``fused_rows``) and
    a weight's second dimension is the hidden size.
    """
    known = set(LAYER_MODULES) if known_modules is None else known_modules
    rows = fused_rows(config)
    hidden = getattr(config, "hidden_size", None)
    fused: dict[str, list[str]] = {}
    generalise = layer_generaliser(layer_prefix)
    for key, shape in shapes.items():
        key = generalise(key)
        if not key.startswith(layer_prefix) or ".experts.{}." in key:
            continue
        if key in transposed:
            shape = tuple(reversed(shape))  # stored (in, out): judged as nn.Linear's (out, in)
        match = _PARAM_SUFFIX.match(key[len(layer_prefix) :])
        if match is None or match.group("module") in known or not shape or shape[0] not in rows:
            continue
        param = match.group("param")
        if (param == "weight" and (len(shape) != 2 or shape[1] != hidden)) or (param == "bias" and len(shape) != 1):
            continue
        fused[key] = [f"layers.{{}}.{part}.{param}" for part in rows[shape[0]]]
    return dict(sorted(fused.items()))


def fused_from_report(
    fused_modules: dict[str, list[str]], shapes: dict[str, tuple[int, ...]], layer_prefix: str
) -> dict[str, list[str]]:
    """The analysis' fused modules as checkpoint keys: ``<module>.weight`` (and ``.bias``
    where the checkpoint has one) -> the Archon parameters they stack."""
    generalise = layer_generaliser(layer_prefix)
    saved = {generalise(k) for k in shapes}
    fused: dict[str, list[str]] = {}
    for module, parts in fused_modules.items():
        for param in ("weight", "bias"):
            if f"{module}.{param}" in saved:
                fused[f"{module}.{param}"] = [f"{part}.{param}" for part in parts]
    return fused


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


def rotary_buffer_keys(report: ArchitectureReport) -> list[str]:
    """The checkpoint keys (``{}`` for the layer) where older transformers versions saved a
    layer's rotary table: ``rotary_emb.inv_freq`` under each attention module of the analysis'
    module map (GPT-NeoX's ``gpt_neox.layers.{}.attention``, Llama's ``model.layers.{}.self_attn``);
    none for a family without rotary positions."""
    if report.checklist.positions.kind is not PositionKind.ROPE:
        return []
    prefix = _layer_template(report.checkpoint.layer_prefix)
    attention = {
        hf.rsplit(".", 1)[0]
        for hf, archon in report.checkpoint.module_map.items()
        if hf.startswith(prefix) and archon.removeprefix("layers.{}.") in ATTENTION_PROJECTIONS
    }
    return sorted(f"{module}.rotary_emb.inv_freq" for module in attention)


def moe_block_name(moe: MoEFeatures | None, layer_prefix: str) -> str:
    """The layer's module holding the routed experts, from the analysis' expert key
    (``model.layers.{}.feed_forward.experts.gate_up_proj`` -> ``feed_forward``); ``mlp``
    without experts."""
    template = moe.expert_key_template if moe is not None else ""
    inner = template[len(layer_prefix) :] if template.startswith(layer_prefix) else ""
    return inner.split(".experts.", 1)[0] if ".experts." in inner else "mlp"


def _moe_rules(moe_block: str) -> tuple[dict[str, str], dict[str, str]]:
    """The MoE block's rules (router, shared experts) and per-expert modules, named under
    ``moe_block`` as the tables name them under ``mlp``."""
    if moe_block == "mlp":
        return {}, EXPERT_MODULES
    renamed = {
        f"{moe_block}.{name[len('mlp.') :]}": target
        for name, target in LAYER_MODULES.items()
        if name.startswith("mlp.") and target.startswith("moe.")
    }
    experts = {
        f"{moe_block}.{name[len('mlp.') :]}": target
        for name, target in EXPERT_MODULES.items()
        if name.startswith("mlp.")
    }
    return renamed, {**EXPERT_MODULES, **experts}


def derive_from_hf_map(
    hf_keys: list[str],
    dense_layers: bool = True,
    fused: dict[str, list[str]] | None = None,
    norm_roles: dict[str, str] | None = None,
    layer_buffers: dict[str, str] | None = None,
    layer_prefix: str = LAYER_PREFIX,
    position_table_key: str | None = None,
    embedding_norm_module: str | None = None,
    top_modules: dict[str, str] | None = None,
    module_map: dict[str, str] | None = None,
    explicit: dict[str, str | None] | None = None,
    literal_inner: bool = False,
    runtime_buffers: list[str] | None = None,
    moe_block: str = "mlp",
) -> dict[str, str | None]:
    """HF key (``{}`` for indices) -> Archon key for every key of a checkpoint.

    ``moe_block``: the layer's module holding the routed experts (:func:`moe_block_name`); its
    router, experts and shared experts are named as they would be in ``mlp`` (Llama 4's
    ``feed_forward.router``, ``feed_forward.shared_expert.gate_proj``).

    ``runtime_buffers``: keys a released checkpoint may hold that are recomputed at run time,
    dropped (:func:`rotary_buffer_keys`); the llama layout's ``RUNTIME_BUFFERS`` when not given.

    ``literal_inner`` keeps the numbers that are no layer or expert index literal
    (``transformer.h.{}.ffn.0.weight``), for a checkpoint whose ``nn.Sequential`` positions
    are different modules.

    ``layer_buffers``: keys inside a layer that are not a weight or bias (a router's
    score-correction bias) -> the Archon key inside the layer that holds them.

    ``fused`` keys (from ``detect_fused_keys``) are left out: they go to the adapter's
    ``fused_from_hf_map``. ``module_map`` (the analysis' HF module -> Archon module, found
    by structure; layer modules under ``layer_prefix``) names what the context-free rules
    do not. ``explicit`` holds the caller's own entries (HF key with ``{}`` -> Archon key):
    they map a key no rule covers, such as a weight a hand edit gave its Archon parameter.
    Raises ``UnmappedKeyError`` listing every other key no rule covers.
    """
    fused = fused or {}
    explicit = explicit or {}
    module_map = module_map or {}
    buffers = RUNTIME_BUFFERS if runtime_buffers is None else dict.fromkeys(runtime_buffers)
    generalise = layer_generaliser(layer_prefix, literal_inner)
    keys = sorted({generalise(k) for k in hf_keys})
    layer_modules = {
        _PARAM_SUFFIX.match(k[len(layer_prefix) :]).group("module")  # type: ignore[union-attr]
        for k in keys
        if k.startswith(layer_prefix) and _PARAM_SUFFIX.match(k[len(layer_prefix) :])
    }
    # The structural map, relative to the layer (Archon's ``layers.{}.`` dropped) or at the top.
    archon_layer = "layers.{}."
    structural_layer = {
        hf[len(layer_prefix) :]: archon[len(archon_layer) :]
        for hf, archon in module_map.items()
        if hf.startswith(layer_prefix) and archon.startswith(archon_layer)
    }
    structural_top = {hf: archon for hf, archon in module_map.items() if not archon.startswith(archon_layer)}
    # The analysis' probed roles name the block norms; the checkpoint's names are the
    # fallback for a caller without a report.
    norms = (
        {name: BLOCK_NORM_NAMES[role] for name, role in norm_roles.items() if role in BLOCK_NORM_NAMES}
        if norm_roles
        else _norm_names(layer_modules)
    )
    # The name table covers modules the structural map does not find; where both name a
    # module, the structure wins (a gated MLP named c_gate/c_fc/c_proj: c_fc is the up
    # projection, w3, though GPT-2's plain c_fc is w1).
    moe_rules, expert_modules = _moe_rules(moe_block)
    layer_rules = {**LAYER_MODULES, **moe_rules, **structural_layer, **norms}
    if "mlp.up_proj" in layer_modules and "mlp.gate_proj" not in layer_modules:
        # A two-layer MLP (up, act, down): its up projection is Archon's w1.
        layer_rules["mlp.up_proj"] = "feed_forward.w1"
    top_rules = {**structural_top, **TOP_MODULES, **(top_modules or {})}
    # The attention's own parameters (sinks) under whatever the family calls the attention
    # module: the parent of the projections the structural map found (GPT-2's attn, Falcon's
    # self_attention).
    attention_modules = {
        hf.rsplit(".", 1)[0] for hf, archon in structural_layer.items() if "." in hf and archon in ATTENTION_PROJECTIONS
    }
    attention_parameters = {
        f"{module}.{hf.rsplit('.', 1)[1]}": target
        for module in attention_modules
        for hf, target in LAYER_PARAMETERS.items()
        if target.startswith("attention.")
    }
    layer_targets = {**attention_parameters, **LAYER_PARAMETERS, **(layer_buffers or {})}
    mapping: dict[str, str | None] = {}
    unmapped: list[str] = []
    for key in keys:
        if key in fused:
            continue
        if key in buffers:
            mapping[key] = None
            continue
        if key == position_table_key:
            mapping[key] = POSITION_TABLE
            continue
        if embedding_norm_module is not None and key.startswith(f"{embedding_norm_module}."):
            mapping[key] = "embedding_norm." + key[len(embedding_norm_module) + 1 :]
            continue
        inner = key[len(layer_prefix) :] if key.startswith(layer_prefix) else None
        if inner is not None and inner in layer_targets:
            mapping[key] = f"layers.{{}}.{layer_targets[inner]}"
            continue
        match = _PARAM_SUFFIX.match(inner if inner is not None else key)
        if match is None:
            unmapped.append(key)
            continue
        module, param = match.group("module"), match.group("param")
        if inner is not None and module in expert_modules:
            mapping[key] = f"layers.{{}}.{expert_modules[module]}"
            continue
        target = layer_rules.get(module) if inner is not None else top_rules.get(module)
        if target is None:
            unmapped.append(key)
            continue
        mapping[key] = f"layers.{{}}.{target}.{param}" if inner is not None else f"{target}.{param}"
    # A key no rule covers is the caller's to map (a hand edit's parameter, named with `add`).
    mapping.update({key: explicit[key] for key in unmapped if key in explicit})
    unmapped = [key for key in unmapped if key not in explicit]
    if unmapped:
        raise unmapped_keys_error(unmapped, _why_unmapped(unmapped, module_map, layer_prefix))
    if any(".experts.{}." in k for k in keys) and dense_layers:
        held = set(mapping.values())
        for module in DENSE_MLP:
            # Llama's names for dense layers the tiny checkpoint may lack; not where the checkpoint
            # names the dense MLP itself (Llama 4's feed_forward.gate_proj beside its MoE block).
            target = f"layers.{{}}.{LAYER_MODULES[module]}.weight"
            if target not in held:
                mapping.setdefault(f"{layer_prefix}{module}.weight", target)
    mapping.update({k: None for k in buffers if k not in mapping})
    # A tied checkpoint has no lm_head; the adapter fills it from the embedding, so the
    # entry stays for to_hf of untied fine-tunes and for the tying fill-in.
    head = next((hf for hf, archon in structural_top.items() if archon == "output"), "lm_head")
    mapping.setdefault(f"{head}.weight", "output.weight")
    # A critic's value head (Archon models only; HF checkpoints of a critic carry it too).
    mapping.setdefault("score.weight", "score.weight")
    return dict(sorted(mapping.items()))


def _module_map_entries(keys: list[str], module_map: dict[str, str]) -> dict[str, str]:
    """HF key -> Archon key for each of ``keys`` whose module the analysis' module map names."""
    entries = {}
    for key in keys:
        match = _PARAM_SUFFIX.match(key)
        if match is not None and match["module"] in module_map:
            entries[key] = f"{module_map[match['module']]}.{match['param']}"
    return entries


def _why_unmapped(keys: list[str], module_map: dict[str, str], layer_prefix: str) -> str:
    """Why no rule maps ``keys``: the analysis' module map pairs their modules (a number in the
    key that is no layer index, an ``nn.Sequential`` position, hides the pairing), or nothing
    in the engine creates their modules."""
    paired: dict[str, str] = {}
    for key in keys:
        match = _PARAM_SUFFIX.match(key)
        if match is None:
            continue
        module = match.group("module")
        inner = module[len(layer_prefix) :] if module.startswith(layer_prefix) else module
        head = layer_prefix if module.startswith(layer_prefix) else ""
        pattern = re.compile("^" + re.escape(head) + re.escape(inner).replace(re.escape("{}"), r"\d+") + "$")
        paired.update({hf: archon for hf, archon in module_map.items() if pattern.match(hf)})
    if not paired:
        return "the engine has no edit that creates these modules"
    pairs = ", ".join(f"{hf} -> {archon}" for hf, archon in sorted(paired.items()))
    if any(has_inner_index(key, layer_prefix) for key in keys):
        return (
            f"the analysis' module map pairs their modules ({pairs}), but a number in them is no layer index "
            "(an nn.Sequential position, kept literal when the module map pairs each position): map each "
            "position with `add`, the position written literally"
        )
    return f"the analysis' module map pairs their modules ({pairs}), but the Archon package lacks those modules"


def derive_literal_inner(**derive_args: Any) -> dict[str, str | None] | None:
    """The map with literal Sequential positions, when the all-``{}`` keys leave some unmapped
    only because a number in them is no layer index (CTRL's ``ffn.0``/``ffn.2``, which the
    analysis' module map pairs with ``w1``/``w2``); ``None`` when that map fails too."""
    try:
        return derive_from_hf_map(**derive_args, literal_inner=True)
    except UnmappedKeyError:
        return None


def apply_literal_inner_adapter(text: Document, layout: PackageLayout, layer_prefix: str) -> Document:
    """Teach the adapter's ``_abstract`` the map's literal Sequential positions: only the layer
    stack's index (``layer_prefix``'s ``{}``, and Archon's ``layers``) and an expert's index
    become ``{}``."""
    stack = re.escape(layer_prefix[: -len(".{}.")])
    return replace_text(text, _ALL_INDICES, _LAYER_ONLY_INDEX.replace("{hf_stack}", stack))


def _layer_template(layer0_prefix: str) -> str:
    """``transformer.h.0.`` (the report's layer-0 prefix) -> ``transformer.h.{}.``."""
    if not layer0_prefix.endswith(".0."):
        return LAYER_PREFIX
    return layer0_prefix[: -len("0.")] + "{}."


class EditAdapterMapRequest(PackageRequest):
    source: str | None = Field(
        default=None,
        description="model_type or config path whose checkpoint keys to derive the map from; omit to edit entries only",
    )
    add: dict[str, str | None] = Field(
        default_factory=dict,
        description="entries to add or change: HF key -> Archon key (None drops the key); with source, "
        "they map the keys no rule covers (a hand edit's parameters) and the rest is derived around them",
    )
    remove: list[str] = Field(default_factory=list, description="HF keys whose entries to remove")
    trust_remote_code: bool = Field(default=False, description="the source folder's own code builds the HF side")


class EditAdapterMapResult(StepResult):
    from_hf_map: dict[str, str | None]
    added: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)


MAP_TARGETS = ("self.from_hf_map", "from_hf_map")


def _map_target(source: Document) -> str:
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
    require_package(tree, layout)
    text = Document(require_file(tree, layout.adapter, "run copy_reference first."))
    target = _map_target(text)
    current = read_dict_literal(text, target)
    remove = set(request.remove)
    wanted: dict[str, str | None] = dict(current)
    from skill.porting.plan import plan_for, plan_from_report, report_for

    if request.source is not None and plan_for(request.source, request.trust_remote_code).reference not in (
        EDITABLE_REFERENCES
    ):
        # A reference no edit targets keeps its whole map (its modules serve every config
        # variant it reads); the family's checkpoint must fit it.
        keys = sorted({generalise_key(k) for k in checkpoint_keys(request.source, request.trust_remote_code)})
        report = report_for(request.source, request.trust_remote_code)
        stacked: dict[str, list[str]] = {}
        hybrid = report.checklist.linear_attention
        if hybrid is not None:
            # A hybrid's package (skill/porting/hybrid_package.py): the text model's conversion,
            # and the checkpoint's stacked mixer weights split into the reference's projections.
            text = text_adapter(text, layout, report.config_class)
            layer_template = _layer_template(report.checkpoint.layer_prefix)
            stacked = stacked_mixer_map(hybrid, layer_template)
            held = {part for parts in stacked.values() for part in parts}
            remove |= {k for k, v in current.items() if v in held}
            # Where older transformers saved a layer's rotary table: dropped, as every family's adapter does.
            wanted.update(dict.fromkeys(rotary_buffer_keys(report)))
        # A module an edit of the block wrote (the norm on the MoE's output) is in the analysis'
        # module map; the caller's own entries (a hand edit's parameter, named with `add`) count too.
        edited = _module_map_entries([k for k in keys if k not in current], report.checkpoint.module_map)
        wanted.update(edited)
        mapped = set(current) | set(edited) | set(request.add) | set(stacked)
        unmapped = [k for k in keys if k not in mapped]
        if unmapped:
            raise unmapped_keys_error(
                unmapped, "the reference's from_hf_map lacks them, and no adapter edit targets that reference"
            )
        mla_plan = plan_for(request.source, request.trust_remote_code)
        text = apply_ignored_keys_adapter(text, layout, report.checkpoint.ignored_unexpected)
        text = apply_ignore_patterns_adapter(text, layout, report.checkpoint.load_ignore_patterns)
        if hybrid is not None:
            if stacked:
                text = apply_fused_adapter(text, layout, stacked, regroup=STACKED_MIXER_REGROUP)
                text = apply_mixer_row_blocks(text, layout, hybrid, layer_template)
        elif not mla_plan.moe:
            # A dense family: no expert stacking, no MoE keys (skill/porting/dense_mla.py).
            text = dense_adapter(text, layout.adapter_class)
            remove |= {k for k, v in current.items() if is_moe_entry(v)}
        elif mla_plan.score_correction_key is None:
            # A router without a score-correction bias (skill/porting/mla_router.py).
            text = no_correction_bias_adapter(text)
            remove |= {k for k, v in current.items() if is_correction_bias_entry(v)}
    elif request.source is not None:
        config = load_config(request.source, request.trust_remote_code)
        report = report_for(request.source, request.trust_remote_code)
        plan = plan_from_report(report, request.source, request.trust_remote_code)
        # A family with a per-layer MoE rule may have dense layers the tiny checkpoint lacks.
        dense_layers = plan.moe and not plan.all_layers_moe
        shapes = checkpoint_keys(request.source, request.trust_remote_code)
        checklist = report.checklist
        prefix = _layer_template(report.checkpoint.layer_prefix)
        transposed = set(checklist.transposed_weights)
        module_map = report.checkpoint.module_map
        fused = fused_from_report(report.checkpoint.fused_modules, shapes, prefix)
        moe_block = moe_block_name(checklist.moe, prefix)
        known = (
            set(LAYER_MODULES)
            | set(_moe_rules(moe_block)[0])
            | {hf[len(prefix) : -len(".weight")] for hf in fused}
            | {hf[len(prefix) :] for hf in module_map if hf.startswith(prefix)}
        )
        fused.update(
            detect_fused_keys(
                shapes, tiny_config(config), known_modules=known, layer_prefix=prefix, transposed=transposed
            )
        )
        experts = fused_expert_keys(checklist.moe)
        buffers = {plan.score_correction_key: CORRECTION_BIAS_TARGET} if plan.score_correction_key else {}
        if checklist.attention.o_bias_last_layer_key is not None:
            # The last layer's output-projection bias, held by its attention module itself.
            buffers[checklist.attention.o_bias_last_layer_key] = "attention.wo.bias"
        differential = checklist.attention.differential
        if differential is not None:
            # Differential attention's four lambda vectors, held by the attention's DifferentialLambda.
            for key, part in zip(differential.lambda_keys, DIFFERENTIAL_LAMBDA_PARTS, strict=True):
                buffers[key] = f"attention.diff_lambda.{part}"
        derive_args: dict[str, Any] = {
            "hf_keys": list(shapes),
            "dense_layers": dense_layers,
            "fused": {**fused, **experts},
            "norm_roles": checklist.norm.block_norms,
            "layer_buffers": buffers,
            "layer_prefix": prefix,
            "position_table_key": checklist.positions.table_key,
            "embedding_norm_module": checklist.scalars.embedding_norm_module,
            "top_modules": report.checkpoint.top_modules,
            "module_map": module_map,
            "explicit": {**current, **request.add},
            "runtime_buffers": rotary_buffer_keys(report),
            "moe_block": moe_block,
        }
        try:
            derived = derive_from_hf_map(**derive_args)
        except UnmappedKeyError as exc:
            # Sequential positions (ffn.0 up, ffn.2 down) are different modules: keep them literal.
            literal = derive_literal_inner(**derive_args) if not fused and not experts else None
            if literal is None:
                raise exc from None
            derived = literal
            text = apply_literal_inner_adapter(text, layout, prefix)
        attention = checklist.attention
        grouped = attention.fused_qkv_layout == "grouped"
        blocked = (
            (attention.fused_qkv_blocks, attention.fused_qkv_order)
            if attention.fused_qkv_layout == "blocked" and attention.fused_qkv_blocks and attention.fused_qkv_order
            else None
        )
        # The experts' loops first: a fused q/k/v key's split then goes at the head of whichever
        # loops the adapter has (the reference's, or the fused experts').
        if experts and checklist.moe is not None:
            text = apply_fused_experts_adapter(text, layout, experts, checklist.moe)
        text = apply_fused_adapter(text, layout, fused, grouped=grouped, blocked=blocked)
        text = apply_transposed_adapter(text, layout, sorted(transposed))
        if plan.lm_head_bias:
            text = apply_head_bias_adapter(text, layout)
        moe = checklist.moe
        if plan.score_correction_key and moe is not None and len(moe.score_correction_shape) > 1:
            axes = len(moe.score_correction_shape) - 1
            text = apply_unit_axes_adapter(text, layout, {prefix + plan.score_correction_key: axes})
        text = apply_ignored_keys_adapter(text, layout, report.checkpoint.ignored_unexpected)
        if differential is not None:
            text = apply_paired_heads_adapter(text, layout, paired_head_keys(module_map, shapes))
        text = apply_ignore_patterns_adapter(text, layout, report.checkpoint.load_ignore_patterns)
        # Keep explicit drops but the reference's rotary table (the family's own is derived);
        # everything else comes from the checkpoint.
        wanted = {k: v for k, v in current.items() if v is None and k not in RUNTIME_BUFFERS}
        wanted.update(derived)
    wanted.update(request.add)
    for key in remove:
        wanted.pop(key, None)
    stale = [k for k in current if k not in wanted]
    new_text = edit_dict_literal(text, target, set_entries=wanted, remove=stale)
    changed: list[str] = []
    write_if_changed(tree, layout.adapter, new_text.code, changed)
    added = sorted(k for k in wanted if current.get(k, object()) != wanted[k])
    return EditAdapterMapResult(
        from_hf_map=read_dict_literal(new_text, target), added=added, removed=sorted(stale), changed_files=changed
    )


# --- fused on-disk layouts ------------------------------------------------------------------

FUSED_MAP = "fused_from_hf_map"
FUSED_EXPERTS_MAP = "fused_experts_from_hf_map"

_FUSED_INIT = """
# Archon part -> (fused HF key that holds it, its position along dim 0).
self.fused_to_hf_map = {
    part: (hf, position) for hf, parts in self.fused_from_hf_map.items() for position, part in enumerate(parts)
}
self._rows: dict[str, int] | None = None
"""

_FUSED_HF_KEY = """
if template in self.fused_to_hf_map:
    return self.fused_to_hf_map[template][0].format(*indices)  # the slice's destination
"""

# The head of from_hf's loop over the checkpoint: a fused key is split, and the loop goes on.
# Any reference's loop takes it (qwen2's renames, qwen3's stacks experts, a fused-experts
# adapter's splits them); ``{template}`` is the loop's own name for the abstract key.
_FROM_HF_FUSED_DISPATCH = """
if {template} in self.fused_from_hf_map:
    state_dict.update(self._split_fused(hf_key, {template}, indices, value))
    continue
"""
_ABSTRACT_HF_KEY = re.compile(r"(\w+), indices = _abstract\(hf_key\)")

_TO_HF_LOOP_OLD = """
for name, value in archon_state_dict.items():
    for hf_key, tensor in self.convert_single_to_hf(name, value):
        hf_state_dict[hf_key] = tensor
"""

_TO_HF_LOOP_NEW = """
fused: dict[str, dict[int, Any]] = {}
for name, value in archon_state_dict.items():
    template, indices = _abstract(_strip_wrappers(name))
    if template in self.fused_to_hf_map:
        hf_template, position = self.fused_to_hf_map[template]
        fused.setdefault(hf_template.format(*indices), {})[position] = value
        continue
    for hf_key, tensor in self.convert_single_to_hf(name, value):
        hf_state_dict[hf_key] = tensor
for hf_key, pieces in fused.items():
    hf_state_dict[hf_key] = self._concat_fused(hf_key, pieces)
"""

_ROWS = """
def _archon_rows(self) -> dict[str, int]:
    \"\"\"Dim-0 size of every Archon parameter (from a meta-device model: no memory).\"\"\"
    if self._rows is None:
        with torch.device("meta"):
            model = {model_class}(self.model_args)
        self._rows = {{key: value.shape[0] for key, value in model.state_dict().items()}}
    return self._rows
"""

_SPLIT = """
def _split_fused(self, hf_key: str, template: str, indices: list[str], value: Any) -> dict[str, Any]:
    \"\"\"One fused checkpoint tensor -> the Archon parameters it stacks along dim 0.\"\"\"
    parts = [part.format(*indices) for part in self.fused_from_hf_map[template]]
    rows = [self._archon_rows().get(part, 0) for part in parts]
    if sum(rows) != value.shape[0] or 0 in rows:
        raise KeyError(
            f"HF checkpoint key {{hf_key!r}} has {{value.shape[0]}} rows; the Archon parameters "
            f"{{parts}} it holds have {{rows}}. The checkpoint does not match this config."
        )
    return dict(zip(parts, torch.split(value, rows, dim=0), strict=True))
"""

# to_hf of an adapter whose experts are fused on disk too: its loop collects both kinds of
# parts into ``fused``; each checkpoint tensor is then fused as its kind fuses.
_TO_HF_FUSED_DISPATCH = """
if template in self.fused_to_hf_map:
    hf_template, position = self.fused_to_hf_map[template]
    fused.setdefault(hf_template.format(*indices), {})[position] = value
    continue
"""

_EXPERTS_TO_HF_FOLD = """
for hf_key, pieces in fused.items():
    hf_state_dict[hf_key] = self._experts_to_hf(hf_key, pieces)
"""

_BOTH_TO_HF_FOLD = """
for hf_key, pieces in fused.items():
    if _abstract(hf_key)[0] in self.fused_from_hf_map:
        hf_state_dict[hf_key] = self._concat_fused(hf_key, pieces)
    else:
        hf_state_dict[hf_key] = self._experts_to_hf(hf_key, pieces)
"""

_EXPERTS_JOIN_FALLBACK = "return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)"

_BOTH_JOIN_FALLBACK = """
if template in self.fused_from_hf_map:
    return self._concat_fused(hf_key, dict(enumerate(pieces)))
return pieces[0]
"""

_CONCAT = """
def _concat_fused(self, hf_key: str, pieces: dict[int, Any]) -> Any:
    \"\"\"The Archon parameters one fused checkpoint tensor holds, stacked along dim 0 in order.\"\"\"
    template, _ = _abstract(hf_key)
    count = len(self.fused_from_hf_map[template])
    if sorted(pieces) != list(range(count)):
        raise KeyError(f"{{hf_key!r}} stacks {{count}} Archon parameters; only parts {{sorted(pieces)}} were given.")
    return torch.cat([pieces[position] for position in range(count)], dim=0)
"""


def _fused_literal(fused: dict[str, list[str]]) -> str:
    lines = ["fused_from_hf_map: ClassVar[dict[str, list[str]]] = {"]
    for hf_key, parts in sorted(fused.items()):
        lines.append(f'    "{hf_key}": [')
        lines.extend(f'        "{part}",' for part in parts)
        lines.append("    ],")
    lines.append("}")
    return "\n".join(lines) + "\n"


_GROUPED_SPLIT = """
if ".attention.wq." in parts[0]:
    # The checkpoint groups q/k/v rows by KV head; Archon's wq, wk, wv stack them in turn.
    args = self.model_args
    value = _ungroup_qkv(value, args.n_heads, args.n_kv_heads, args.head_dim)
"""

_GROUPED_CONCAT = """
if ".attention.wq." in self.fused_from_hf_map[template][0]:
    args = self.model_args
    return _group_qkv(stacked, args.n_heads, args.n_kv_heads, args.head_dim)
"""


_BLOCKED_SPLIT = """
if ".attention.wq." in parts[0]:
    # The checkpoint holds {blocks} blocks of q/k/v rows ({order} in each); Archon's wq, wk, wv stack them in turn.
    args = self.model_args
    value = _unblock_qkv(value, args.n_heads, args.n_kv_heads, args.head_dim, blocks={blocks}, order="{order}")
"""

_BLOCKED_CONCAT = """
if ".attention.wq." in self.fused_from_hf_map[template][0]:
    args = self.model_args
    return _block_qkv(stacked, args.n_heads, args.n_kv_heads, args.head_dim, blocks={blocks}, order="{order}")
"""


def _dispatch_fused_from_hf(text: Document, cls: str) -> Document:
    """Put the fused-key split at the head of ``from_hf``'s loop over the checkpoint, reading
    the abstract key the loop already computes (moved to the head) or computing it there."""
    body = loop_body_code(text, cls, "from_hf", "hf_state_dict.items()")
    abstracting = next((code for code in body if _ABSTRACT_HF_KEY.fullmatch(code)), None)
    if abstracting is None:
        dispatch = _FROM_HF_FUSED_DISPATCH.format(template="template").strip()
        head = "template, indices = _abstract(hf_key)\n" + dispatch + "\n"
        return insert_at_loop_head(text, cls, "from_hf", "hf_state_dict.items()", head)
    match = _ABSTRACT_HF_KEY.fullmatch(abstracting)
    assert match is not None
    dispatch = _FROM_HF_FUSED_DISPATCH.format(template=match.group(1))
    return insert_at_loop_head(
        text, cls, "from_hf", "hf_state_dict.items()", dispatch.strip() + "\n", hoist=abstracting
    )


def apply_fused_adapter(
    text: Document,
    layout: PackageLayout,
    fused: dict[str, list[str]],
    grouped: bool = False,
    blocked: tuple[int, str] | None = None,
    regroup: tuple[str, str, tuple[str, ...]] | None = None,
) -> Document:
    """Teach a copied adapter a fused on-disk layout: ``from_hf`` splits each fused key
    along dim 0 by its parts' sizes, ``to_hf`` concatenates them back, and
    ``convert_single_to_hf`` names, for one part, the fused key its slice belongs to.
    ``grouped``: the fused q/k/v rows are grouped by KV head (the analysis' probed
    layout), so the split regroups them into q, k, v first and the concat back.
    ``blocked``: ``(blocks, order)``, the fused rows form that many blocks, each a share of
    q, k, v in that order (CodeGen's 4 blocks of q, v, k); the split unblocks them.
    ``regroup``: another reordering, as ``(split code, concat code, helper snippets)``: the code
    runs in ``_split_fused`` before the split (on ``value``, with ``template`` and ``parts``)
    and in ``_concat_fused`` on ``stacked`` (returning the checkpoint's tensor where it applies)."""
    if not fused:
        return text
    cls = layout.adapter_class
    camel = layout.names.camel
    text = replace_text(
        text,
        f"Renames {camel} weights between Archon and HF checkpoints; no tensor is changed.",
        f"Renames {camel} weights between Archon and HF checkpoints; splits and re-stacks fused tensors.",
    )
    text = insert_class_statement_after(
        text,
        cls,
        "from_hf_map",
        "# Checkpoint keys that stack several Archon parameters along dim 0, in this order.\n" + _fused_literal(fused),
    )
    try:
        text = insert_after_statement_assigning(text, cls, "__init__", "self.to_hf_map", _FUSED_INIT.strip() + "\n")
        text = insert_after_statement_assigning(text, cls, "_hf_key", "template, indices", _FUSED_HF_KEY.strip() + "\n")
        text = _dispatch_fused_from_hf(text, cls)
        if FUSED_EXPERTS_MAP in text:
            # The experts' to_hf loop already collects parts into ``fused``: the fused keys join them.
            text = insert_at_loop_head(
                text,
                cls,
                "to_hf",
                "archon_state_dict.items()",
                _TO_HF_FUSED_DISPATCH.strip() + "\n",
                hoist="template, indices = _abstract(_strip_wrappers(name))",
            )
            text = replace_in_function(text, cls, "to_hf", _EXPERTS_TO_HF_FOLD.strip(), _BOTH_TO_HF_FOLD.strip())
            text = replace_in_function(
                text, cls, "join_single_to_hf", _EXPERTS_JOIN_FALLBACK, _BOTH_JOIN_FALLBACK.strip()
            )
        else:
            text = replace_in_function(text, cls, "to_hf", _TO_HF_LOOP_OLD.strip(), _TO_HF_LOOP_NEW.strip())
    except CodemodError as e:
        raise CodemodError(
            f"fused on-disk keys {sorted(fused)} need the reference adapter's plain rename loops: {e}"
        ) from e
    text = upsert_method(
        text,
        cls,
        "_archon_rows",
        _ROWS.format(model_class=layout.model_class).strip() + "\n",
        after="_expected_archon_keys",
    )
    split, concat = _SPLIT.format().strip() + "\n", _CONCAT.format().strip() + "\n"
    if grouped:
        regroup = (_GROUPED_SPLIT, _GROUPED_CONCAT, ("_ungroup_qkv", "_group_qkv"))
    elif blocked is not None:
        blocks, order = blocked
        regroup = (
            _BLOCKED_SPLIT.format(blocks=blocks, order=order),
            _BLOCKED_CONCAT.format(blocks=blocks, order=order),
            ("_unblock_qkv", "_block_qkv"),
        )
    if regroup is not None:
        split_code, concat_code, helpers = regroup
        split_return = "    return dict(zip(parts, torch.split("
        split = split.replace(split_return, _indent(split_code) + split_return)
        concat = concat.replace(
            "    return torch.cat([pieces[position] for position in range(count)], dim=0)",
            "    stacked = torch.cat([pieces[position] for position in range(count)], dim=0)\n"
            + _indent(concat_code)
            + "    return stacked",
        )
        for helper in helpers:
            text = upsert_function(text, helper, snippet("adapter", helper), before_class=cls)
    text = upsert_method(text, cls, "_split_fused", split, after="_check_complete")
    text = upsert_method(text, cls, "_concat_fused", concat, after="_split_fused")
    return text


# --- routed experts fused on disk -------------------------------------------------------------

EXPERT_PARTS = {
    "gate_up": ["layers.{}.moe.experts.w1", "layers.{}.moe.experts.w3"],
    "up": ["layers.{}.moe.experts.w3"],
    "down": ["layers.{}.moe.experts.w2"],
}
# Their biases ([E, n], no transpose): BiasedGroupedExperts' w1_bias/w3_bias and w2_bias.
EXPERT_BIAS_PARTS = {
    "gate_up": ["layers.{}.moe.experts.w1_bias", "layers.{}.moe.experts.w3_bias"],
    "up": ["layers.{}.moe.experts.w3_bias"],
    "down": ["layers.{}.moe.experts.w2_bias"],
}


def fused_expert_keys(moe: MoEFeatures | None) -> dict[str, list[str]]:
    """Checkpoint keys that hold every expert of a layer's projection -> the Archon 3D
    weights they hold (gate/up: ``w1`` then ``w3``; down: ``w2``), from the report."""
    if moe is None or moe.expert_layout is not ExpertLayout.FUSED_3D:
        return {}
    up = "gate_up" if moe.expert_gate_up is not GateUpOrder.SEPARATE else "up"
    keys = {moe.expert_key_template: EXPERT_PARTS[up], moe.expert_down_key_template: EXPERT_PARTS["down"]}
    if moe.expert_bias and len(moe.expert_bias_key_templates) == 2:
        up_bias, down_bias = moe.expert_bias_key_templates
        keys.update({up_bias: EXPERT_BIAS_PARTS[up], down_bias: EXPERT_BIAS_PARTS["down"]})
    return keys


_EXPERTS_INIT = """
# Archon expert weight -> (the checkpoint tensor holding it, its position in that tensor).
self.fused_experts_to_hf_map = {
    part: (hf, position) for hf, parts in self.fused_experts_from_hf_map.items() for position, part in enumerate(parts)
}
"""

_EXPERTS_HF_KEY = """
if template in self.fused_experts_to_hf_map:
    return self.fused_experts_to_hf_map[template][0].format(*indices)  # the tensor it is part of
"""

_EXPERTS_FROM_HF_LOOP_OLD = """
for hf_key, value in hf_state_dict.items():
    archon_key = self._archon_key(hf_key)
    if archon_key is None:
        continue
    hf_template, indices = _abstract(hf_key)
    if hf_template.count("{}") != 2:
        state_dict[archon_key] = value
        continue
    # A per-expert 2D weight: collect it for stacking.
    layer_id, expert_id = indices[0], int(indices[1])
    if not self.moe_enabled or expert_id >= self.num_experts:
        raise KeyError(
            f"HF checkpoint key {hf_key!r} names expert {expert_id}, but the config has "
            f"{self.num_experts} experts per layer."
        )
    archon_template = self.from_hf_map[hf_template]
    experts_by_layer.setdefault(layer_id, {}).setdefault(archon_template, {})[expert_id] = value
"""

_EXPERTS_FROM_HF_LOOP_NEW = """
for hf_key, value in hf_state_dict.items():
    hf_template, indices = _abstract(hf_key)
    if hf_template in self.fused_experts_from_hf_map:
        # Every expert of one projection in one 3D tensor.
        state_dict.update(self._experts_from_hf(hf_key, hf_template, indices, value))
        continue
    archon_key = self._archon_key(hf_key)
    if archon_key is not None:
        state_dict[archon_key] = value
"""

_EXPERTS_TO_HF_LOOP_NEW = """
fused: dict[str, dict[int, Any]] = {}
for name, value in archon_state_dict.items():
    template, indices = _abstract(_strip_wrappers(name))
    if template in self.fused_experts_to_hf_map:
        hf_template, position = self.fused_experts_to_hf_map[template]
        fused.setdefault(hf_template.format(*indices), {})[position] = value
        continue
    for hf_key, tensor in self.convert_single_to_hf(name, value):
        hf_state_dict[hf_key] = tensor
for hf_key, pieces in fused.items():
    hf_state_dict[hf_key] = self._experts_to_hf(hf_key, pieces)
"""

_EXPERTS_FROM_HF = """
def _experts_from_hf(self, hf_key: str, template: str, indices: list[str], value: Any) -> dict[str, Any]:
    \"\"\"One checkpoint tensor holding a projection of every expert -> the Archon 3D weights in it.\"\"\"
    if not self.moe_enabled or value.shape[0] != self.num_experts:
        raise KeyError(
            f"HF checkpoint key {{hf_key!r}} holds {{value.shape[0]}} experts; the config has "
            f"{{self.num_experts if self.moe_enabled else 0}}."
        )
    parts = [part.format(*indices) for part in self.fused_experts_from_hf_map[template]]
{convert_in}    if len(parts) == 1:
        return {{parts[0]: weight}}
    return dict(zip(parts, split_gate_up(weight), strict=True))
"""

_EXPERTS_TO_HF = """
def _experts_to_hf(self, hf_key: str, pieces: dict[int, Any]) -> Any:
    \"\"\"The Archon 3D weights one checkpoint tensor holds, fused as the checkpoint stores them.\"\"\"
    template, _ = _abstract(hf_key)
    count = len(self.fused_experts_from_hf_map[template])
    if sorted(pieces) != list(range(count)):
        raise KeyError(f"{{hf_key!r}} holds {{count}} Archon expert weights; only parts {{sorted(pieces)}} were given.")
    weight = pieces[0] if count == 1 else merge_gate_up(pieces[0], pieces[1])
{convert_out}"""

_EXPERTS_JOIN = """
def join_single_to_hf(self, hf_key: str, pieces: list[Any]) -> Any:
    \"\"\"The checkpoint tensor ``hf_key`` from what ``convert_single_to_hf`` gave for it, one piece per
    Archon parameter in state-dict order: an expert tensor's weights fused as ``to_hf`` fuses them.\"\"\"
    template, _ = _abstract(hf_key)
    if template in self.fused_experts_from_hf_map:
        return self._experts_to_hf(hf_key, dict(enumerate(pieces)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
"""

_PER_EXPERT_INIT = (
    (
        "self._expert_templates = {\n"
        "    archon: hf for hf, archon in self.from_hf_map.items() if archon is not None and hf.count('{}') == 2\n}"
    ),
    "self._moe_converter = MoEWeightConverter()",
    "self._moe_state = MoEConversionState()",
)


def apply_fused_experts_adapter(
    text: Document, layout: PackageLayout, experts: dict[str, list[str]], moe: MoEFeatures
) -> Document:
    """Teach a copied MoE adapter (qwen3's) checkpoints that hold every expert of a
    projection in one 3D tensor: ``from_hf`` splits gate/up (in the probed order) and
    transposes (in, out) experts, ``to_hf`` fuses them back; the per-expert stacking goes."""
    cls = layout.adapter_class
    camel = layout.names.camel
    transposed = moe.expert_orientation is WeightOrientation.IN_OUT
    order = moe.expert_gate_up
    gate_up = next((k for k, parts in experts.items() if parts == EXPERT_PARTS["gate_up"]), "")
    down = next(k for k, parts in experts.items() if parts == EXPERT_PARTS["down"])
    stacking = {
        GateUpOrder.CONCATENATED: "the gate rows first, then the up rows",
        GateUpOrder.INTERLEAVED: "gate and up rows alternating, gate first",
        GateUpOrder.CONCATENATED_UP_FIRST: "the up rows first, then the gate rows",
        GateUpOrder.INTERLEAVED_UP_FIRST: "up and gate rows alternating, up first",
    }.get(order, "")
    orientation = (
        "each expert stored (in, out), transposed to ``nn.Linear``'s (out, in)"
        if transposed
        else "each expert stored as ``nn.Linear``'s (out, in)"
    )
    described = f"``{gate_up.replace('{}', '{L}')}`` (gate and up of every expert, {stacking}) and " if gate_up else ""
    text = set_docstring(
        text,
        None,
        "\n".join(
            [
                f"{camel} state dicts: Archon names <-> HuggingFace checkpoint names.",
                "",
                *textwrap.wrap(
                    f"Checkpoints store all experts of a layer's projection in one 3D tensor: {described}"
                    f"``{down.replace('{}', '{L}')}`` (down), {orientation}. Archon holds them as "
                    "``layers.{L}.moe.experts.w1``/``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]``; "
                    f"the adapter splits{', transposes' if transposed else ''} and fuses them back, changing no value."
                    + (
                        " The experts' biases ``[E, n]`` are split and fused the same way (no transpose) into "
                        "``w1_bias``/``w3_bias`` and ``w2_bias``."
                        if moe.expert_bias and len(experts) > 2
                        else ""
                    ),
                    width=88,
                    break_on_hyphens=False,
                ),
            ]
        )
        + "\n",
    )
    text = set_docstring(
        text,
        cls,
        f"Renames {camel} weights between Archon and HF checkpoints; splits and fuses expert tensors.\n\n"
        f"    ``model_config`` is a transformers config or a :class:`{camel}ModelArgs`. Every HF key\n"
        "    must be in ``from_hf_map`` (``None`` drops it) or in ``fused_experts_from_hf_map``;\n"
        "    anything else raises ``KeyError`` naming the key, so a checkpoint never loads with\n"
        "    weights silently lost.\n    ",
    )
    text = insert_class_statement_after(
        text,
        cls,
        "from_hf_map",
        "# Checkpoint tensors holding one projection of every expert -> the Archon weights in them, in order.\n"
        + _fused_literal(experts).replace(FUSED_MAP, FUSED_EXPERTS_MAP),
    )
    try:
        for statement in _PER_EXPERT_INIT:
            text = replace_in_function(text, cls, "__init__", statement, "")
        text = insert_after_statement_assigning(text, cls, "__init__", "self.to_hf_map", _EXPERTS_INIT.strip() + "\n")
        text = insert_after_statement_assigning(
            text, cls, "_hf_key", "template, indices", _EXPERTS_HF_KEY.strip() + "\n"
        )
        text = replace_in_function(
            text, cls, "from_hf", "experts_by_layer: dict[str, dict[str, dict[int, Any]]] = {}", ""
        )
        text = replace_in_function(
            text, cls, "from_hf", _EXPERTS_FROM_HF_LOOP_OLD.strip(), _EXPERTS_FROM_HF_LOOP_NEW.strip()
        )
        text = replace_in_function(text, cls, "from_hf", "state_dict.update(self._stack_experts(experts_by_layer))", "")
        text = replace_in_function(text, cls, "to_hf", _TO_HF_LOOP_OLD.strip(), _EXPERTS_TO_HF_LOOP_NEW.strip())
        text = replace_in_function(text, cls, "convert_single_to_hf", "experts = self._split_experts(name, tensor)", "")
        text = replace_in_function(text, cls, "convert_single_to_hf", "if experts is not None:\n    return experts", "")
    except CodemodError as e:
        raise CodemodError(f"3D expert tensors {sorted(experts)} need the qwen3 reference adapter: {e}") from e
    text = remove_method(text, cls, "_split_experts")
    text = remove_method(text, cls, "_stack_experts")
    if order is not GateUpOrder.SEPARATE:
        for role in ("split", "merge"):
            text = insert_before_class(
                text, cls, snippet("experts", f"{role}_{order.value}_gate_up", rename=f"{role}_gate_up")
            )
    convert_in = (
        "    weight = value.transpose(1, 2)  # the checkpoint stores each expert (in, out)\n"
        if transposed
        else "    weight = value\n"
    )
    convert_out = (
        "    return weight.transpose(1, 2).contiguous()  # each expert (in, out), as the checkpoint stores it\n"
        if transposed
        else "    return weight.contiguous()\n"
    )
    if transposed and moe.expert_bias:
        # The experts' biases ([E, n]) have no (in, out) to swap.
        convert_in = "    weight = value.transpose(1, 2) if value.dim() == 3 else value  # 3D: each expert (in, out)\n"
        convert_out = "    if weight.dim() == 2:\n        return weight.contiguous()  # a bias [E, n]\n" + convert_out
    text = upsert_method(
        text,
        cls,
        "_experts_from_hf",
        _EXPERTS_FROM_HF.format(convert_in=convert_in).strip() + "\n",
        after="_check_complete",
    )
    text = upsert_method(
        text,
        cls,
        "_experts_to_hf",
        _EXPERTS_TO_HF.format(convert_out=convert_out).strip() + "\n",
        after="_experts_from_hf",
    )
    text = upsert_method(text, cls, "join_single_to_hf", _EXPERTS_JOIN.strip() + "\n", after="convert_single_to_hf")
    return prune_unused_imports(text)


# --- projections stored (in, out) (transformers' Conv1D) --------------------------------------

TRANSPOSED = "transposed_hf_keys"

_FROM_HF_ORIENT = """
# Conv1D-stored projections arrive as (in, out); Archon's nn.Linear holds (out, in).
hf_state_dict = {key: self._oriented(key, value) for key, value in hf_state_dict.items()}
"""

_TRANSPOSE = """
def _oriented(self, hf_key: str, value: Any) -> Any:
    \"\"\"``value`` transposed when ``hf_key`` is stored (in, out) on disk (either direction).\"\"\"
    if _abstract(hf_key)[0] in self.transposed_hf_keys:
        return value.transpose(0, 1).contiguous()
    return value
"""


def apply_transposed_adapter(text: Document, layout: PackageLayout, keys: list[str]) -> Document:
    """Teach a copied adapter the checkpoint keys stored ``(in, out)`` (GPT-2's ``Conv1D``):
    ``from_hf`` transposes them before anything else (a fused one is then split like any
    other), ``convert_single_to_hf`` (and so ``to_hf``) transposes them back, after a fused
    key's parts are stacked. Kept apart from the fused layouts: either applies alone."""
    if not keys:
        return text
    cls = layout.adapter_class
    literal = (
        "# Checkpoint keys stored (in, out) (transformers' Conv1D); nn.Linear holds (out, in).\n"
        f"{TRANSPOSED}: ClassVar[frozenset[str]] = frozenset(\n    {{\n"
        + "".join(f'        "{key}",\n' for key in keys)
        + "    }\n)\n"
    )
    anchor = FUSED_MAP if FUSED_MAP in text else "from_hf_map"
    text = insert_class_statement_after(text, cls, anchor, literal)
    text = replace_text(
        text, "splits and re-stacks fused tensors.", "splits, re-stacks and transposes (Conv1D) tensors."
    )
    text = replace_text(text, "; no tensor is changed.", "; transposes Conv1D-stored tensors.")
    try:
        text = insert_after_statement_assigning(text, cls, "from_hf", "state_dict", _FROM_HF_ORIENT.strip() + "\n")
        text = replace_in_function(
            text,
            cls,
            "convert_single_to_hf",
            "return [(self._hf_key(name), tensor)]",
            "hf_key = self._hf_key(name)\nreturn [(hf_key, self._oriented(hf_key, tensor))]\n",
        )
        if "self._concat_fused(hf_key, pieces)" in text:
            text = replace_in_function(
                text,
                cls,
                "to_hf",
                "hf_state_dict[hf_key] = self._concat_fused(hf_key, pieces)",
                "hf_state_dict[hf_key] = self._oriented(hf_key, self._concat_fused(hf_key, pieces))",
            )
    except CodemodError as e:
        raise CodemodError(f"Conv1D-stored keys {keys} need the reference adapter's conversion methods: {e}") from e
    return upsert_method(text, cls, "_oriented", _TRANSPOSE.strip() + "\n", after="_hf_key")


CRITIC_DROP = """if self.model_args.is_critic and state_dict.pop("output.weight", None) is not None:
    logger.info("Dropped lm_head.weight: a critic has a score head instead.")
"""
CRITIC_DROP_WITH_BIAS = """if self.model_args.is_critic and state_dict.pop("output.weight", None) is not None:
    # The LM head's bias goes with its weight: a critic's strict load has no place for it.
    state_dict.pop("output.bias", None)
    logger.info("Dropped lm_head.weight and lm_head.bias: a critic has a score head instead.")
"""


def apply_head_bias_adapter(text: Document, layout: PackageLayout) -> Document:
    """A critic built from a checkpoint whose LM head has a bias drops that bias with the
    head's weight (``from_hf``), so AReaL's strict load of the critic meets no stray key."""
    if 'state_dict.pop("output.bias", None)' in text:
        return text
    try:
        return replace_in_function(text, layout.adapter_class, "from_hf", CRITIC_DROP, CRITIC_DROP_WITH_BIAS)
    except CodemodError as e:
        raise CodemodError(f"an LM head bias needs the reference adapter's critic branch in from_hf: {e}") from e


# --- tensors stored with leading unit axes ([1, E]) -----------------------------------------

UNIT_AXES = "unit_axes_hf_keys"

_FROM_HF_UNIT_AXES = """
# Tensors the checkpoint stores with leading unit axes ([1, E]) are held without them ([E]).
hf_state_dict = {
    key: _drop_unit_axes(value, self.unit_axes_hf_keys.get(_abstract(key)[0], 0))
    for key, value in hf_state_dict.items()
}
"""


def apply_unit_axes_adapter(text: Document, layout: PackageLayout, keys: dict[str, int]) -> Document:
    """Teach a copied adapter the checkpoint keys stored with leading axes of size 1
    (``{key template: axes}``; ERNIE-4.5's ``[1, E]`` score-correction bias, which
    AReaL's ``expert_bias`` holds as ``[E]``): ``from_hf`` drops the axes before anything
    else, ``convert_single_to_hf`` (and so ``to_hf``) puts them back, after a Conv1D
    transpose when that edit is there too."""
    if not keys:
        return text
    cls = layout.adapter_class
    literal = (
        "# Checkpoint keys stored with leading unit axes -> how many ([1, E] on disk, [E] in Archon).\n"
        f"{UNIT_AXES}: ClassVar[dict[str, int]] = {{\n"
        + "".join(f'    "{key}": {axes},\n' for key, axes in sorted(keys.items()))
        + "}\n"
    )
    anchor = next((name for name in (TRANSPOSED, FUSED_MAP) if name in text), "from_hf_map")
    text = insert_class_statement_after(text, cls, anchor, literal)
    restore = "_add_unit_axes({}, self.unit_axes_hf_keys.get(_abstract(hf_key)[0], 0))"
    try:
        text = insert_after_statement_assigning(text, cls, "from_hf", "state_dict", _FROM_HF_UNIT_AXES.strip() + "\n")
        if "_add_unit_axes(" in text:
            pass  # already taught (a second run changes nothing)
        else:
            if "return [(hf_key, self._oriented(hf_key, tensor))]" in text:
                old, value = "return [(hf_key, self._oriented(hf_key, tensor))]", "self._oriented(hf_key, tensor)"
                new = f"return [(hf_key, {restore.format(value)})]"
            else:
                old = "return [(self._hf_key(name), tensor)]"
                new = f"hf_key = self._hf_key(name)\nreturn [(hf_key, {restore.format('tensor')})]\n"
            text = replace_in_function(text, cls, "convert_single_to_hf", old, new)
    except CodemodError as e:
        raise CodemodError(
            f"keys stored with unit axes {sorted(keys)} need the reference adapter's conversion methods: {e}"
        ) from e
    for helper in ("_drop_unit_axes", "_add_unit_axes"):
        text = upsert_function(text, helper, snippet("adapter", helper), before_class=cls)
    return text


# --- differential attention: each head pair side by side -----------------------------------------

# DifferentialLambda's parameters, in the order of the analysis' lambda_keys (a, b, c, d).
DIFFERENTIAL_LAMBDA_PARTS = tuple(name for name, _ in DifferentialLambda(1).named_parameters())
PAIRED_HEADS = "paired_heads_hf_keys"
_PAIRED_ROLES = {"attention.wq": "q", "attention.wk": "kv", "attention.wv": "kv"}


def paired_head_keys(module_map: dict[str, str], shapes: dict[str, Any]) -> dict[str, str]:
    """The checkpoint keys (templates) of the q/k/v projections' weights and biases -> ``q`` or
    ``kv``: the rows the differential-attention adapter reorders."""
    keys: dict[str, str] = {}
    for hf, archon in module_map.items():
        role = _PAIRED_ROLES.get(archon.removeprefix("layers.{}."))
        if role is None:
            continue
        for param in ("weight", "bias"):
            if f"{hf}.{param}".replace("{}", "0") in shapes:
                keys[f"{hf}.{param}"] = role
    return keys


_FROM_HF_PAIRED = """
# Differential attention: each head pair (heads i and i + H/2) and its two KV heads side by side.
hf_state_dict = {key: self._paired_heads(key, value) for key, value in hf_state_dict.items()}
"""

_PAIRED_HEADS = """
def _paired_heads(self, hf_key: str, value: Any, *, to_hf: bool = False) -> Any:
    \"\"\"A q/k/v projection's rows in the checkpoint's head order -> each head pair's side by
    side (``to_hf``: back); any other tensor unchanged.\"\"\"
    role = self.paired_heads_hf_keys.get(_abstract(hf_key)[0])
    if role is None:
        return value
    args = self.model_args
    block = args.head_dim * (args.n_heads // args.n_kv_heads if role == "q" else 1)
    return _unpair_halves(value, block) if to_hf else _pair_halves(value, block)
"""


def apply_paired_heads_adapter(text: Document, layout: PackageLayout, keys: dict[str, str]) -> Document:
    """Teach a copied adapter differential attention's head order: the q/k/v projections'
    rows (``{key template: q | kv}``) hold each head pair (heads ``i`` and ``i + H/2``) and its
    two KV heads side by side, so that a tensor-parallel rank holds whole pairs. ``from_hf``
    reorders them before anything else, ``convert_single_to_hf`` (and so ``to_hf``) back."""
    if not keys or PAIRED_HEADS in text:
        return text
    cls = layout.adapter_class
    literal = (
        "# Checkpoint keys whose rows are attention heads stored pair by pair here -> q or kv heads.\n"
        f"{PAIRED_HEADS}: ClassVar[dict[str, str]] = {{\n"
        + "".join(f'    "{key}": "{role}",\n' for key, role in sorted(keys.items()))
        + "}\n"
    )
    anchor = next((name for name in (UNIT_AXES, TRANSPOSED, FUSED_MAP) if name in text), "from_hf_map")
    text = insert_class_statement_after(text, cls, anchor, literal)
    try:
        text = insert_after_statement_assigning(text, cls, "from_hf", "state_dict", _FROM_HF_PAIRED.strip() + "\n")
        text = replace_in_function(
            text,
            cls,
            "convert_single_to_hf",
            "return [(self._hf_key(name), tensor)]",
            "hf_key = self._hf_key(name)\nreturn [(hf_key, self._paired_heads(hf_key, tensor, to_hf=True))]\n",
        )
    except CodemodError as e:
        raise CodemodError(f"differential attention's head order needs the reference adapter's conversion: {e}") from e
    text = upsert_method(text, cls, "_paired_heads", _PAIRED_HEADS.strip() + "\n", after="_hf_key")
    for helper in ("_pair_halves", "_unpair_halves"):
        text = upsert_function(text, helper, snippet("adapter", helper), before_class=cls)
    return text


# --- keys transformers' load drops where the model lacks them ----------------------------------

IGNORED = "ignored_unexpected_hf_keys"

_FROM_HF_IGNORED = """
# Copies of a family's ignored keys on layers without their module: dropped, as transformers' load drops them.
hf_state_dict = {key: value for key, value in hf_state_dict.items() if not self._ignored_unexpected(key)}
"""

_IGNORED_UNEXPECTED = """
def _ignored_unexpected(self, hf_key: str) -> bool:
    \"\"\"Whether ``hf_key`` is one of the family's ignored keys (``ignored_unexpected_hf_keys``) on a layer
    whose Archon module lacks its parameter; a key with no map entry is kept (``from_hf`` names it).\"\"\"
    template, indices = _abstract(hf_key)
    target = self.from_hf_map.get(template) if template in self.ignored_unexpected_hf_keys else None
    if target is None or target.format(*indices) in self._expected_archon_keys():
        return False
    logger.debug("Dropped %s: no parameter on this layer (transformers ignores it too).", hf_key)
    return True
"""


def apply_ignored_keys_adapter(text: Document, layout: PackageLayout, keys: list[str]) -> Document:
    """Teach a copied adapter the checkpoint keys transformers' load drops where the model has no
    parameter for them (the analysis's ``ignored_unexpected``: A.X-K1's ``post_mlp_layernorm``,
    stored on every layer of a released checkpoint, held by the MoE layers only): ``from_hf``
    drops a copy whose mapped Archon parameter this config's model lacks, before anything else.
    Any reference's adapter takes it (each checks its keys against the model's)."""
    if not keys:
        return text
    cls = layout.adapter_class
    literal = (
        "# Checkpoint keys transformers' load ignores where the model lacks them (its ignore patterns).\n"
        f"{IGNORED}: ClassVar[frozenset[str]] = frozenset(\n    {{\n"
        + "".join(f'        "{key}",\n' for key in keys)
        + "    }\n)\n"
    )
    anchor = next((name for name in (UNIT_AXES, TRANSPOSED, FUSED_MAP) if name in text), "from_hf_map")
    text = insert_class_statement_after(text, cls, anchor, literal)
    try:
        text = insert_after_statement_assigning(text, cls, "from_hf", "state_dict", _FROM_HF_IGNORED.strip() + "\n")
    except CodemodError as e:
        raise CodemodError(f"ignored checkpoint keys {keys} need the reference adapter's from_hf: {e}") from e
    return upsert_method(text, cls, "_ignored_unexpected", _IGNORED_UNEXPECTED.strip() + "\n", after="_hf_key")


def _indent(block: str) -> str:
    return "".join(f"    {line}\n" if line else "\n" for line in block.strip().splitlines())
