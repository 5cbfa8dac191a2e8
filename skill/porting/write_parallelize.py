"""Step 7: the TP plan of ``infra/parallelize.py`` made to match the model's modules."""

from __future__ import annotations

import logging

from pydantic import Field

from skill.codemod import StagedTree
from skill.codemod.cst import edit_dict_literal, read_dict_literal, set_docstring
from skill.porting.common import PackageLayout, PackageRequest, StepResult, require_file, staged, write_if_changed
from skill.porting.family import FamilyProfile, detect_family

logger = logging.getLogger(__name__)

PLAN_TARGET = "layer_plan"


class WriteParallelizeRequest(PackageRequest):
    source: str = Field(description="model_type or config path of the family")


class WriteParallelizeResult(StepResult):
    layer_plan: list[str] = Field(description="module paths of the per-block TP plan")


def _docstring(camel: str, profile: FamilyProfile) -> str:
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
    return (
        f"How a {camel} model is laid out over devices: TP, CP, activation checkpointing, compile, FSDP.\n\n"
        f"{camel} attention has no QK norm, so every projection hands local tensors straight to the\n"
        f"attention (``use_local_output=True``). {bias_text}\n"
    ).replace(" \n", "\n")


def write_parallelize(request: WriteParallelizeRequest) -> WriteParallelizeResult:
    """Make archon_models/<model_name>/infra/parallelize.py's TP plan match the model: plan
    entries only for modules the family has (e.g. no w3 for a two-layer MLP), local outputs
    without QK norm, biases sharded with their weights."""
    with staged(request.workspace) as tree:
        return apply_write_parallelize(tree, request)


def apply_write_parallelize(
    tree: StagedTree, request: WriteParallelizeRequest, profile: FamilyProfile | None = None
) -> WriteParallelizeResult:
    layout = PackageLayout.for_name(request.model_name)
    text = require_file(tree, layout.parallelize, "run copy_reference first.")
    profile = profile or detect_family(request.source)
    if profile.qk_norm != "none" or profile.moe:
        raise ValueError("TP plans for QK norm or MoE come from the qwen3 reference; copy qwen3 for this family.")
    remove = ["feed_forward.w3"] if profile.mlp == "plain" else []
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
