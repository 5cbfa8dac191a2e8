"""What one fuzzed family is: a point of the engine's feature vocabulary, drawn from a seed.

Each axis is its own small frozen model, sampled by its own function from one
``random.Random``; :func:`sample_family` draws the axes in a fixed order and then keeps
the point structurally meaningful (ALiBi has no RoPE details, latent attention brings its
own attention, a per-layer pattern needs enough layers to show both kinds). It does not
steer away from combinations the engine refuses: a refusal that names the feature is a
result, and so is a failure.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NormKind = Literal[
    "rms",
    "rms_one_plus_w",
    "rms_weightless",
    "layer_norm",
    "layer_norm_no_bias",
    "layer_norm_weightless",
    "layer_norm_one_plus_w",
]
Placement = Literal["pre", "post_sublayer", "sandwich", "post_ln", "parallel"]
Naming = Literal["llama", "gpt2", "neox", "opt", "falcon"]
Activation = Literal["silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2", "quick_gelu"]

NORM_KINDS: tuple[NormKind, ...] = (
    "rms",
    "rms_one_plus_w",
    "rms_weightless",
    "layer_norm",
    "layer_norm_no_bias",
    "layer_norm_weightless",
    "layer_norm_one_plus_w",
)
# What a QK norm computes in the catalogue (a weightless LayerNorm QK norm has no family).
QK_NORM_KINDS: tuple[NormKind, ...] = ("rms", "rms_one_plus_w", "rms_weightless", "layer_norm", "layer_norm_no_bias")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NormSpec(_Frozen):
    kind: NormKind
    placement: Placement
    final_norm: bool = True
    eps: float = 1e-6
    # Parallel blocks: one norm feeds both branches (GPT-J) or each has its own (GPT-NeoX).
    shared_parallel_norm: bool = False


class QKNormSpec(_Frozen):
    width: Literal["per_head", "full_width"]
    kind: NormKind
    after_rope: bool = False
    rope_layers_only: bool = Field(False, description="held and applied by the layers that apply RoPE only (Llama 4)")


class RopeSpec(_Frozen):
    pairing: Literal["half", "interleaved"] = "half"
    # standard: rotate_half(x) = (-x2, x1); reversed: (x2, -x1), a rotation by -theta (NanoChat).
    direction: Literal["standard", "reversed"] = "standard"
    partial_factor: float = 1.0
    scaling: Literal["default", "linear", "llama3", "yarn"] = "default"
    theta: float = 10000.0


class AttentionSpec(_Frozen):
    n_heads: int
    n_kv_heads: int
    head_dim: int
    explicit_head_dim: bool = Field(description="config carries head_dim, and it differs from hidden / heads")
    qkv_bias: bool = False
    o_bias: bool = False
    fused_qkv: Literal["none", "stacked", "grouped"] = "none"
    qk_norm: QKNormSpec | None = None
    window: Literal["none", "all", "some"] = "none"
    window_size: int = 8
    layer_types: list[str] = Field(default_factory=list, description="per layer, when window or chunk is 'some'")
    chunk: Literal["none", "all", "some"] = Field(
        "none", description="chunked local attention (Llama 4's attention_chunk_size), never beside a window"
    )
    chunk_size: int = 8
    softcap: float | None = None
    sinks: bool = False
    nope: Literal["none", "per_layer_field", "layer_type"] = "none"
    rope_layers: list[int] = Field(default_factory=list, description="per layer 1 (RoPE) or 0 (NoPE)")
    scale: Literal["default", "query_pre_attn_scalar", "attention_multiplier"] = "default"
    scale_value: float = 0.0
    clip_qkv: float | None = None
    # Differential attention (DiffLlama): heads i and i + H/2 attend over the values of a pair
    # of KV heads side by side, subtracted with a learned lambda and normalised per pair.
    differential: bool = False


class MLASpec(_Frozen):
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    head_dim_in_config: bool
    rope_interleave: bool = True
    attention_bias: bool = False


class FFNSpec(_Frozen):
    kind: Literal["gated", "plain"]
    activation: Activation
    bias: bool = False
    fused_gate_up: bool = False
    intermediate_size: int = 128


class MoESpec(_Frozen):
    n_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False
    routed_scaling_factor: float | None = None
    router_bias: bool = False
    n_shared_experts: int = 0
    shared_style: Literal["deepseek", "qwen"] = "deepseek"
    shared_gate: bool = False
    shared_intermediate_size: int = 0
    layers: Literal["all", "leading_dense", "sparse_step"] = "all"
    first_k_dense: int = 0
    sparse_step: int = 1
    layout: Literal["per_expert", "fused_out_in", "fused_in_out"] = "per_expert"
    # The sampler draws the gate-first orders; the up-first ones are for tests that name them.
    gate_up_order: Literal["concatenated", "interleaved", "concatenated_up_first", "interleaved_up_first"] = (
        "concatenated"
    )
    block_name: Literal["mlp", "block_sparse_moe", "feed_forward"] = "mlp"


class ScalarSpec(_Frozen):
    embedding_scale: Literal["none", "sqrt_dim", "multiplier"] = "none"
    embedding_multiplier: float = 1.0
    residual_multiplier: float | None = None
    logits: Literal["none", "divide", "multiply"] = "none"
    logits_value: float = 1.0
    final_softcap: float | None = None


class FamilySpec(_Frozen):
    """Everything the writer needs to emit one family; every value is a config default."""

    seed: int
    name: str = Field(description="model_type and file stem: lower-case letters and digits")
    naming: Naming
    hidden_size: int
    n_layers: int
    vocab_size: int
    max_position_embeddings: int = 2048
    norm: NormSpec
    positions: Literal["rope", "alibi", "learned"]
    rope: RopeSpec | None
    attention: AttentionSpec
    mla: MLASpec | None = None
    ffn: FFNSpec
    moe: MoESpec | None = None
    scalars: ScalarSpec = ScalarSpec()
    # tied / untied: the model declares its tying (``_tied_weights_keys``) and the config's
    # tie_word_embeddings decides; tie_ignoring: the config says tie, the model declares none
    # (transformers ties nothing); never_tied: neither ties.
    tying: Literal["tied", "untied", "tie_ignoring", "never_tied"] = "untied"
    pad_token_id: int | None = None
    target_logit: float = Field(20.0, description="largest |logit| the folder's weights are calibrated to")

    @model_validator(mode="after")
    def _rotates_whole_pairs(self) -> FamilySpec:
        # transformers rotates int(head_dim * partial_rotary_factor) features in pairs: an odd
        # width leaves one feature without a partner, a config no real family ships.
        if self.rope is not None and self.mla is None:
            width = self.attention.head_dim * self.rope.partial_factor
            if width != int(width) or int(width) % 2:
                raise ValueError(
                    f"partial_rotary_factor {self.rope.partial_factor:g} of a {self.attention.head_dim}-wide "
                    f"head rotates {width:g} features, not a whole number of pairs"
                )
        return self

    @property
    def camel(self) -> str:
        return self.name[0].upper() + self.name[1:]

    @property
    def moe_layers(self) -> list[int]:
        if self.moe is None:
            return []
        if self.moe.layers == "leading_dense":
            return list(range(self.moe.first_k_dense, self.n_layers))
        if self.moe.layers == "sparse_step":
            return [i for i in range(self.n_layers) if (i + 1) % self.moe.sparse_step == 0]
        return list(range(self.n_layers))

    def features(self) -> dict[str, str]:
        """The seed's feature set, one short value per axis (the report's columns)."""
        att, norm = self.attention, self.norm
        out = {
            "naming": self.naming,
            "norm": f"{norm.kind}/{norm.placement}" + ("" if norm.final_norm else "/no_final"),
            "positions": self.positions,
        }
        if self.rope is not None:
            rope = self.rope
            parts = [rope.pairing, rope.direction, rope.scaling]
            if rope.partial_factor != 1.0:
                parts.append(f"partial{rope.partial_factor:g}")
            out["rope"] = ",".join(parts)
        if self.mla is not None:
            mla = self.mla
            out["attention"] = (
                f"mla(q_lora={mla.q_lora_rank},head_dim_in_config={mla.head_dim_in_config},"
                f"interleave={mla.rope_interleave})"
            )
        else:
            kinds = "mha" if att.n_kv_heads == att.n_heads else "mqa" if att.n_kv_heads == 1 else "gqa"
            parts = [kinds]
            if att.explicit_head_dim:
                parts.append(f"head_dim{att.head_dim}")
            if att.qkv_bias or att.o_bias:
                parts.append("bias:" + ("qkv" if att.qkv_bias else "") + ("+o" if att.o_bias else ""))
            if att.fused_qkv != "none":
                parts.append(f"fused_{att.fused_qkv}")
            if att.qk_norm is not None:
                qk = att.qk_norm
                parts.append(f"qk_norm:{qk.width}:{qk.kind}:" + ("after_rope" if qk.after_rope else "before_rope"))
            if att.window != "none":
                parts.append(f"window_{att.window}{att.window_size}")
            if att.chunk != "none":
                parts.append(f"chunk_{att.chunk}{att.chunk_size}")
            if att.softcap is not None:
                parts.append("softcap")
            if att.sinks:
                parts.append("sinks")
            if att.nope != "none":
                parts.append(f"nope_{att.nope}")
            if att.scale != "default":
                parts.append(att.scale)
            if att.clip_qkv is not None:
                parts.append("clip_qkv")
            if att.differential:
                parts.append("differential")
            out["attention"] = ",".join(parts)
        ffn = self.ffn
        out["ffn"] = (
            f"{ffn.kind}:{ffn.activation}" + (":bias" if ffn.bias else "") + (":fused" if ffn.fused_gate_up else "")
        )
        if self.moe is not None:
            moe = self.moe
            parts = [moe.scoring, f"e{moe.n_experts}k{moe.top_k}"]
            if not moe.norm_topk_prob:
                parts.append("unnormalised")
            if moe.n_group > 1:
                parts.append(f"groups{moe.n_group}/{moe.topk_group}")
            if moe.correction_bias:
                parts.append("correction_bias")
            if moe.routed_scaling_factor is not None:
                parts.append("routed_scaling")
            if moe.router_bias:
                parts.append("router_bias")
            if moe.n_shared_experts:
                parts.append(f"shared_{moe.shared_style}" + ("_gated" if moe.shared_gate else ""))
            if moe.layers != "all":
                parts.append(moe.layers)
            parts.append(moe.layout + ("" if moe.layout == "per_expert" else f"/{moe.gate_up_order}"))
            out["moe"] = ",".join(parts)
        sc = self.scalars
        scalars = []
        if sc.embedding_scale != "none":
            scalars.append(f"embed_{sc.embedding_scale}")
        if sc.residual_multiplier is not None:
            scalars.append("residual_mult")
        if sc.logits != "none":
            scalars.append(f"logits_{sc.logits}")
        if sc.final_softcap is not None:
            scalars.append("final_softcap")
        if scalars:
            out["scalars"] = ",".join(scalars)
        out["head"] = self.tying
        if self.pad_token_id is not None:
            out["pad"] = f"padding_idx{self.pad_token_id}"
        return out

    def feature_line(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.features().items())


# --------------------------------------------------------------------------- sampling


def _pick(rng: random.Random, weighted: dict, /):  # type: ignore[no-untyped-def]
    """One key of ``weighted``, with probability proportional to its value."""
    keys = list(weighted)
    return rng.choices(keys, weights=[weighted[k] for k in keys])[0]


def sample_norm(rng: random.Random) -> NormSpec:
    kind = _pick(
        rng,
        {
            "rms": 5,
            "rms_one_plus_w": 2,
            "rms_weightless": 1,
            "layer_norm": 3,
            "layer_norm_no_bias": 1,
            "layer_norm_weightless": 1,
            "layer_norm_one_plus_w": 1,
        },
    )
    placement = _pick(rng, {"pre": 6, "sandwich": 2, "post_sublayer": 1.5, "post_ln": 1, "parallel": 1.5})
    final_norm = placement != "post_ln" or rng.random() < 0.3
    if placement != "post_ln" and rng.random() < 0.05:
        final_norm = False
    return NormSpec(
        kind=kind,
        placement=placement,
        final_norm=final_norm,
        eps=rng.choice([1e-5, 1e-6]),
        shared_parallel_norm=placement == "parallel" and rng.random() < 0.4,
    )


def _whole_pairs(factor: float, head_dim: int) -> float:
    """``factor``, or the next larger of the sampler's factors whose rotated width is a whole
    number of pairs for ``head_dim`` (a 12-wide head rotates half, not a quarter). Draws
    nothing from the generator, so the families of the other seeds stay as they were."""
    for candidate in sorted({factor, 0.5, 1.0}):
        width = head_dim * candidate
        if candidate >= factor and width == int(width) and int(width) % 2 == 0:
            return candidate
    raise AssertionError("a whole head always rotates whole pairs")


def sample_rope(rng: random.Random) -> RopeSpec:
    return RopeSpec(
        pairing=_pick(rng, {"half": 3, "interleaved": 1}),
        direction=_pick(rng, {"standard": 9, "reversed": 1}),
        partial_factor=_pick(rng, {1.0: 6, 0.5: 2, 0.25: 1}),
        scaling=_pick(rng, {"default": 5, "linear": 1, "llama3": 1, "yarn": 1.5}),
        theta=rng.choice([10000.0, 500000.0, 1000000.0]),
    )


def sample_qk_norm(rng: random.Random, norm: NormSpec) -> QKNormSpec | None:
    if rng.random() < 0.55:
        return None
    # Families almost always reuse their block norm's class for q and k.
    same = norm.kind if norm.kind in QK_NORM_KINDS else "rms"
    kind = same if rng.random() < 0.8 else rng.choice(QK_NORM_KINDS)
    return QKNormSpec(
        width=_pick(rng, {"per_head": 3, "full_width": 1}),
        kind=kind,
        after_rope=rng.random() < 0.15,
    )


def sample_heads(rng: random.Random, hidden: int) -> tuple[int, int, int, bool]:
    heads = rng.choice([4, 8] if hidden >= 96 else [4])
    kv = _pick(rng, {heads: 3, heads // 2: 3, 1: 1})
    derived = hidden // heads
    explicit = rng.random() < 0.25
    head_dim = rng.choice([d for d in (16, 24, 32) if d != derived]) if explicit else derived
    return heads, kv, head_dim, explicit


def sample_attention(rng: random.Random, hidden: int, n_layers: int, norm: NormSpec, rope: bool) -> AttentionSpec:
    heads, kv, head_dim, explicit = sample_heads(rng, hidden)
    # Chunked attention takes a share of "none"'s weight, listed before "all" and "some": the
    # families of seeds drawn before it existed keep every value but that one.
    drawn = _pick(rng, {"none": 5.2, "chunk_all": 0.4, "chunk_some": 0.4, "all": 1.5, "some": 2})
    window = drawn if drawn in ("all", "some") else "none"
    chunk = drawn.removeprefix("chunk_") if drawn.startswith("chunk_") else "none"
    layer_types: list[str] = []
    if window == "some":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    elif chunk == "some":
        layer_types = ["chunked_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    nope = "none"
    rope_layers: list[int] = []
    if rope and rng.random() < 0.2:
        nope = "layer_type" if window == "some" and rng.random() < 0.5 else "per_layer_field"
        if nope == "per_layer_field":
            rope_layers = [0 if (i + 1) % 2 == 0 else 1 for i in range(n_layers)]
    scale = _pick(rng, {"default": 7, "query_pre_attn_scalar": 1.5, "attention_multiplier": 1})
    scale_value = 0.0
    if scale == "query_pre_attn_scalar":
        scale_value = float(rng.choice([2 * head_dim, 144, 256]))
    elif scale == "attention_multiplier":
        scale_value = rng.choice([0.015625, 0.03125, 0.0625, 0.1])
    qkv_bias = rng.random() < 0.3
    return AttentionSpec(
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=head_dim,
        explicit_head_dim=explicit,
        qkv_bias=qkv_bias,
        o_bias=rng.random() < (0.5 if qkv_bias else 0.1),
        fused_qkv=_pick(rng, {"none": 6, "stacked": 1.5, "grouped": 1.5}),
        qk_norm=sample_qk_norm(rng, norm),
        window=window,
        window_size=(size := rng.choice([4, 6, 8, 12])),
        chunk=chunk,
        chunk_size=size,
        layer_types=layer_types,
        softcap=rng.choice([20.0, 30.0, 50.0]) if rng.random() < 0.15 else None,
        sinks=rng.random() < 0.12,
        nope=nope,
        rope_layers=rope_layers,
        scale=scale,
        scale_value=scale_value,
        clip_qkv=rng.choice([4.0, 8.0]) if rng.random() < 0.06 else None,
    )


def _draws_differential(seed: int, attention: AttentionSpec, positions: str) -> bool:
    """Whether the seed's family has differential attention: drawn from a generator of its own
    (the families of the seeds that do not draw it stay as they were), and only where the
    engine composes it: separate q/k/v projections, no sinks, no ALiBi, no full-width QK norm,
    and head pairs over pairs of KV heads."""
    composes = (
        attention.fused_qkv == "none"
        and not attention.sinks
        and positions != "alibi"
        and (attention.qk_norm is None or attention.qk_norm.width == "per_head")
        and attention.n_heads % 2 == 0
        and attention.n_kv_heads % 2 == 0
    )
    return composes and random.Random(f"differential-{seed}").random() < 0.15


def sample_ffn(rng: random.Random, moe: bool) -> FFNSpec:
    kind = "gated" if moe else _pick(rng, {"gated": 3, "plain": 2})
    if kind == "gated":
        activation = _pick(rng, {"silu": 6 if not moe else 20, "gelu_pytorch_tanh": 2, "gelu": 1, "relu": 0.5})
    else:
        activation = _pick(rng, {"gelu": 2, "gelu_pytorch_tanh": 2, "relu": 1, "relu2": 1, "quick_gelu": 0.5})
    return FFNSpec(
        kind=kind,
        activation=activation,
        bias=not moe and rng.random() < 0.3,
        fused_gate_up=kind == "gated" and not moe and rng.random() < 0.2,
        intermediate_size=rng.choice([128, 160, 192]),
    )


def sample_moe(rng: random.Random, n_layers: int) -> MoESpec:
    n_experts = rng.choice([4, 8])
    top_k = rng.choice([1, 2])
    scoring = _pick(rng, {"softmax": 3, "sigmoid": 2})
    n_group, topk_group = 1, 1
    if rng.random() < 0.25:
        n_group = rng.choice([g for g in (2, 4) if n_experts // g >= 2])
        topk_group = rng.randrange(1, n_group)
    # Llama 4's feed_forward takes a share of mlp's weight and draws as mlp does after it: the
    # families of seeds drawn before it existed keep every value but that name.
    block_name = _pick(rng, {"mlp": 3, "feed_forward": 1, "block_sparse_moe": 1})
    llama_named = block_name != "block_sparse_moe"
    n_shared = _pick(rng, {0: 2, 1: 2, 2: 0.5}) if llama_named else 0
    style = _pick(rng, {"deepseek": 1, "qwen": 1}) if n_shared else "deepseek"
    if style == "qwen":
        n_shared = 1
    layers = _pick(rng, {"all": 3, "leading_dense": 1.5, "sparse_step": 0.7}) if llama_named else "all"
    inter = rng.choice([32, 48, 64])
    return MoESpec(
        n_experts=n_experts,
        top_k=top_k,
        moe_intermediate_size=inter,
        scoring=scoring,
        norm_topk_prob=rng.random() < 0.75,
        n_group=n_group,
        topk_group=topk_group,
        correction_bias=llama_named and rng.random() < (0.6 if scoring == "sigmoid" else 0.1),
        routed_scaling_factor=rng.choice([1.5, 2.5]) if rng.random() < 0.3 else None,
        router_bias=rng.random() < 0.1,
        n_shared_experts=n_shared,
        shared_style=style,
        shared_gate=style == "qwen" and rng.random() < 0.6,
        shared_intermediate_size=rng.choice([64, 96]) if style == "qwen" else 0,
        layers=layers,
        first_k_dense=1 if layers == "leading_dense" else 0,
        sparse_step=2 if layers == "sparse_step" else 1,
        # Mixtral's block_sparse_moe holds one module per expert.
        layout=_pick(rng, {"per_expert": 3, "fused_out_in": 1.5, "fused_in_out": 1}) if llama_named else "per_expert",
        gate_up_order=_pick(rng, {"concatenated": 3, "interleaved": 1}),
        block_name=block_name,
    )


def sample_mla(rng: random.Random) -> MLASpec:
    return MLASpec(
        q_lora_rank=rng.choice([None, 32, 48]),
        kv_lora_rank=rng.choice([32, 48]),
        qk_nope_head_dim=rng.choice([16, 24]),
        qk_rope_head_dim=rng.choice([8, 16]),
        v_head_dim=rng.choice([16, 24]),
        head_dim_in_config=rng.random() < 0.6,
        rope_interleave=rng.random() < 0.6,
        attention_bias=False,
    )


def sample_scalars(rng: random.Random) -> ScalarSpec:
    embedding_scale = _pick(rng, {"none": 7, "sqrt_dim": 2, "multiplier": 1})
    logits = _pick(rng, {"none": 8, "divide": 1, "multiply": 1})
    return ScalarSpec(
        embedding_scale=embedding_scale,
        embedding_multiplier=rng.choice([4.0, 12.0]) if embedding_scale == "multiplier" else 1.0,
        residual_multiplier=rng.choice([0.22, 0.5]) if rng.random() < 0.12 else None,
        logits=logits,
        logits_value={"none": 1.0, "divide": rng.choice([2.0, 8.0]), "multiply": rng.choice([0.0625, 0.25])}[logits],
        final_softcap=rng.choice([15.0, 30.0]) if rng.random() < 0.12 else None,
    )


def _layer_count(rng: random.Random) -> int:
    return rng.choice([2, 2, 3, 4])


def sample_family(seed: int) -> FamilySpec:
    """The family of ``seed`` (deterministic: the same seed always gives the same family)."""
    rng = random.Random(seed)
    naming = _pick(rng, {"llama": 4, "gpt2": 1.5, "neox": 1.5, "opt": 1.5, "falcon": 1})
    hidden = rng.choice([64, 96, 128])
    n_layers = _layer_count(rng)
    mla = sample_mla(rng) if rng.random() < 0.12 else None
    moe = rng.random() < 0.3
    n_layers = max(n_layers, 2)
    norm = sample_norm(rng)
    positions = "rope" if mla is not None else _pick(rng, {"rope": 16, "alibi": 1, "learned": 1})
    rope = sample_rope(rng) if positions == "rope" else None
    attention = sample_attention(rng, hidden, n_layers, norm, positions == "rope")
    if mla is None and _draws_differential(seed, attention, positions):
        attention = attention.model_copy(update={"differential": True})
    if rope is not None:
        rope = rope.model_copy(update={"partial_factor": _whole_pairs(rope.partial_factor, attention.head_dim)})
    ffn = sample_ffn(rng, moe)
    moe_spec = sample_moe(rng, n_layers) if moe else None
    scalars = sample_scalars(rng)
    tying = _pick(rng, {"untied": 5, "tied": 3, "tie_ignoring": 1, "never_tied": 0.5})
    pad = 0 if rng.random() < 0.15 else None
    target = rng.uniform(8.0, 30.0)
    if mla is not None:
        # Latent attention brings its own attention and RoPE (DeepSeek-V3's): the other
        # attention axes do not exist there.
        rope = RopeSpec(
            pairing="interleaved" if mla.rope_interleave else "half",
            scaling="yarn" if mla.head_dim_in_config and rng.random() < 0.3 else "default",
            theta=10000.0,
        )
        attention = AttentionSpec(
            n_heads=rng.choice([4, 8]),
            n_kv_heads=0,
            head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            explicit_head_dim=False,
        )
        attention = attention.model_copy(update={"n_kv_heads": attention.n_heads})
        # What the engine claims on its latent-attention reference (skill.features.MLA_SUPPORTED_EDITS
        # and deepseek_v3's own values): RMSNorm pre-norm blocks, SwiGLU, DeepSeek's MoE (grouped
        # top-k, routed scaling) scored by sigmoids with a correction bias or by a softmax
        # without one, constant embedding/residual/logit multipliers; and the catalogue's MLA
        # families all use Llama's module names.
        naming = "llama"
        norm = NormSpec(kind="rms", placement="pre", eps=norm.eps)
        ffn = FFNSpec(kind="gated", activation="silu", intermediate_size=ffn.intermediate_size)
        if moe_spec is not None:
            sigmoid = moe_spec.scoring == "sigmoid"
            moe_spec = moe_spec.model_copy(
                update={
                    "correction_bias": sigmoid,
                    "router_bias": False,
                    "layout": "per_expert",
                    "block_name": "mlp",
                    "shared_style": "deepseek",
                    "shared_gate": False,
                    "n_experts": 8,
                    "n_group": 2,
                    "topk_group": 1,
                    "routed_scaling_factor": 2.5,
                }
            )
            if moe_spec.layers == "sparse_step":
                moe_spec = moe_spec.model_copy(update={"layers": "leading_dense", "first_k_dense": 1, "sparse_step": 1})
        scalars = scalars.model_copy(
            update={
                "embedding_scale": "multiplier" if scalars.embedding_scale != "none" else "none",
                "embedding_multiplier": scalars.embedding_multiplier
                if scalars.embedding_scale == "multiplier"
                else 4.0,
                "final_softcap": None,
            }
        )
        positions = "rope"
    return FamilySpec(
        seed=seed,
        name=f"fz{seed:05d}",
        naming=naming,
        hidden_size=hidden,
        n_layers=n_layers,
        vocab_size=rng.choice([384, 512]),
        norm=norm,
        positions=positions,
        rope=rope,
        attention=attention,
        mla=mla,
        ffn=ffn,
        moe=moe_spec,
        scalars=scalars,
        tying=tying,
        pad_token_id=pad,
        target_logit=round(target, 1),
    )


def plain_family(name: str, **updates: object) -> FamilySpec:
    """A Llama-like family with every axis at its plainest (RMSNorm pre-norm, RoPE, GQA,
    SwiGLU, no MoE, untied head), then ``updates``: the smallest family showing a feature,
    for a test that reproduces one finding of the fuzzer."""
    spec = FamilySpec(
        seed=0,
        name=name,
        naming="llama",
        hidden_size=64,
        n_layers=2,
        vocab_size=384,
        norm=NormSpec(kind="rms", placement="pre"),
        positions="rope",
        rope=RopeSpec(),
        attention=AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16, explicit_head_dim=False),
        ffn=FFNSpec(kind="gated", activation="silu"),
        target_logit=20.0,
    )
    return FamilySpec(**{**dict(spec), **updates})  # validated, unlike model_copy
