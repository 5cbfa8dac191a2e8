"""Step 7: the TP plan of ``infra/parallelize.py`` made to match the model's modules."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable

from pydantic import Field

from skill.codemod import StagedTree
from skill.codemod.cst import edit_dict_literal, read_dict_literal, replace_in_function, set_docstring
from skill.porting.common import (
    PackageLayout,
    SourceRequest,
    StepResult,
    require_file,
    require_package,
    staged,
    write_if_changed,
)
from skill.porting.plan import PortPlan, plan_for

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
        else f"{camel} attention has no QK norm, so every projection hands local tensors straight to the "
        "attention (``use_local_output=True``). "
    )
    paragraph = "\n".join(textwrap.wrap(attention + bias_text, width=92, break_on_hyphens=False))
    return f"How a {camel} model is laid out over devices: {order}.\n\n{paragraph}\n" + (f"\n{moe}" if moe else "")


QK_NORM_IF = """if has_qk_norm:
    layer_plan["attention.q_norm"] = SequenceParallel(sequence_dim=2)
    layer_plan["attention.k_norm"] = SequenceParallel(sequence_dim=2)
"""


def _set_function_docstring(text: str, function: str, edit: Callable[[str], str]) -> str:
    """Rewrite a module-level function's docstring through ``edit`` (str -> str)."""
    import libcst as cst

    from skill.codemod.cst import replaced_code, statements

    module = cst.parse_module(text)
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == function:
            first = statements(stmt.body)[0]
            docstring = first.body[0] if isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1 else None
            if isinstance(docstring, cst.Expr) and isinstance(docstring.value, cst.SimpleString):
                old = docstring.value
                new_value = edit(old.value)
                if new_value != old.value:
                    return replaced_code(module, old, old.with_changes(value=new_value))
    return text


def _drop_qk_norm_plan(text: str) -> str:
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
    text = require_file(tree, layout.parallelize, "run copy_reference first.")
    profile = profile or plan_for(request.source, request.trust_remote_code)
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
    text = set_docstring(text, None, _docstring(layout.names.camel, profile))
    changed: list[str] = []
    write_if_changed(tree, layout.parallelize, text, changed)
    return WriteParallelizeResult(layer_plan=sorted(read_dict_literal(text, PLAN_TARGET)), changed_files=changed)
