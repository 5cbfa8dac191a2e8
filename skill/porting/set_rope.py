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


SCALED_FREQUENCIES = {
    "linear": '''    # Linear position interpolation: every frequency divided by the factor.
    return inv_freq / scaling["factor"]
''',
    "llama3": '''    # Llama 3: long wavelengths divided by the factor, short ones kept, the band between
    # interpolated smoothly (wavelengths measured against the original context length).
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
''',
}


def variant_source(camel: str, rope_type: str) -> str:
    """A rope.py with the reference's layout and ``rope_type``'s frequency scaling."""
    names = [n for n in ROPE_NAMES if n != "precompute_rope_cache"]
    imports = "".join(f"    {n},\n" for n in names)
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    needs_math = "math." in SCALED_FREQUENCIES[rope_type]
    return (
        f'"""{camel} RoPE: HF\'s half-rotation layout (re-exported from Qwen2) with {rope_type} frequency scaling.\n\n'
        "Only the inverse frequencies differ from the default RoPE; they follow transformers'\n"
        f"``ROPE_INIT_FUNCTIONS[\"{rope_type}\"]`` operation by operation.\n"
        '"""\n\n'
        "from __future__ import annotations\n\n"
        + ("import math\n\n" if needs_math else "")
        + "import torch\n\n"
        f"from archon_models.qwen2.model.rope import (\n{imports})\n\n"
        f"__all__ = [\n{listed}]\n\n\n"
        "def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:\n"
        f'    """The {rope_type}-scaled inverse frequencies."""\n'
        + SCALED_FREQUENCIES[rope_type]
        + "\n\n"
        "def precompute_rope_cache(\n"
        "    dim: int, max_seq_len: int, base: float = 10_000.0, scaling: dict[str, float] | None = None\n"
        ") -> torch.Tensor:\n"
        '    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest.\n\n'
        "    ``scaling`` holds the ``rope_parameters`` of the checkpoint (``factor``, ...); ``None``\n"
        '    gives the unscaled default RoPE.\n'
        '    """\n'
        "    if dim % 2 != 0:\n"
        '        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")\n'
        "    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))\n"
        "    if scaling is not None:\n"
        "        inv_freq = _scaled_inv_freq(inv_freq, scaling)\n"
        "    t = torch.arange(max_seq_len, dtype=torch.int64).float()\n"
        "    angles = torch.outer(t, inv_freq)\n"
        "    angles = torch.cat([angles, angles], dim=-1)\n"
        "    return torch.cat([angles.cos(), angles.sin()], dim=-1)\n"
    )


class SetRopeRequest(PackageRequest):
    source: str = Field(description="model_type or config path of the family")


class SetRopeResult(StepResult):
    rope_type: str
    reexported: bool


def set_rope(request: SetRopeRequest) -> SetRopeResult:
    """Write archon_models/<model_name>/model/rope.py: a re-export of the qwen2 reference's
    RoPE when the family uses HF's default formula; otherwise the reference's layout with
    the variant's frequency scaling (linear, llama3). Fails naming the rope_type when no
    variant is implemented."""
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
    if profile.rope_type == "default":
        write_if_changed(tree, layout.rope, reexport_source(layout.names.camel), changed)
        return SetRopeResult(rope_type=profile.rope_type, reexported=True, changed_files=changed)
    write_if_changed(tree, layout.rope, variant_source(layout.names.camel, profile.rope_type), changed)
    return SetRopeResult(rope_type=profile.rope_type, reexported=False, changed_files=changed)
