"""Step 5: the package's RoPE, re-exported from the reference when the formula is the same."""

from __future__ import annotations

import logging

from pydantic import Field

from skill.codemod import StagedTree
from skill.porting.common import PackageLayout, SourceRequest, StepResult, staged, write_if_changed
from skill.porting.plan import PortPlan, plan_for
from skill.porting.snippets import snippet

logger = logging.getLogger(__name__)

ROPE_NAMES = ("apply_rotary_emb", "precompute_rope_cache", "repeat_kv", "reshape_for_broadcast", "rotate_half")


def reexport_source(camel: str) -> str:
    names = "".join(f"    {n},\n" for n in ROPE_NAMES)
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    return (
        f'"""{camel} RoPE: HF\'s default rotary embedding, the same formula as Qwen2\'s, re-exported."""\n\n'
        f"from archon_models.qwen2.model.rope import (\n{names})\n\n__all__ = [\n{listed}]\n"
    )


def composed_source(camel: str, rope_type: str, partial: bool) -> str:
    """A rope.py with the reference's half-rotation layout, the checkpoint's frequency
    scaling (``rope_type`` other than default) and/or partial rotary, assembled from the
    tested functions of ``skill/porting/snippets/rope.py``."""
    scaled = rope_type != "default"
    own = (["precompute_rope_cache"] if scaled else []) + (["apply_rotary_emb"] if partial else [])
    names = [n for n in ROPE_NAMES if n not in own]
    imports = "".join(f"    {n},\n" for n in names)
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    what = []
    if scaled:
        what.append(f"{rope_type} frequency scaling")
    if partial:
        what.append("rotation of the first ``rotary_dim`` features of each head only")
    doc = (
        f'"""{camel} RoPE: HF\'s half-rotation layout (re-exported from Qwen2) with {" and ".join(what)}.\n\n'
        + (
            "Only the frequencies (and, for some variants, a factor on cos/sin) differ from the default\n"
            f"RoPE; they follow transformers' ``ROPE_INIT_FUNCTIONS[\"{rope_type}\"]`` operation by operation.\n"
            if scaled
            else ""
        )
        + ("The features past ``rotary_dim`` pass through unrotated.\n" if partial else "")
        + '"""\n\n'
    )
    header = "from __future__ import annotations\n\n" + ("import math\n\n" if scaled else "") + "import torch\n\n"
    if partial:
        header += "from archon_models.qwen2.model.rope import apply_rotary_emb as _apply_full_rotary_emb\n"
    header += f"from archon_models.qwen2.model.rope import (\n{imports})\n\n__all__ = [\n{listed}]\n"
    body = []
    if scaled:
        body.append(snippet("rope", f"{rope_type}_frequencies", rename="_frequencies"))
        body.append(snippet("rope", "precompute_rope_cache"))
    if partial:
        body.append(snippet("rope", "apply_rotary_emb"))
    return doc + header + "".join(f"\n\n{code}" for code in body)


def interleaved_source(camel: str) -> str:
    """A rope.py that rotates adjacent feature pairs ``(x[2i], x[2i+1])`` (interleaved RoPE)."""
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    return (
        f'"""{camel} RoPE: adjacent features rotate together (interleaved pairing).\n\n'
        "Feature pairs ``(x[2i], x[2i+1])`` rotate by the angle ``position * base ** (-2i / head_dim)``,\n"
        "the layout of transformers' interleaved ``rotate_half`` (``x[..., ::2]`` / ``x[..., 1::2]``)\n"
        "with ``repeat_interleave``d cos/sin, instead of Qwen2's two halves. The cache layout, the\n"
        "row lookup by position and ``repeat_kv`` are Qwen2's.\n"
        '"""\n\n'
        "from __future__ import annotations\n\n"
        "import torch\n"
        "from torch.distributed.tensor import DTensor\n\n"
        "from archon_models.qwen2.model.rope import repeat_kv, reshape_for_broadcast\n\n"
        f"__all__ = [\n{listed}]\n\n\n"
        "def _local(x: torch.Tensor) -> torch.Tensor:\n"
        '    """The local shard of a DTensor (rope is applied per rank under TP), else ``x``."""\n'
        "    return x.to_local() if isinstance(x, DTensor) else x\n\n\n"
        "def precompute_rope_cache(dim: int, max_seq_len: int, base: float = 10_000.0) -> torch.Tensor:\n"
        '    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest,\n'
        "    each frequency repeated for the two features of its pair (``f0, f0, f1, f1, ...``).\n"
        '    """\n'
        "    if dim % 2 != 0:\n"
        '        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")\n'
        "    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))\n"
        "    t = torch.arange(max_seq_len, dtype=torch.int64).float()\n"
        "    angles = torch.outer(t, inv_freq)\n"
        "    angles = torch.repeat_interleave(angles, 2, dim=-1)\n"
        "    return torch.cat([angles.cos(), angles.sin()], dim=-1)\n\n\n"
        "def rotate_half(x: torch.Tensor) -> torch.Tensor:\n"
        '    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``: each adjacent pair rotated."""\n'
        "    x1 = x[..., ::2]\n"
        "    x2 = x[..., 1::2]\n"
        "    return torch.stack([-x2, x1], dim=-1).flatten(-2)\n\n\n"
        "def apply_rotary_emb(\n"
        "    xq: torch.Tensor,\n"
        "    xk: torch.Tensor,\n"
        "    rope_cache: torch.Tensor,\n"
        "    positions: torch.Tensor | None = None,\n"
        ") -> tuple[torch.Tensor, torch.Tensor]:\n"
        '    """Rotate queries ``[bs, seq, n_heads, hd]`` and keys ``[bs, seq, n_kv_heads, hd]``.\n\n'
        "    ``cos``/``sin`` are cast to the activation dtype before multiplying, as Qwen2's rope does.\n"
        '    """\n'
        "    rope_cache = _local(rope_cache)\n"
        "    if positions is not None:\n"
        "        positions = _local(positions)\n"
        "    head_dim = xq.shape[-1]\n"
        "    rows = reshape_for_broadcast(rope_cache, xq, positions).to(device=xq.device, dtype=xq.dtype)\n"
        "    cos, sin = rows[..., :head_dim], rows[..., head_dim:]\n"
        "    xq_out = xq * cos + rotate_half(xq) * sin\n"
        "    xk_out = xk * cos + rotate_half(xk) * sin\n"
        "    return xq_out, xk_out\n"
    )


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
    if not tree.exists(layout.model):
        raise FileNotFoundError(f"{layout.model} does not exist; run copy_reference first (see SKILL.md).")
    plan = plan or plan_for(request.source, request.trust_remote_code)
    if plan.rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {plan.rope_type!r} has no implementation in the engine (supported: {', '.join(ROPE_TYPES)}); "
            "write rope.py by hand (SKILL.md, section 'Porting by hand')."
        )
    if plan.rotary_interleaved and (plan.partial_rotary or plan.rope_type != "default"):
        raise ValueError(
            "interleaved rotary pairing has an implementation in the engine only with the default rope_type "
            f"and full rotary (got rope_type {plan.rope_type!r}{', partial rotary' if plan.partial_rotary else ''}); "
            "write rope.py by hand (SKILL.md, section 'Porting by hand')."
        )
    changed: list[str] = []
    camel = layout.names.camel
    if plan.rotary_interleaved:
        text, reexported = interleaved_source(camel), False
    elif plan.partial_rotary or plan.rope_type != "default":
        text, reexported = composed_source(camel, plan.rope_type, plan.partial_rotary), False
    else:
        text, reexported = reexport_source(camel), True
    write_if_changed(tree, layout.rope, text, changed)
    return SetRopeResult(rope_type=plan.rope_type, reexported=reexported, changed_files=changed)
