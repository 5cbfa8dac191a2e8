"""Step 4: specialise ``model.py`` with the named feature edits the family needs."""

from __future__ import annotations

import logging

from pydantic import Field

from skill.analysis.reference import EDITABLE_REFERENCES
from skill.codemod import StagedTree
from skill.codemod.contract import add_marker
from skill.codemod.cst import Document
from skill.porting.common import (
    HAND_EDIT_MARKER,
    PackageLayout,
    SourceRequest,
    StepResult,
    require_file,
    require_package,
    staged,
    write_if_changed,
)
from skill.porting.model_edits import MLA_MODEL_EDITS, EditContext, edit_document, select_edits
from skill.porting.plan import PortPlan, plan_for, refuse_unsupported

logger = logging.getLogger(__name__)


# Where the hand edit for an unsupported feature goes, by the words of its name: the
# first function of the Archon module contract whose part the feature belongs to.
_MARKER_PLACES: tuple[tuple[tuple[str, ...], str | None, str], ...] = (
    (("router", "expert", "moe", "mixture"), "TransformerBlock", "__init__"),
    # A per-layer choice of rotating q/k or not is made where the attention applies RoPE.
    (("without rope",), "Attention", "forward"),
    (("rope", "rotary", "position", "alibi"), None, "_precompute_rope_cache"),
    (("attention", "qk", "query", "key", "sink", "window", "clip", "head", "projection"), "Attention", "forward"),
    (("norm",), "TransformerBlock", "forward"),
    (("ffn", "mlp", "activation", "feed"), "FeedForward", "forward"),
    (("embedding",), None, "forward"),
    (("logit", "head", "lm"), None, "forward"),
)


class EditModelRequest(SourceRequest):
    edits: list[str] | None = Field(
        default=None, description="edit names to apply (default: every edit the family's features call for)"
    )
    allow_unsupported: bool = Field(
        default=False,
        description="apply every supported edit even when the family has unsupported features; each skipped "
        "feature is returned and marked in model.py where its hand edit goes",
    )


class EditModelResult(StepResult):
    edits: list[str] = Field(description="edits applied, in order")
    skipped_features: list[str] = Field(
        default_factory=list, description="unsupported features left for a hand edit (marked in model.py)"
    )


def edit_model(request: EditModelRequest) -> EditModelResult:
    """Apply named feature edits to archon_models/<model_name>/model/model.py: projection
    biases, QK norm, sliding window, soft-capping, norm kind and placement, MLP kind and
    activation, embedding, residual and logit scalars, RoPE cache. By default the edits
    the analysis of `source` calls for. Fails before writing when the family has a
    feature no edit supports, unless allow_unsupported, which applies the rest and marks
    where each hand edit goes."""
    with staged(request.workspace) as tree:
        return apply_edit_model(tree, request)


def _marker_place(feature: str, model_class: str) -> tuple[str | None, str]:
    words = feature.lower()
    for keys, class_name, func in _MARKER_PLACES:
        if any(k in words for k in keys):
            return (model_class if class_name is None else class_name), func
    return "TransformerBlock", "forward"


def mark_hand_edits(text: Document, features: list[str], model_class: str) -> Document:
    """A marker comment per unsupported feature, at the place its hand edit goes."""
    for feature in features:
        name = feature.removeprefix("unsupported: ")
        class_name, func = _marker_place(name, model_class)
        text = add_marker(text, class_name, func, f"{HAND_EDIT_MARKER.removeprefix('# ')} {name}")
    return text


def apply_edit_model(tree: StagedTree, request: EditModelRequest, plan: PortPlan | None = None) -> EditModelResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    text = require_file(tree, layout.model, "run copy_reference first.")
    plan = plan or plan_for(request.source, request.trust_remote_code)
    if not request.allow_unsupported:
        refuse_unsupported(plan, "edit_model")
    foreign = [name for name in request.edits or () if name not in MLA_MODEL_EDITS]
    if plan.reference not in EDITABLE_REFERENCES and foreign:
        # Only the block-contract edits of MLA_MODEL_EDITS target this reference's modules.
        raise ValueError(
            f"no model edit but {', '.join(MLA_MODEL_EDITS)} targets the {plan.reference} reference's modules; "
            f"{', '.join(foreign)} cannot apply to {request.model_name}."
        )
    names = request.edits if request.edits is not None else select_edits(plan, text)
    ctx = EditContext(camel=layout.names.camel, model_class=layout.model_class, profile=plan)
    edited = edit_document(Document(text), ctx, names)
    skipped = list(plan.unsupported) if request.allow_unsupported else []
    if skipped:
        edited = mark_hand_edits(edited, skipped, layout.model_class)
    changed: list[str] = []
    write_if_changed(tree, layout.model, edited.code, changed)
    logger.info("model edits for %s: %s", layout.names.package, ", ".join(names) or "none")
    return EditModelResult(edits=names, skipped_features=skipped, changed_files=changed)
