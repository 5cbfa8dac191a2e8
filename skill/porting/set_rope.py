"""Step 5: the package's RoPE, re-exported from the reference when the formula is the same."""

from __future__ import annotations

import logging

from pydantic import Field

from skill.codemod import StagedTree
from skill.porting.common import PackageLayout, PackageRequest, StepResult, staged, write_if_changed
from skill.porting.family import ROPE_TYPES, FamilyProfile, detect_family

logger = logging.getLogger(__name__)

ROPE_NAMES = ("apply_rotary_emb", "precompute_rope_cache", "repeat_kv", "reshape_for_broadcast", "rotate_half")


def reexport_source(camel: str) -> str:
    names = "".join(f"    {n},\n" for n in ROPE_NAMES)
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    return (
        f'"""{camel} RoPE: HF\'s default rotary embedding, the same formula as Qwen2\'s, re-exported."""\n\n'
        f"from archon_models.qwen2.model.rope import (\n{names})\n\n__all__ = [\n{listed}]\n"
    )


class SetRopeRequest(PackageRequest):
    source: str = Field(description="model_type or config path of the family")


class SetRopeResult(StepResult):
    rope_type: str
    reexported: bool


def set_rope(request: SetRopeRequest) -> SetRopeResult:
    """Write archon_models/<model_name>/model/rope.py: a re-export of the qwen2 reference's
    RoPE when the family uses HF's default formula; a variant otherwise (fails naming the
    rope_type when no variant is implemented)."""
    with staged(request.workspace) as tree:
        return apply_set_rope(tree, request)


def apply_set_rope(tree: StagedTree, request: SetRopeRequest, profile: FamilyProfile | None = None) -> SetRopeResult:
    layout = PackageLayout.for_name(request.model_name)
    profile = profile or detect_family(request.source)
    if profile.rope_type not in ROPE_TYPES or profile.partial_rotary:
        raise ValueError(
            f"rope_type {profile.rope_type!r}{' with partial rotary' if profile.partial_rotary else ''} has no "
            f"implementation in the engine (supported: {', '.join(ROPE_TYPES)})."
        )
    changed: list[str] = []
    write_if_changed(tree, layout.rope, reexport_source(layout.names.camel), changed)
    return SetRopeResult(rope_type=profile.rope_type, reexported=True, changed_files=changed)
