"""Step 5: the package's RoPE, re-exported from the reference when the formula is the same."""

from __future__ import annotations

import logging
import textwrap

from skill.analysis.reference import EDITABLE_REFERENCES
from skill.codemod import StagedTree
from skill.errors import HAND_PORT_POINTER
from skill.porting.applied_edits import applies_rope, recorded_edits
from skill.porting.common import PackageLayout, SourceRequest, StepResult, require_package, staged, write_if_changed
from skill.porting.plan import PortPlan, plan_for
from skill.snippets import snippet

logger = logging.getLogger(__name__)

ROPE_NAMES = ("apply_rotary_emb", "precompute_rope_cache", "repeat_kv", "reshape_for_broadcast", "rotate_half")


# The generated files' line length (pyproject's ruff setting).
LINE_LIMIT = 120


def reexport_source(camel: str, rotary: bool = True) -> str:
    names = "".join(f"    {n},\n" for n in ROPE_NAMES)
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    doc = (
        f"{camel} RoPE: HF's default rotary embedding, the same formula as Qwen2's, re-exported."
        if rotary
        else f"{camel} applies no RoPE; Qwen2's helpers are re-exported for the package layout (``repeat_kv``)."
    )
    return f'"""{doc}"""\n\nfrom archon_models.qwen2.model.rope import (\n{names})\n\n__all__ = [\n{listed}]\n'


def composed_source(camel: str, rope_type: str, partial: bool, interleaved: bool = False) -> str:
    """A rope.py for any combination of the pairing (halves or adjacent pairs), the
    checkpoint's frequency scaling (``rope_type`` other than default) and partial rotary,
    assembled from the tested functions of ``skill/snippets/rope.py``; what equals
    Qwen2's is re-exported from it."""
    scaled = rope_type != "default"
    what = []
    if interleaved:
        what.append("adjacent features rotating together (interleaved pairing)")
    if scaled:
        what.append(f"{rope_type} frequency scaling")
    if partial:
        what.append("rotation of the first ``rotary_dim`` features of each head only")
    own = set()
    body: list[str] = []
    if scaled:
        body.append(snippet("rope", f"{rope_type}_frequencies", rename="_frequencies"))
    if interleaved:
        own |= {"precompute_rope_cache", "rotate_half", "apply_rotary_emb"}
        renames = {"interleaved_rotate_half": "rotate_half"}
        body.append(snippet("rope", "_local"))
        cache = "interleaved_scaled_precompute_rope_cache" if scaled else "interleaved_precompute_rope_cache"
        body.append(snippet("rope", cache, rename="precompute_rope_cache"))
        body.append(snippet("rope", "interleaved_rotate_half", rename="rotate_half"))
        full_apply = "_apply_full_rotary_emb" if partial else "apply_rotary_emb"
        body.append(snippet("rope", "interleaved_apply_rotary_emb", rename=full_apply, names=renames))
    elif scaled:
        own.add("precompute_rope_cache")
        body.append(snippet("rope", "precompute_rope_cache"))
    if partial:
        own.add("apply_rotary_emb")
        body.append(snippet("rope", "apply_rotary_emb"))
    imported = [n for n in ROPE_NAMES if n not in own]
    if interleaved and "reshape_for_broadcast" not in imported:
        imported.append("reshape_for_broadcast")
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    summary = f'"""{camel} RoPE: ' + "; ".join(what) + "."
    if len(summary) > LINE_LIMIT:
        # Many features: wrapped, so the generated file stays within the line length.
        summary = "\n".join(textwrap.wrap(summary, width=92, break_on_hyphens=False))
    doc = (
        summary
        + "\n\n"
        + (
            "The frequencies (and, for some variants, a factor on cos/sin) follow transformers'\n"
            f'``ROPE_INIT_FUNCTIONS["{rope_type}"]`` operation by operation.\n'
            if scaled
            else ""
        )
        + ("The features past ``rotary_dim`` pass through unrotated.\n" if partial else "")
        + "What equals Qwen2's RoPE is re-exported from it.\n"
        + '"""\n\n'
    )
    header = "from __future__ import annotations\n\n" + ("import math\n\n" if scaled else "") + "import torch\n"
    if interleaved:
        header += "from torch.distributed.tensor import DTensor\n"
    header += "\n"
    if partial and not interleaved:
        header += "from archon_models.qwen2.model.rope import apply_rotary_emb as _apply_full_rotary_emb\n"
    names = "".join(f"    {n},\n" for n in sorted(imported, key=ROPE_NAMES.index))
    header += f"from archon_models.qwen2.model.rope import (\n{names})\n\n__all__ = [\n{listed}]\n"
    return doc + header + "".join(f"\n\n{code}" for code in body)


def interleaved_source(camel: str) -> str:
    """A rope.py that rotates adjacent feature pairs ``(x[2i], x[2i+1])`` (interleaved RoPE)."""
    return composed_source(camel, "default", partial=False, interleaved=True)


class SetRopeRequest(SourceRequest):
    pass


class SetRopeResult(StepResult):
    rope_type: str
    reexported: bool


def set_rope(request: SetRopeRequest) -> SetRopeResult:
    """Write archon_models/<model_name>/model/rope.py: a re-export of the qwen2 reference's
    RoPE when the family uses HF's default formula; otherwise the reference's layout with
    the variant's frequency scaling (linear, llama3, yarn), the partial-rotary variant, or
    the interleaved-pairing variant. Fails naming the rope_type when no variant is
    implemented."""
    with staged(request.workspace) as tree:
        return apply_set_rope(tree, request)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def apply_set_rope(tree: StagedTree, request: SetRopeRequest, plan: PortPlan | None = None) -> SetRopeResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    plan = plan or plan_for(request.source, request.trust_remote_code)
    if plan.rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {plan.rope_type!r} has no implementation in the engine (supported: {', '.join(ROPE_TYPES)}); "
            f"write rope.py by hand ({HAND_PORT_POINTER})."
        )
    changed: list[str] = []
    camel = layout.names.camel
    if plan.reference not in EDITABLE_REFERENCES:
        # The reference's own rope.py reads its variants from the config (deepseek_v3:
        # default or yarn frequencies, interleaved or half pairing); the analysis found no
        # other, so the copy stays.
        return SetRopeResult(rope_type=plan.rope_type, reexported=False, changed_files=changed)
    if plan.rotary_interleaved or plan.partial_rotary or plan.rope_type != "default":
        text = composed_source(camel, plan.rope_type, plan.partial_rotary, plan.rotary_interleaved)
        reexported = False
    else:
        rotary = applies_rope(plan.positions, recorded_edits(tree.read_text(layout.model) or ""))
        text, reexported = reexport_source(camel, rotary=rotary), True
    write_if_changed(tree, layout.rope, text, changed)
    return SetRopeResult(rope_type=plan.rope_type, reexported=reexported, changed_files=changed)
