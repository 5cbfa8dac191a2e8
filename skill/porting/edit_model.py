"""Step 4: specialise ``model.py`` with the named feature edits the family needs."""

from __future__ import annotations

import logging

from pydantic import Field

from skill.codemod import StagedTree
from skill.porting.common import PackageLayout, PackageRequest, StepResult, require_file, require_package, staged, write_if_changed
from skill.porting.family import FamilyProfile, detect_family
from skill.porting.model_edits import EditContext, apply_model_edits, select_edits

logger = logging.getLogger(__name__)


class EditModelRequest(PackageRequest):
    source: str = Field(description="model_type or config path of the family (its measured features pick the edits)")
    edits: list[str] | None = Field(
        default=None, description="edit names to apply (default: every edit the family's features call for)"
    )


class EditModelResult(StepResult):
    edits: list[str] = Field(description="edits applied, in order")


def edit_model(request: EditModelRequest) -> EditModelResult:
    """Apply named feature edits to archon_models/<model_name>/model/model.py: projection
    biases, sliding window, (1 + w) RMSNorm, LayerNorm, MLP kind and activation, embedding
    and residual scalars, logits scaling. By default the edits the family of `source`
    needs. Fails before writing when the family has a feature no edit supports."""
    with staged(request.workspace) as tree:
        return apply_edit_model(tree, request)


def unsupported_features(profile: FamilyProfile) -> list[str]:
    """Features of the family that neither the reference nor any edit reproduces."""
    found = list(profile.unsupported)
    if profile.block == "post_norm" and profile.norm != "rms":
        found.append(f"post-norm blocks with a {profile.norm} norm")
    return found


def apply_edit_model(tree: StagedTree, request: EditModelRequest, profile: FamilyProfile | None = None) -> EditModelResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    text = require_file(tree, layout.model, "run copy_reference first.")
    profile = profile or detect_family(request.source)
    missing = unsupported_features(profile)
    if missing:
        raise ValueError(
            f"{profile.model_type} has feature(s) no edit supports: {', '.join(missing)}. "
            "Teach the engine an edit for them (skill/porting/model_edits.py) before porting."
        )
    names = request.edits if request.edits is not None else select_edits(profile, text)
    ctx = EditContext(camel=layout.names.camel, model_class=layout.model_class, profile=profile)
    new_text = apply_model_edits(text, ctx, names)
    changed: list[str] = []
    write_if_changed(tree, layout.model, new_text, changed)
    logger.info("model edits for %s: %s", layout.names.package, ", ".join(names) or "none")
    return EditModelResult(edits=names, changed_files=changed)
