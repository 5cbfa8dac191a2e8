"""Step 7: the TP plan of ``infra/parallelize.py`` made to match the model's modules."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable

import libcst as cst
from pydantic import Field

from skill.activations import ACTIVATIONS
from skill.analysis.reference import EDITABLE_REFERENCES
from skill.codemod import StagedTree
from skill.codemod.contract import append_to_if_block
from skill.codemod.cst import (
    Document,
    append_statements,
    class_code,
    edit_dict_literal,
    ensure_import_line,
    insert_before_class,
    insert_before_definition,
    read_all,
    read_dict_literal,
    replace_in_function,
    replace_text,
    set_docstring,
    set_module_assign,
    statements,
    upsert_function,
)
from skill.features import IN_QUERY_SUFFIX
from skill.porting.applied_edits import applies_rope, recorded_edits
from skill.porting.common import (
    PackageLayout,
    SourceRequest,
    StepResult,
    require_file,
    require_package,
    staged,
    write_if_changed,
)
from skill.porting.hybrid_package import HYBRID_REFERENCE
from skill.porting.plan import PortPlan, plan_for
from skill.snippets import snippet

logger = logging.getLogger(__name__)

PLAN_TARGET = "layer_plan"


class WriteParallelizeRequest(SourceRequest):
    pass


class WriteParallelizeResult(StepResult):
    layer_plan: list[str] = Field(description="module paths of the per-block TP plan")


def _docstring(camel: str, profile: PortPlan) -> str:
    bias = []
    if profile.qkv_bias:
        bias.append("q/k/v")
    if profile.o_bias:
        bias.append("output")
    bias_text = (
        f"Its {' and '.join(bias)} projections have biases, which ColwiseParallel/RowwiseParallel shard "
        "with their weights. "
        if bias
        else ""
    )
    moe = (
        "MoE layers: experts are sharded over EP (and TP), the block's input is gathered for the\n"
        "MoE and its partial output reduce-scattered back to the sequence shard; the router and\n"
        "shared-expert gates declare their gradients partial, so the backward sums them.\n"
        if profile.moe
        else ""
    )
    order = (
        "TP, EP, CP, activation checkpointing, compile, FSDP"
        if profile.moe
        else ("TP, CP, activation checkpointing, compile, FSDP")
    )
    attention = (
        f"{camel} attention normalises the full q/k projections, so ``wq``/``wk`` keep DTensor outputs "
        "(``use_local_output=False``) sharded over the features, and ``q_norm``/``k_norm`` run as "
        "``SequenceParallel(sequence_dim=-1)`` over that sharded width. "
        if profile.qk_norm == "full"
        else f"{camel} attention normalises each head's q/k, so ``wq``/``wk`` keep DTensor outputs "
        "(``use_local_output=False``) and ``q_norm``/``k_norm`` run as ``SequenceParallel(sequence_dim=2)`` "
        "over the sharded heads; the attention takes them local afterwards. "
        if profile.qk_norm == "per_head"
        else f"{camel} attention has no QK norm, so every projection hands local tensors straight to the "
        "attention (``use_local_output=True``). "
    )
    head_text = (
        "The LM head's bias is sharded with its vocabulary rows (``ColwiseParallel`` on ``output``), "
        "so each rank adds the bias of its own slice of the logits. "
        if profile.lm_head_bias
        else ""
    )
    paragraph = "\n".join(textwrap.wrap(attention + bias_text + head_text, width=92, break_on_hyphens=False))
    return f"How a {camel} model is laid out over devices: {order}.\n\n{paragraph}\n" + (f"\n{moe}" if moe else "")


QK_NORM_IF = """if has_qk_norm:
    layer_plan["attention.q_norm"] = SequenceParallel(sequence_dim=2)
    layer_plan["attention.k_norm"] = SequenceParallel(sequence_dim=2)
"""


PARALLELIZE_BLOCK = "parallelize_module(block, tp_mesh, layer_plan)"
SINKS_COMMENT = "# Each rank attends with its own heads, so it holds their sink logits (and their gradient)."
SHARD_SINKS = "block.attention.sinks = nn.Parameter(distribute_tensor(block.attention.sinks.data, tp_mesh, [Shard(0)]))"

ALIBI_COMMENT = "# Each rank attends with its own block of heads, so it takes the ALiBi slopes of that block."
ALIBI_OFFSET = "block.attention.head_offset = tp_mesh.get_local_rank() * (block.attention.n_heads // tp_mesh.size())"


def _set_function_docstring(text: Document, function: str, edit: Callable[[str], str]) -> Document:
    """Rewrite a module-level function's docstring through ``edit`` (str -> str)."""
    for stmt in text.module.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == function:
            first = statements(stmt.body)[0]
            docstring = first.body[0] if isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1 else None
            if isinstance(docstring, cst.Expr) and isinstance(docstring.value, cst.SimpleString):
                old = docstring.value
                new_value = edit(old.value)
                if new_value != old.value:
                    return text.replaced(old, old.with_changes(value=new_value))
    return text


def _drop_qk_norm_plan(text: Document) -> Document:
    function = next(name for name in ("apply_non_moe_tp", "apply_tp") if f"def {name}(" in text)
    text = edit_dict_literal(
        text,
        PLAN_TARGET,
        {
            "attention.wq": "ColwiseParallel(use_local_output=True)",
            "attention.wk": "ColwiseParallel(use_local_output=True)",
        },
        raw_values=True,
    )
    text = replace_in_function(text, None, function, QK_NORM_IF, "")
    text = _set_function_docstring(
        text,
        function,
        lambda doc: doc.replace("q/k/v column-wise (q/k as DTensors for the QK norms)", "q/k/v column-wise"),
    )
    return replace_in_function(
        text, None, function, 'has_qk_norm = getattr(block.attention, "q_norm", None) is not None', ""
    )


ROPE_ATTENTION_INPUTS = """# Only the hidden states are gathered; rope cache, positions, cu_seqlens
# and max_seqlen are the same plain tensors on every rank.
"attention": PrepareModuleInput(
    input_layouts=(Shard(1), None, None, None, None),
    desired_input_layouts=(Replicate(), None, None, None, None),
),"""
ATTENTION_INPUTS = """# Only the hidden states are gathered; cu_seqlens and max_seqlen are the
# same plain values on every rank.
"attention": PrepareModuleInput(
    input_layouts=(Shard(1), None, None),
    desired_input_layouts=(Replicate(), None, None),
),"""


def _plan_without_rope(text: Document) -> Document:
    """The attention of a family without RoPE takes ``(x, cu_seqlens, max_seqlen)``.

    The entry's comment goes with it where it is still there (a norm edit that removes the
    entry before it, ``attention_norm``, takes the comment along)."""
    if ATTENTION_INPUTS.splitlines()[3].strip() in text:
        return text
    old = textwrap.indent(ROPE_ATTENTION_INPUTS, " " * 12)
    if old in text:
        return replace_text(text, old, textwrap.indent(ATTENTION_INPUTS, " " * 12))
    layouts = "\n".join(ROPE_ATTENTION_INPUTS.splitlines()[2:5])
    if textwrap.indent(layouts, " " * 12) not in text:
        raise ValueError("the TP plan has no attention input layouts of the reference's form to drop RoPE from")
    new = "\n".join(ATTENTION_INPUTS.splitlines()[2:5])
    return replace_text(text, textwrap.indent(layouts, " " * 12), textwrap.indent(new, " " * 12))


EMBEDDING_STAGE = "model.tok_embeddings is not None"
POSITION_TABLE_PLAN = """# The position table is sharded like the token embedding: its rows over the ranks, the
# sum reduce-scattered to the same sequence shard the token embeddings land on.
root_plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
"""


SINUSOIDAL_TABLE_PLAN = """# Every rank computes the fixed position rows of the whole sequence and keeps the sequence
# shard the token embeddings land on.
root_plan["pos_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
"""


def _plan_position_table(text: Document, plan: str = POSITION_TABLE_PLAN) -> Document:
    function = next(name for name in ("apply_non_moe_tp", "apply_tp") if f"def {name}(" in text)
    if 'root_plan["pos_embeddings"]' in text:
        return text
    return append_to_if_block(text, None, function, EMBEDDING_STAGE, plan)


EMBEDDING_NORM_PLAN = """# The embedding norm runs on the sequence shard the token embeddings land on; its weight
# gradients are summed over the ranks.
root_plan["embedding_norm"] = SequenceParallel(use_local_output=True)
"""


def _plan_embedding_norm(text: Document) -> Document:
    function = next(name for name in ("apply_non_moe_tp", "apply_tp") if f"def {name}(" in text)
    if 'root_plan["embedding_norm"]' in text:
        return text
    return append_to_if_block(text, None, function, EMBEDDING_STAGE, EMBEDDING_NORM_PLAN)


PROJECT_IN_PLAN = """if model.project_in is not None:
    # The embedding projections run on the sequence shard with replicated weights, whose
    # gradients are summed over the ranks; project_in hands its output on local.
    root_plan["project_in"] = SequenceParallel(use_local_output=True)
"""
PROJECT_OUT_PLAN = """if model.project_out is not None:
    root_plan["project_out"] = SequenceParallel()
"""


FINAL_NORM_PLAN = """if model.norm is not None:
    root_plan["norm"] = SequenceParallel()
"""
# Without a final norm, project_out reads the last block's local sequence shard.
PROJECT_OUT_NO_NORM_PLAN = """if model.project_out is not None:
    # No final norm: project_out reads the last block's sequence shard itself.
    root_plan["project_out"] = SequenceParallel()
"""


def _plan_embedding_projection(text: Document, final_norm: bool = True) -> Document:
    """``project_in`` after the token embedding, ``project_out`` after the final norm (or the
    last block, without one), both where the model has them (the config's widths decide)."""
    function = _tp_function(text)
    if 'root_plan["project_in"]' in text:
        return text
    text = append_to_if_block(text, None, function, EMBEDDING_STAGE, PROJECT_IN_PLAN)
    if not final_norm:
        return text  # _plan_no_final_norm put project_out where the norm's entry was
    return append_to_if_block(text, None, function, "model.norm is not None", PROJECT_OUT_PLAN)


def _tp_function(text: Document) -> str:
    return next(name for name in ("apply_non_moe_tp", "apply_tp") if f"def {name}(" in text)


def _plan_no_final_norm(text: Document, projection: bool) -> Document:
    """No final norm: its plan entry goes (``project_out``'s takes its place, when there is one)."""
    if FINAL_NORM_PLAN.splitlines()[1].strip() not in text:
        return text
    return replace_in_function(
        text, None, _tp_function(text), FINAL_NORM_PLAN, PROJECT_OUT_NO_NORM_PLAN if projection else ""
    )


# AReaL's expert styles -> the package's, which shard the experts' biases with their weights.
BIASED_EXPERT_STYLES = {
    "TensorParallel()": "BiasedTensorParallel()",
    "ExpertParallel()": "BiasedExpertParallel()",
    "ExpertTensorParallel()": "BiasedExpertTensorParallel()",
}


def _plan_biased_experts(text: Document) -> Document:
    """Routed experts with biases: the package's expert-parallel styles (snippets/
    expert_parallel.py) shard ``w1_bias``/``w2_bias``/``w3_bias`` with the weights."""
    if "class BiasedExpertParallel(" in text:
        return text
    for name in ("shard_expert_parameters", *(v[: -len("()")] for v in BIASED_EXPERT_STYLES.values())):
        text = insert_before_class(text, "ReplicateParallel", snippet("expert_parallel", name))
    # The reference imports AReaL's styles and the placements already.
    text = ensure_import_line(text, "from torch.distributed.tensor import distribute_tensor")
    for old, new in BIASED_EXPERT_STYLES.items():
        text = replace_in_function(
            text,
            None,
            "apply_moe_ep_tp",
            f"experts_mesh, experts_plan = {_EXPERTS_MESH[old]}, {old}",
            f"experts_mesh, experts_plan = {_EXPERTS_MESH[old]}, {new}",
        )
    return text


_EXPERTS_MESH = {"TensorParallel()": "tp_mesh", "ExpertParallel()": "ep_mesh", "ExpertTensorParallel()": "ep_tp_mesh"}


PIPELINE_IMPORTS = (
    "import math",
    "from collections.abc import Callable",
    "from torch.distributed.pipelining import PipelineStage",
    "from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class",
    "from archon_models.pipeline_parallel import generate_llm_fqn_per_model_part, pipeline_module_split",
)


MOE_OUTPUT_NORM_PLAN = """if _is_moe_block(block):
    # The MoE's output reaches its norm as the local sequence shard (the MoE's output step
    # reduce-scattered the partial sum): a norm per token, whose replicated weight gets its
    # gradient summed over the TP ranks.
    layer_plan["moe_output_norm"] = SequenceParallel(use_local_output=True)"""


ROUTER_PARTIAL = '"moe.router.gate": partial_grad,'
PARTIAL_GRAD = "partial_grad = ReplicateParallel(local_output_grad_placements=(Partial(),))"
ROUTER_SCORES_BEFORE_EXPERTS = """# The routing weights scale the experts' input: tensor-parallel experts hand back that
# input's gradient summed over the TP ranks, so the router's is whole on every rank; only
# a reorderer's token slices (EP with etp=1) leave it partial.
"moe.router.gate": ReplicateParallel(
    local_output_grad_placements=(Partial() if ep_mesh is not None and etp == 1 else Replicate(),)
),"""


def _plan_router_scores_before_experts(text: Document) -> Document:
    """The router's gradient placement for ``score_before_experts`` (measured on Llama 4: declared
    partial, stage 5's gradients under tp=2 and ep=2 x tp=2 with etp=2 were off in 99 of 107
    tensors while the logits matched)."""
    if ROUTER_PARTIAL not in text:
        return text
    text = replace_text(text, ROUTER_PARTIAL, textwrap.indent(ROUTER_SCORES_BEFORE_EXPERTS, " " * 16).strip())
    if text.code.count("partial_grad") == 1:  # the router was its only user
        text = replace_in_function(text, None, "apply_moe_ep_tp", PARTIAL_GRAD, "")
    return text


def _plan_moe_output_norm(text: Document) -> Document:
    if 'layer_plan["moe_output_norm"]' in text:
        return text
    return replace_in_function(
        text, None, _tp_function(text), PARALLELIZE_BLOCK, f"{MOE_OUTPUT_NORM_PLAN}\n{PARALLELIZE_BLOCK}\n"
    )


# The package's replicated style, as the qwen3 reference writes it (its MoE gates use it).
REPLICATE_STYLE_SOURCE = "archon_models/qwen3/infra/parallelize.py"
REPLICATE_STYLE_IMPORTS = (
    "from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module",
    "from torch.distributed.tensor.parallel.style import ParallelStyle",
    "from torch.distributed.device_mesh import DeviceMesh",
)


# Where the reference splits the heads -> the differential check that follows it.
DIFFERENTIAL_CHECKS = {
    "validate_tp_constraints(model.model_args, tp_mesh.size())": (
        "validate_differential_pairs(model.model_args, tp_mesh.size())"
    ),
    "validate_cp_constraints(model.model_args, cp_size, tp_size)": (
        "validate_differential_pairs(model.model_args, cp_size * tp_size)"
    ),
}


def _plan_differential_lambda(text: Document, tree: StagedTree, layout: PackageLayout) -> Document:
    """Differential attention's lambda replicated on every TP rank, its gradient declared
    partial: each rank's heads contribute their share of it, and the backward sums them."""
    if "class ReplicateParallel(" not in text:
        reference = Document(require_file(tree, REPLICATE_STYLE_SOURCE, "the qwen3 reference package is missing."))
        text = insert_before_definition(text, layout.parallelize_fn, class_code(reference, "ReplicateParallel"))
        for line in REPLICATE_STYLE_IMPORTS:
            text = ensure_import_line(text, line)
    if "def validate_differential_pairs(" not in text:
        # Whole head pairs on every TP and Ulysses rank, checked where the heads are split.
        pairs = snippet("differential", "validate_differential_pairs")
        text = insert_before_definition(text, layout.parallelize_fn, pairs)
        for old, new in DIFFERENTIAL_CHECKS.items():
            function = _tp_function(text) if "tp_mesh" in old else "apply_cp"
            text = replace_in_function(text, None, function, old, f"{old}\n{new}")
    return edit_dict_literal(
        text,
        PLAN_TARGET,
        {"attention.diff_lambda": "ReplicateParallel(local_output_grad_placements=(Partial(),))"},
        raw_values=True,
    )


def _plan_indexer(text: Document) -> Document:
    """The sparse-attention indexer replicated on every TP rank: its parts take the gathered
    (replicated DTensor) hidden states and hand plain tensors on, so each rank picks the same
    keys for its own heads. No gradient reaches them (HF's indexer runs without one)."""
    parts = ("wq_b", "wk", "k_norm", "weights_proj")
    return edit_dict_literal(
        text, PLAN_TARGET, {f"attention.indexer.{part}": "ReplicateParallel()" for part in parts}, raw_values=True
    )


def _stage_modules_source(first: tuple[str, ...], last: tuple[str, ...]) -> str:
    return (
        "# Top-level modules besides AReaL's canonical ones (tok_embeddings, layers, norm, output/score):\n"
        "# the pipeline split keeps those run before the first block on the first stage, those run\n"
        "# after the final norm on the last, and would set them to None on every stage otherwise.\n"
        f"FIRST_STAGE_MODULES: tuple[str, ...] = {first!r}\n"
        f"LAST_STAGE_MODULES: tuple[str, ...] = {last!r}\n"
    )


def _plan_pipeline_stages(text: Document, layout: PackageLayout, profile: PortPlan) -> Document:
    """A model with top-level modules of its own around the blocks (an embedding norm, a
    position table, embedding projections) gets a pipelining function that keeps them on
    the stage that runs them (snippets/pipeline.py); AReaL's ``pipeline_llm`` would drop them."""
    first, last = profile.first_stage_modules, profile.last_stage_modules
    if not first and not last:
        return text
    name = layout.pipelining_fn
    if f"def {name}(" in text:
        text = set_module_assign(text, "FIRST_STAGE_MODULES", repr(first))
        return set_module_assign(text, "LAST_STAGE_MODULES", repr(last))
    text = append_statements(text, _stage_modules_source(first, last))
    text = upsert_function(text, name, snippet("pipeline", "pipeline_model", rename=name))
    for line in PIPELINE_IMPORTS:
        text = ensure_import_line(text, line)
    listed = read_all(text)
    return set_module_assign(text, "__all__", repr(sorted({*listed, name})).replace("'", '"'))


def write_parallelize(request: WriteParallelizeRequest) -> WriteParallelizeResult:
    """Make archon_models/<model_name>/infra/parallelize.py's TP plan match the model: plan
    entries only for modules the family has (e.g. no w3 for a two-layer MLP), local outputs
    without QK norm, biases sharded with their weights."""
    with staged(request.workspace) as tree:
        return apply_write_parallelize(tree, request)


def apply_write_parallelize(
    tree: StagedTree, request: WriteParallelizeRequest, profile: PortPlan | None = None
) -> WriteParallelizeResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    text = Document(require_file(tree, layout.parallelize, "run copy_reference first."))
    profile = profile or plan_for(request.source, request.trust_remote_code)
    if profile.reference == HYBRID_REFERENCE:
        # A hybrid's package has no TP plan: its layers are not tensor-parallel (the reference
        # refuses TP, CP and EP by name), and no edit changed its modules.
        return WriteParallelizeResult(layer_plan=[], changed_files=[])
    if profile.reference not in EDITABLE_REFERENCES:
        # The reference's plan follows its modules as the config builds them; of the edits, only
        # the block's norm on the MoE output adds a module to plan.
        written: list[str] = []
        if profile.moe_output_norm:
            text = _plan_moe_output_norm(text)
        if profile.indexer is not None:
            text = _plan_indexer(text)
        if profile.moe_output_norm or profile.indexer is not None:
            write_if_changed(tree, layout.parallelize, text.code, written)
        return WriteParallelizeResult(layer_plan=sorted(read_dict_literal(text, PLAN_TARGET)), changed_files=written)
    if profile.qk_norm != "per_head" and "has_qk_norm" in text:
        # The qwen3 reference decides per block for its per-head norms; a family without
        # them keeps local outputs (a full-width norm is planned below).
        text = _drop_qk_norm_plan(text)
    remove = ["feed_forward.w3"] if profile.mlp == "plain" else []
    if profile.block == "post_norm":
        remove += ["attention_norm", "ffn_norm"]
        # The sub-layers read the sequence-sharded residual itself; their outputs are
        # normalised on the shard the row-wise projections reduce-scatter to.
        text = edit_dict_literal(
            text,
            PLAN_TARGET,
            {
                "post_attention_norm": "SequenceParallel(use_local_output=True)",
                "post_ffn_norm": "SequenceParallel(use_local_output=True)",
            },
            raw_values=True,
        )
    if profile.block == "post_ln":
        # The norms read the residual sums (local sequence shards, as the row-wise output
        # projections reduce-scatter them) and hand the next sub-layer and residual a local shard.
        text = edit_dict_literal(
            text,
            PLAN_TARGET,
            {
                "attention_norm": "SequenceParallel(use_local_output=True)",
                "ffn_norm": "SequenceParallel(use_local_output=True)",
            },
            raw_values=True,
        )
    if profile.qk_norm == "per_head" and "has_qk_norm" not in text:
        # Per-head QK norm on a copy without qwen3's per-block rule: wq/wk hand DTensors
        # whose heads are sharded to norms that run sequence-parallel over the heads dim.
        text = edit_dict_literal(
            text,
            PLAN_TARGET,
            {
                "attention.wq": "ColwiseParallel(use_local_output=False)",
                "attention.wk": "ColwiseParallel(use_local_output=False)",
                "attention.q_norm": "SequenceParallel(sequence_dim=2)",
                "attention.k_norm": "SequenceParallel(sequence_dim=2)",
            },
            raw_values=True,
        )
    if profile.block == "parallel" and profile.shared_block_norm:
        remove += ["ffn_norm"]  # attention_norm's sequence-sharded output feeds both branches
    if profile.qk_norm == "full" and "has_qk_norm" not in text:
        # Full-width QK norm: wq/wk hand DTensors sharded over the features to norms that
        # reduce over that sharded width; the norms' weights are replicated DTensors whose
        # gradients are summed over the TP ranks.
        text = edit_dict_literal(
            text,
            PLAN_TARGET,
            {
                "attention.wq": "ColwiseParallel(use_local_output=False)",
                "attention.wk": "ColwiseParallel(use_local_output=False)",
                "attention.q_norm": "SequenceParallel(sequence_dim=-1, use_local_output=True)",
                "attention.k_norm": "SequenceParallel(sequence_dim=-1, use_local_output=True)",
            },
            raw_values=True,
        )
    text = edit_dict_literal(text, PLAN_TARGET, remove=remove)
    if profile.expert_bias:
        text = _plan_biased_experts(text)
    activation = ACTIVATIONS.get(profile.activation)
    if activation is not None and activation.module and not profile.all_layers_moe:
        # A learned activation sees w1's feature shard: its parameters are replicated DTensors
        # whose gradients are summed over the TP ranks; local output for w2.
        text = edit_dict_literal(
            text,
            PLAN_TARGET,
            {"feed_forward.act_fn": "SequenceParallel(sequence_dim=-1, use_local_output=True)"},
            raw_values=True,
        )
    if profile.output_gate is not None and not profile.output_gate.endswith(IN_QUERY_SUFFIX):
        # The gate projection splits like wq: each rank gates the heads it attends with.
        text = edit_dict_literal(text, PLAN_TARGET, {"attention.wg": "ColwiseParallel()"}, raw_values=True)
    # A norm over the full width a column-wise projection shards (all heads, the hidden units):
    # the shards are gathered for it, whatever it computes, and the row-wise projection takes its
    # own slice of the replicated result locally.
    gathered = (
        "PrepareModuleInput(input_layouts=(Shard(-1),), desired_input_layouts=(Replicate(),), use_local_output=True)"
    )
    row_wise = "RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))"
    if profile.attn_sub_norm:
        text = edit_dict_literal(
            text, PLAN_TARGET, {"attention.sub_norm": gathered, "attention.wo": row_wise}, raw_values=True
        )
    if profile.ffn_sub_norm and not profile.all_layers_moe:
        text = edit_dict_literal(
            text, PLAN_TARGET, {"feed_forward.sub_norm": gathered, "feed_forward.w2": row_wise}, raw_values=True
        )
    if profile.differential_attention:
        text = _plan_differential_lambda(text, tree, layout)
    if profile.moe_output_norm:
        text = _plan_moe_output_norm(text)
    if profile.score_before_experts:
        text = _plan_router_scores_before_experts(text)
    if profile.block == "sandwich":
        # Norms on the sub-layer outputs run on the sequence shard the row-wise projections
        # reduce-scatter to; local outputs, because they are added to the local residual.
        text = edit_dict_literal(
            text,
            PLAN_TARGET,
            {
                "post_attention_norm": "SequenceParallel(use_local_output=True)",
                "post_ffn_norm": "SequenceParallel(use_local_output=True)",
            },
            raw_values=True,
        )
    if profile.attn_sinks and SHARD_SINKS not in text:
        # Each rank attends with its own heads, so it holds (and gets the gradient of) their sinks.
        function = next(name for name in ("apply_non_moe_tp", "apply_tp") if f"def {name}(" in text)
        text = replace_in_function(
            text, None, function, PARALLELIZE_BLOCK, f"{PARALLELIZE_BLOCK}\n{SINKS_COMMENT}\n{SHARD_SINKS}\n"
        )
        text = ensure_import_line(text, "from torch.distributed.tensor import distribute_tensor")
    if profile.positions == "alibi" and ALIBI_OFFSET not in text:
        function = next(name for name in ("apply_non_moe_tp", "apply_tp") if f"def {name}(" in text)
        text = replace_in_function(
            text, None, function, PARALLELIZE_BLOCK, f"{PARALLELIZE_BLOCK}\n{ALIBI_COMMENT}\n{ALIBI_OFFSET}\n"
        )
    if not applies_rope(profile.positions, recorded_edits(tree.read_text(layout.model) or "")):
        text = _plan_without_rope(text)
    if profile.positions == "learned":
        text = _plan_position_table(text)
    if profile.positions == "sinusoidal":
        text = _plan_position_table(text, SINUSOIDAL_TABLE_PLAN)
        text = ensure_import_line(text, "from torch.distributed.tensor.parallel import PrepareModuleOutput")
    if profile.embedding_norm_module is not None:
        text = _plan_embedding_norm(text)
    if not profile.final_norm:
        text = _plan_no_final_norm(text, projection=profile.embedding_projection_field is not None)
    if profile.embedding_projection_field is not None:
        text = _plan_embedding_projection(text, final_norm=profile.final_norm)
    text = _plan_pipeline_stages(text, layout, profile)
    text = set_docstring(text, None, _docstring(layout.names.camel, profile))
    changed: list[str] = []
    write_if_changed(tree, layout.parallelize, text.code, changed)
    return WriteParallelizeResult(layer_plan=sorted(read_dict_literal(text, PLAN_TARGET)), changed_files=changed)
