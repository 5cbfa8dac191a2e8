"""Step 5: the package's RoPE, re-exported from the reference when the formula is the same."""

from __future__ import annotations

import logging

from pydantic import Field

from skill.codemod import StagedTree
from skill.porting.common import PackageLayout, PackageRequest, StepResult, require_package, staged, write_if_changed
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


DEFAULT_INV_FREQ = "    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))\n"

# Body of ``_frequencies(dim, base, scaling) -> (inv_freq, attention_factor)`` per rope_type,
# each following transformers' ROPE_INIT_FUNCTIONS[rope_type] operation by operation.
SCALED_FREQUENCIES = {
    "linear": DEFAULT_INV_FREQ
    + """    # Linear position interpolation: every frequency divided by the factor.
    return inv_freq / scaling["factor"], 1.0
""",
    "llama3": DEFAULT_INV_FREQ
    + """    # Llama 3: long wavelengths divided by the factor, short ones kept, the band between
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
    return torch.where(is_medium, smoothed, scaled), 1.0
""",
    "yarn": """    # YaRN: interpolated frequencies for long wavelengths, extrapolated ones for short
    # wavelengths, a linear ramp between the beta_fast/beta_slow correction dimensions, and
    # cos/sin scaled by an attention factor.
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)
""",
}


def variant_source(camel: str, rope_type: str) -> str:
    """A rope.py with the reference's layout and ``rope_type``'s frequency scaling."""
    names = [n for n in ROPE_NAMES if n != "precompute_rope_cache"]
    imports = "".join(f"    {n},\n" for n in names)
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    return (
        f'"""{camel} RoPE: HF\'s half-rotation layout (re-exported from Qwen2) with {rope_type} frequency scaling.\n\n'
        "Only the frequencies (and, for some variants, a factor on cos/sin) differ from the default\n"
        f"RoPE; they follow transformers' ``ROPE_INIT_FUNCTIONS[\"{rope_type}\"]`` operation by operation.\n"
        '"""\n\n'
        "from __future__ import annotations\n\n"
        "import math\n\n"
        "import torch\n\n"
        f"from archon_models.qwen2.model.rope import (\n{imports})\n\n"
        f"__all__ = [\n{listed}]\n\n\n"
        "def _frequencies(dim: int, base: float, scaling: dict[str, float]) -> tuple[torch.Tensor, float]:\n"
        f'    """The {rope_type}-scaled inverse frequencies and the factor on cos/sin."""\n'
        + SCALED_FREQUENCIES[rope_type]
        + "\n\n"
        "def precompute_rope_cache(\n"
        "    dim: int, max_seq_len: int, base: float = 10_000.0, scaling: dict[str, float] | None = None\n"
        ") -> torch.Tensor:\n"
        '    """``[max_seq_len, 2 * dim]``: ``cos`` in the first ``dim`` columns, ``sin`` in the rest.\n\n'
        "    ``scaling`` holds the checkpoint's ``rope_parameters`` (``factor``, ...); ``None``\n"
        '    gives the unscaled default RoPE.\n'
        '    """\n'
        "    if dim % 2 != 0:\n"
        '        raise ValueError(f"RoPE needs an even head dimension, got {dim}.")\n'
        "    if scaling is None:\n"
        "        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))\n"
        "        attention_factor = 1.0\n"
        "    else:\n"
        "        inv_freq, attention_factor = _frequencies(dim, base, scaling)\n"
        "    t = torch.arange(max_seq_len, dtype=torch.int64).float()\n"
        "    angles = torch.outer(t, inv_freq)\n"
        "    angles = torch.cat([angles, angles], dim=-1)\n"
        "    return torch.cat([angles.cos() * attention_factor, angles.sin() * attention_factor], dim=-1)\n"
    )


def partial_source(camel: str) -> str:
    """A rope.py that rotates only the leading features of each head (partial rotary)."""
    names = [n for n in ROPE_NAMES if n != "apply_rotary_emb"]
    imports = "".join(f"    {n},\n" for n in names)
    listed = "".join(f'    "{n}",\n' for n in ROPE_NAMES)
    return (
        f'"""{camel} RoPE: HF\'s default rotary embedding on the first ``rotary_dim`` features of\n'
        "each head only (partial rotary); the remaining features pass through unrotated.\n"
        '"""\n\n'
        "from __future__ import annotations\n\n"
        "import torch\n\n"
        "from archon_models.qwen2.model.rope import apply_rotary_emb as _apply_full_rotary_emb\n"
        f"from archon_models.qwen2.model.rope import (\n{imports})\n\n"
        f"__all__ = [\n{listed}]\n\n\n"
        "def apply_rotary_emb(\n"
        "    xq: torch.Tensor,\n"
        "    xk: torch.Tensor,\n"
        "    rope_cache: torch.Tensor,\n"
        "    positions: torch.Tensor | None = None,\n"
        ") -> tuple[torch.Tensor, torch.Tensor]:\n"
        '    """Rotate the first ``rope_cache.shape[-1] // 2`` features of every head of queries\n'
        "    ``[bs, seq, n_heads, hd]`` and keys ``[bs, seq, n_kv_heads, hd]``; keep the rest.\n"
        '    """\n'
        "    rotary_dim = rope_cache.shape[-1] // 2\n"
        "    q_rot, k_rot = _apply_full_rotary_emb(xq[..., :rotary_dim], xk[..., :rotary_dim], rope_cache, positions)\n"
        "    return (\n"
        "        torch.cat([q_rot, xq[..., rotary_dim:]], dim=-1),\n"
        "        torch.cat([k_rot, xk[..., rotary_dim:]], dim=-1),\n"
        "    )\n"
    )


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


class SetRopeRequest(PackageRequest):
    source: str = Field(description="model_type or config path of the family")


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


def apply_set_rope(tree: StagedTree, request: SetRopeRequest, profile: FamilyProfile | None = None) -> SetRopeResult:
    layout = PackageLayout.for_name(request.model_name)
    require_package(tree, layout)
    profile = profile or detect_family(request.source)
    if profile.rope_type not in ROPE_TYPES or (profile.partial_rotary and profile.rope_type != "default"):
        raise ValueError(
            f"rope_type {profile.rope_type!r}{' with partial rotary' if profile.partial_rotary else ''} has no "
            f"implementation in the engine (supported: {', '.join(ROPE_TYPES)})."
        )
    if profile.rotary_interleaved and (profile.partial_rotary or profile.rope_type != "default"):
        raise ValueError(
            "interleaved rotary pairing has an implementation in the engine only with the default rope_type "
            f"and full rotary (got rope_type {profile.rope_type!r}"
            f"{', partial rotary' if profile.partial_rotary else ''})."
        )
    changed: list[str] = []
    if profile.rotary_interleaved:
        write_if_changed(tree, layout.rope, interleaved_source(layout.names.camel), changed)
        return SetRopeResult(rope_type=profile.rope_type, reexported=False, changed_files=changed)
    if profile.partial_rotary:
        write_if_changed(tree, layout.rope, partial_source(layout.names.camel), changed)
        return SetRopeResult(rope_type=profile.rope_type, reexported=False, changed_files=changed)
    if profile.rope_type == "default":
        write_if_changed(tree, layout.rope, reexport_source(layout.names.camel), changed)
        return SetRopeResult(rope_type=profile.rope_type, reexported=True, changed_files=changed)
    write_if_changed(tree, layout.rope, variant_source(layout.names.camel, profile.rope_type), changed)
    return SetRopeResult(rope_type=profile.rope_type, reexported=False, changed_files=changed)
