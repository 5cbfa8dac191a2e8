"""Step 4: specialise ``model.py`` with the named feature edits the family needs."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from skill.analysis.reference import EDITABLE_REFERENCES
from skill.codemod import StagedTree
from skill.codemod.contract import add_marker
from skill.codemod.cst import Document
from skill.features import HandEditPlace
from skill.porting.applied_edits import stamp_generated_line
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
from skill.porting.hybrid_package import HYBRID_REFERENCE
from skill.porting.model_edits import MLA_MODEL_EDITS, EditContext, edit_catalogue, edit_document, select_edits
from skill.porting.plan import PortPlan, plan_for, refuse_unedited_reference, refuse_unsupported, skipped_features

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MarkerPlace:
    """Where the hand edit of a feature goes in the Archon module contract: a function of a
    class (``None``: the model class), above the statement holding ``anchor`` when it has one."""

    keywords: tuple[str, ...]
    class_name: str | None
    function: str
    anchor: str | None = None

    def where(self, model_class: str) -> str:
        return f"{self.class_name or model_class}.{self.function}"


# The statement where an attention applies RoPE: the order of q/k norms, clipping or no
# rotation at all is decided there.
ROPE_STATEMENT = "apply_rotary_emb("
_EMBEDDING_STATEMENT = "self.tok_embeddings(tokens)"
# A feature's place is the one named by the word that comes first in the feature's name (its
# subject): "full-width QK norm after RoPE" is about the QK norm, not about RoPE.
MARKER_PLACES: tuple[MarkerPlace, ...] = (
    MarkerPlace(("router", "expert", "moe", "mixture"), "TransformerBlock", "__init__"),
    MarkerPlace(("without rope",), "Attention", "forward", ROPE_STATEMENT),
    MarkerPlace(("qk", "q/k", "query", "key", "attention", "sink", "window", "clip", "alibi"), "Attention", "forward"),
    MarkerPlace(("rope", "rotary", "rotation"), None, "_precompute_rope_cache"),
    MarkerPlace(("embedding", "position"), None, "forward", _EMBEDDING_STATEMENT),
    MarkerPlace(("logit", "lm head"), None, "forward", "head = "),
    MarkerPlace(("norm",), "TransformerBlock", "forward"),
    MarkerPlace(("ffn", "mlp", "activation", "feed", "swiglu"), "FeedForward", "forward"),
)
_DEFAULT_PLACE = MarkerPlace((), "TransformerBlock", "forward")


def marker_place(feature: str) -> MarkerPlace:
    """The place of an unsupported feature's hand edit, by the first word of its name that
    names a part of the module contract. An attention feature that concerns RoPE is marked
    where the attention applies RoPE."""
    words = feature.lower().removeprefix("unsupported: ")
    hits = [(words.find(k), i) for i, place in enumerate(MARKER_PLACES) for k in place.keywords if k in words]
    if not hits:
        return _DEFAULT_PLACE
    place = MARKER_PLACES[min(hits)[1]]
    if place.class_name == "Attention" and place.anchor is None and ("rope" in words or "rotary" in words):
        return MarkerPlace(place.keywords, place.class_name, place.function, ROPE_STATEMENT)
    return place


class EditModelRequest(SourceRequest):
    edits: list[str] | None = Field(
        default=None,
        description="edit names to apply, in place of the default: every edit the family's features call for "
        "(a call without it returns those in `edits`; pass them too when adding one the analysis did not "
        f"select). On the deepseek_v3 reference only {', '.join(MLA_MODEL_EDITS)}. The edits: {edit_catalogue()}",
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


def hand_edit_place(feature: str, places: Mapping[str, HandEditPlace]) -> HandEditPlace | MarkerPlace:
    """Where the hand edit of ``feature`` goes: the place the analysis measured, else (a feature it
    cannot place) the place its name's keywords point at."""
    name = feature.removeprefix("unsupported: ")
    return places.get(name) or marker_place(name)


def mark_hand_edits(
    text: Document, features: list[str], model_class: str, places: Mapping[str, HandEditPlace] | None = None
) -> Document:
    """A marker comment per unsupported feature, at the place its hand edit goes."""
    for feature in features:
        name = feature.removeprefix("unsupported: ")
        place = hand_edit_place(name, places or {})
        class_name = place.class_name or model_class
        comment = f"{HAND_EDIT_MARKER.removeprefix('# ')} {name}"
        text = add_marker(text, class_name, place.function, comment, place.anchor)
    return text


def apply_edit_model(tree: StagedTree, request: EditModelRequest, plan: PortPlan | None = None) -> EditModelResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    text = require_file(tree, layout.model, "run copy_reference first.")
    plan = plan or plan_for(request.source, request.trust_remote_code)
    if not request.allow_unsupported:
        refuse_unsupported(plan, "edit_model")
    elif plan.unsupported:
        refuse_unedited_reference(plan, "edit_model")
    foreign = [name for name in request.edits or () if name not in MLA_MODEL_EDITS]
    if plan.reference == HYBRID_REFERENCE and request.edits:
        # The analysis took the hybrid only where the reference's modules compute it.
        raise ValueError(
            f"no model edit targets the {plan.reference} reference's modules; {', '.join(request.edits)} cannot "
            f"apply to {request.model_name}."
        )
    if plan.reference not in EDITABLE_REFERENCES and foreign:
        # Only the block-contract edits of MLA_MODEL_EDITS target this reference's modules.
        raise ValueError(
            f"no model edit but {', '.join(MLA_MODEL_EDITS)} targets the {plan.reference} reference's modules; "
            f"{', '.join(foreign)} cannot apply to {request.model_name}."
        )
    names = request.edits if request.edits is not None else select_edits(plan, text)
    ctx = EditContext(camel=layout.names.camel, model_class=layout.model_class, profile=plan)
    edited = edit_document(Document(text), ctx, names)
    skipped = skipped_features(plan, request.allow_unsupported)
    if skipped:
        edited = mark_hand_edits(edited, skipped, layout.model_class, plan.hand_edit_places)
    code = edited.code
    if request.edits is not None:
        # Named edits may differ from the analysis' selection: record them where the later steps read them.
        code = stamp_generated_line(code, plan.reference, names)
    changed: list[str] = []
    write_if_changed(tree, layout.model, code, changed)
    logger.info("model edits for %s: %s", layout.names.package, ", ".join(names) or "none")
    return EditModelResult(edits=names, skipped_features=skipped, changed_files=changed)
