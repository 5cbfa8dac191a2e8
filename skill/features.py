"""The feature vocabulary of a decoder-only architecture, shared by analysis and porting.

Step 1 of the porting guide fills a checklist (attention variant, FFN, MoE, positions,
norm, scalars); the porting edits consume the same checklist. Both sides import it from
here, so "per-head RMS QK norm" is one name, ``QKNormKind.PER_HEAD_RMS``, everywhere.

The vocabulary is deliberately flat: a handful of enums, one model per checklist
section, and :class:`Feature` naming each atomic, portable decision. A family is
reduced to ``{Feature: value}`` by :func:`feature_values`; a delta from a reference is
one entry whose value differs, and :data:`SUPPORTED_EDITS` says which target values an
edit of the porting engine can produce. Anything the vocabulary cannot express is a
:attr:`Feature.OTHER` entry whose value names it plainly ("differential attention");
no edit supports those.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _absent(value: Any) -> bool:
    return value is None


def is_empty(value: Any) -> bool:
    """``exclude_if`` of a collection a report or plan leaves out of its serialised form while empty."""
    return not value


def _optional_fact(description: str) -> Any:
    """A fact only some families have: ``None`` where absent, and then left out of the
    serialised report, so the reports (and recorded sessions) of the others read as before."""
    return Field(None, description=description, exclude_if=_absent)


# --------------------------------------------------------------------------- enums


class QKNormKind(StrEnum):
    """Normalisation of queries and keys before the attention product."""

    NONE = "none"
    PER_HEAD_RMS = "per_head_rms"  # RMSNorm over head_dim, one weight shared by heads (Qwen3)
    FULL_WIDTH_RMS = "full_width_rms"  # RMSNorm over n_heads * head_dim (OLMo2)
    RMS_ONE_PLUS_W = "rms_one_plus_w"  # RMSNorm scaling by (1 + w) (Gemma3)
    LAYER_NORM = "layer_norm"  # mean-centred LayerNorm
    WEIGHTLESS = "weightless"  # normalisation without a learned weight


class QKNormPlacement(StrEnum):
    """Whether the QK norm applies to the projections before or after RoPE."""

    NONE = "none"
    BEFORE_ROPE = "before_rope"
    AFTER_ROPE = "after_rope"


class OutputGateKind(StrEnum):
    """How a gated attention output scales the attention output before ``o_proj``: the
    gate function applied to a projection of the block input, and whether the gate has
    one value per element (``heads * head_dim``) or one per head. ``<function>_in_query``:
    the query projection also yields the gate, each head's rows its query then its gate
    (MiniCPM5-MoE's ``q_gate_proj``, Qwen3-Next), one value per element; ``in_query``: a
    query projection twice the query width whose gate no probe read; ``unmatched``: an
    extra projection whose effect on the output no gate function explains."""

    SIGMOID_PER_ELEMENT = "sigmoid_per_element"
    SIGMOID_PER_HEAD = "sigmoid_per_head"
    SOFTPLUS_PER_ELEMENT = "softplus_per_element"
    SOFTPLUS_PER_HEAD = "softplus_per_head"
    SIGMOID_IN_QUERY = "sigmoid_in_query"
    SOFTPLUS_IN_QUERY = "softplus_in_query"
    IN_QUERY = "in_query"
    UNMATCHED = "unmatched"


# The suffix of the gate kinds whose gate is the second half of each head's rows of the query
# projection (``sigmoid_in_query``): what the gate function is applied to.
IN_QUERY_SUFFIX = "_in_query"


class SlidingWindowKind(StrEnum):
    """Which layers restrict attention to a local window."""

    NONE = "none"
    ALL_LAYERS = "all_layers"
    PER_LAYER_PATTERN = "per_layer_pattern"


class FFNKind(StrEnum):
    GATED = "gated"  # down(act(gate(x)) * up(x))
    PLAIN = "plain"  # down(act(up(x)))


class RouterScoring(StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    SPARSEMIXER = "sparsemixer"  # PhiMoE: top-1 then top-2 of masked softmaxes (no top-k softmax)
    OTHER = "other"


class ExpertLayout(StrEnum):
    """How routed experts are stored in the checkpoint files."""

    NONE = "none"
    PER_EXPERT_2D = "per_expert_2d"  # experts.{e}.gate_proj.weight, one 2D tensor per expert
    FUSED_3D = "fused_3d"  # experts.gate_up_proj, one 3D tensor for all experts


class GateUpOrder(StrEnum):
    """How a fused expert tensor stacks the gate (activated) and up columns."""

    SEPARATE = "separate"  # gate and up in their own tensors (or a plain MLP)
    CONCATENATED = "concatenated"  # gate rows/columns first, then up (chunk(2))
    INTERLEAVED = "interleaved"  # gate at even, up at odd positions (gpt-oss)
    CONCATENATED_UP_FIRST = "concatenated_up_first"  # up rows/columns first, then gate
    INTERLEAVED_UP_FIRST = "interleaved_up_first"  # up at even, gate at odd positions


class WeightOrientation(StrEnum):
    """Axis order of a stored projection: nn.Linear's (out, in) or the transpose."""

    OUT_IN = "out_in"
    IN_OUT = "in_out"


class FusedQKVLayout(StrEnum):
    """Row order of a fused q/k/v projection, probed (which rows feed each head's values)."""

    NONE = "none"  # separate q, k and v projections
    STACKED = "stacked"  # every query head, then every key head, then every value head (Phi-3, Falcon MQA)
    GROUPED = "grouped"  # per KV head: its query heads, its key, its value (GPT-NeoX, Bloom, Falcon new arch)
    BLOCKED = "blocked"  # a fixed number of blocks, each a share of q, k, v in some order (CodeGen: 4 x q v k)
    OTHER = "other"


class PositionKind(StrEnum):
    ROPE = "rope"
    LEARNED = "learned"
    SINUSOIDAL = "sinusoidal"
    ALIBI = "alibi"
    RELATIVE_BIAS = "relative_bias"
    NONE = "none"


class RotaryStyle(StrEnum):
    """Pairing of rotated dimensions: halves (rotate_half) or adjacent pairs."""

    HALF = "half"
    INTERLEAVED = "interleaved"


class RotaryDirection(StrEnum):
    """Which way each pair turns: transformers' ``rotate_half`` ``(x1, x2) -> (-x2, x1)``
    (standard), or ``(x2, -x1)`` (reversed, nanochat: the standard rotation by minus the angle)."""

    STANDARD = "standard"
    REVERSED = "reversed"


class NormKind(StrEnum):
    RMS = "rms"
    RMS_ONE_PLUS_W = "rms_one_plus_w"
    LAYER_NORM = "layer_norm"
    LAYER_NORM_NO_BIAS = "layer_norm_no_bias"
    LAYER_NORM_ONE_PLUS_W = "layer_norm_one_plus_w"  # centred, scaled by (1 + w) (Nemotron's LayerNorm1P)
    LAYER_NORM_WEIGHTLESS = "layer_norm_weightless"  # centred, no learned weight or bias (OLMo)
    RMS_WEIGHTLESS = "rms_weightless"  # RMS-normalised, no learned weight
    OTHER = "other"


class NormPlacement(StrEnum):
    """Where a block normalises, relative to its residual stream."""

    PRE = "pre"  # x + f(norm(x))
    POST_SUBLAYER = "post_sublayer"  # x + norm(f(x))  (OLMo2)
    SANDWICH = "sandwich"  # x + norm(f(norm(x)))  (Gemma2/3)
    PARALLEL = "parallel"  # x + attn(norm(x)) + mlp(norm'(x))
    POST_LN = "post_ln"  # norm(x + f(x))  (original Transformer, TrOCR)


# ----------------------------------------------------------------- checklist models


class ConfigScalar(_Frozen):
    """The config field that sets a measured factor, and how: ``factor = relation(field)``."""

    field: str = Field(description="config field name")
    relation: str = Field("x", description="x, 1/x, x**-0.5 or sqrt(x)")
    times: ConfigScalar | None = Field(
        None,
        description="a second config field the factor also depends on (a model size): "
        "factor = relation(field) * times.relation(times.field)",
    )


class SlidingWindow(_Frozen):
    kind: SlidingWindowKind = Field(SlidingWindowKind.NONE, description="which layers use the window")
    size: int | None = Field(None, description="window length in tokens (the config's value)")
    layer_pattern: list[str] = Field(
        default_factory=list, description="per-layer attention kinds when kind is per_layer_pattern"
    )
    evidence: str = Field("", description="config field, mask probe, or both")
    size_field: str | None = _optional_fact("the config field holding the window, when not sliding_window")
    layer_kinds_field: str | None = _optional_fact(
        "per_layer_pattern: the config field listing each layer's attention kind, when not layer_types "
        "(GPT-Neo: attention_layers)"
    )
    windowed_kind: str | None = _optional_fact(
        "per_layer_pattern: the layer kind that sees the window, when not sliding_attention (GPT-Neo: local)"
    )


class ChunkedAttention(_Frozen):
    """Attention inside fixed chunks of each document (Llama 4's local layers): a token sees
    the earlier tokens of its own ``size``-token chunk, chunks counted from the document's
    first token. Measured on the attention weights of a tiny model with a layer of each kind."""

    size_field: str = Field(description="config field: the chunk length in tokens (attention_chunk_size)")
    chunked_kind: str | None = Field(
        None,
        description="the layer_types value of the chunked layers (the others see their whole document); "
        "None: every layer",
    )


# The Gated DeltaNet's projections in the qwen3_5 reference, and the row blocks ("parts") each
# stacks, in order: q, k (linear_num_key_heads x linear_key_head_dim each), v, z
# (linear_num_value_heads x linear_value_head_dim each), b, a (linear_num_value_heads each).
DELTANET_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "in_proj_qkv": ("q", "k", "v"),
    "in_proj_z": ("z",),
    "in_proj_b": ("b",),
    "in_proj_a": ("a",),
}


class FusedMixerWeight(_Frozen):
    """A checkpoint weight of the mixer that stacks several of the reference's Gated DeltaNet
    projections (Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``), measured by loading it,
    split, into the reference's ``GatedDeltaNet`` and comparing outputs."""

    hf_name: str = Field(description="the parameter's name in the HF mixer (in_proj_qkvz.weight)")
    parts: list[str] = Field(description="the row blocks it stacks, in order (q, k, v, z / b, a)")
    grouped: bool = Field(
        description="rows grouped by key head (each of linear_num_key_heads holds its slice of every part, "
        "in order), not whole parts one after another"
    )

    @property
    def projections(self) -> list[str]:
        """The reference projections it holds, in the reference's order (as they stack once unstacked)."""
        return [name for name, held in DELTANET_PROJECTIONS.items() if set(held) & set(self.parts)]


class LinearAttentionLayers(_Frozen):
    """Layers whose token mixer is a Gated DeltaNet instead of softmax attention (Qwen3.5's
    hybrid stack). Measured on a tiny model: which layers hold the mixer, the per-layer config
    field that says so, and the mixer's output against the qwen3_5 reference's ``GatedDeltaNet``
    loaded with its weights; the other features are measured on the family with every layer
    set to the attention kind."""

    kind: Literal["gated_deltanet"] = Field(description="the linear-attention mixer the layers compute")
    kind_field: str = Field(description="the per-layer config field naming each layer's mixer (layer_types)")
    linear_kind: str = Field(description="its value on the linear-attention layers")
    attention_kind: str = Field(description="its value on the softmax-attention layers")
    mixer_name: str = Field(description="the mixer's module name in an HF layer (linear_attn)")
    layers: list[int] = Field(description="the linear-attention layers of the analysed config")
    fused: list[FusedMixerWeight] = Field(
        default_factory=list,
        exclude_if=is_empty,
        description="checkpoint weights that stack several of the reference's projections (none: one each)",
    )


class QueryPositionScale(_Frozen):
    """Queries scaled by their absolute position, RoPE unchanged (Ministral3's long-context
    temperature): ``q * (1 + beta * log(1 + floor((p + offset) / period)))``, the form verified
    on HF's forward, on every layer or on the layers without RoPE (Llama 4's attention
    temperature). Fields are config paths: ``rope_parameters.llama_4_scaling_beta``."""

    beta_field: str
    period_field: str
    offset: int = Field(
        0,
        exclude_if=lambda value: value == 0,
        description="added to the position before the floor (Llama 4's temperature: (p + 1) / period)",
    )
    nope_layers_only: bool = Field(
        False,
        exclude_if=lambda value: not value,
        description="only the layers without RoPE scale their queries (Llama 4's attention temperature)",
    )
    switch_field: str | None = _optional_fact(
        "boolean config field that turns the scale on (Llama 4's attn_temperature_tuning), measured: flipped, the "
        "scale is gone; the port pins it"
    )


class SparseIndexer(_Frozen):
    """A module inside MLA that picks, for each query, the keys it may attend to (DeepSeek
    Sparse Attention's indexer): ``index_n_heads`` small heads of ``index_head_dim`` score
    every causal key, ``sum_h w_h(x) * relu(q_h . k)``, and only the ``index_topk`` best keep
    their attention score. Its queries come from MLA's query latent, its single key head from
    the hidden state through a LayerNorm; the first ``qk_rope_head_dim`` of each are rotated.
    Measured on the real module (shapes, and its selection against the closed form)."""

    module: str = Field(description="the attention's child holding the indexer")
    topk_field: str = Field(description="config field: keys kept per query")
    n_heads_field: str = Field(description="config field: the indexer's head count")
    head_dim_field: str = Field(description="config field: the indexer's head width")
    rotary_interleaved: bool = Field(description="the indexer rotates interleaved pairs, not the two halves")
    parts: dict[str, str] = Field(
        description="the indexer's HF children by role: wq_b (queries from the query latent), wk (the key), "
        "k_norm (the key's LayerNorm), weights_proj (the per-head weights)"
    )
    grad: bool = Field(False, description="HF's forward lets gradients reach the indexer's weights (measured)")


class MLA(_Frozen):
    """Multi-head latent attention (DeepSeek-V2/V3 style low-rank Q and KV)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    latent_norm_eps_field: str | None = _optional_fact(
        "the block norms' epsilon field, when the q/kv latent norms take theirs from it "
        "(DeepSeek's hold 1e-6 whatever the config says)"
    )
    indexer: SparseIndexer | None = _optional_fact(
        "the sparse-attention indexer whose top-k keys per query mask the attention (DeepSeek-V3.2)"
    )


class DifferentialAttention(_Frozen):
    """Differential attention (the Differential Transformer; HF's DiffLlama), measured
    (skill/analysis/differential.py): query heads ``i`` and ``i + H/2`` attend over the values
    of a pair of KV heads side by side and their outputs are subtracted, scaled by
    ``lambda = exp(a . b) - exp(c . d) + lambda_init(layer)``, then normalised per pair."""

    lambda_vectors: list[str] = Field(
        description="the attention's four head_dim vectors as (a, b, c, d) of lambda's formula (lambda_q1, "
        "lambda_k1, lambda_q2, lambda_k2)"
    )
    lambda_keys: list[str] = Field(
        default_factory=list, description="their checkpoint keys inside a layer, in the same order"
    )
    norm: str = Field(description="the attention's weightless RMS norm over each pair's 2 * head_dim outputs")
    norm_eps: float = Field(description="that norm's epsilon (measured)")
    lambda_init: str = Field(description="lambda_init's schedule over the 0-based layer index (measured)")


class AttentionFeatures(_Frozen):
    @property
    def per_head_qk_norm(self) -> bool:
        """A QK norm over each head's features (whatever it computes)."""
        return self.qk_norm is not QKNormKind.NONE and not self.qk_norm_full_width

    q_bias: bool = False
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNormKind = QKNormKind.NONE
    qk_norm_placement: QKNormPlacement = QKNormPlacement.NONE
    qk_norm_computation: NormKind | None = Field(
        None, description="what the QK norm computes, in the block norms' vocabulary (probed); None without one"
    )
    qk_norm_full_width: bool = Field(False, description="the QK norm spans all heads at once, not one head")
    n_heads: int | None = None
    n_kv_heads: int | None = None
    gqa: bool = Field(False, description="fewer KV heads than query heads (MQA included)")
    mqa_flag: str | None = Field(
        None, description="bool config field, set, that makes one KV head whatever the head counts say (multi_query)"
    )
    head_dim: int | None = None
    explicit_head_dim: bool = Field(
        False,
        description="head_dim differs from hidden_size // n_heads; with MLA always true (head_dim is then the "
        "query/key width, qk_nope_head_dim + qk_rope_head_dim, set by its own fields)",
    )
    sliding_window: SlidingWindow = SlidingWindow()
    logit_softcap: float | None = Field(None, description="tanh soft-capping of attention scores")
    custom_scaling: bool = Field(
        False, description="scores not scaled by head_dim ** -0.5, or scaled by a factor a config field sets"
    )
    scaling_field: str | None = Field(None, description="config field that sets the custom scale")
    scaling_source: ConfigScalar | None = Field(None, description="the scale's config field and relation")
    scaling_constant: float | None = _optional_fact(
        "a score scale that is no config field's, measured on layer 0's attention weights (GPT-Neo: 1.0)"
    )
    fused_qkv: bool = Field(False, description="one projection yields q, k and v")
    fused_qkv_layout: FusedQKVLayout = Field(FusedQKVLayout.NONE, description="row order of the fused projection")
    fused_qkv_blocks: int | None = Field(
        None, description="blocked layout: the fixed number of blocks the fused rows form (CodeGen's mp_num = 4)"
    )
    fused_qkv_order: str | None = Field(
        None, description="blocked layout: the order of the q, k and v shares inside each block (CodeGen: qvk)"
    )
    mla: MLA | None = None
    sinks: bool = Field(False, description="learned per-head attention sink logits")
    output_gate: bool = Field(False, description="attention output multiplied by a gate of the input")
    output_gate_kind: OutputGateKind | None = Field(
        None, description="the gate's function and granularity (probed), or where it comes from"
    )
    output_gate_key: str | None = Field(
        None, description="the gate projection's module in a layer's checkpoint keys (self_attn.gate_proj)"
    )
    output_gate_bias: bool = Field(False, description="the gate projection has a bias")
    o_bias_last_layer_key: str | None = _optional_fact(
        "the checkpoint key inside a layer ({} the layer) of a bias the last layer's output projection has and no "
        "other layer's does (GPT-NeoX-Japanese's attention.dense_bias); measured: folded into the projection's "
        "output, the logits stay the same"
    )
    differential: DifferentialAttention | None = _optional_fact(
        "differential attention: head pairs' outputs subtracted with a learned lambda (DiffLlama)"
    )
    sub_norm: NormKind | None = _optional_fact(
        "a norm over every head's output (n_heads * head_dim) that the output projection reads (BitNet's "
        "attn_sub_norm), its kind; measured: the projection's input is the norm's output, with the block norms' eps"
    )
    qk_norm_rope_layers_only: bool | None = _optional_fact(
        "the (weightless) QK norm is held only by the layers that apply RoPE: exactly the NoPE layers lack it "
        "(Llama 4), measured on the full-depth stack"
    )
    chunked: ChunkedAttention | None = _optional_fact(
        "attention inside fixed chunks of each document (Llama 4's attention_chunk_size), measured"
    )
    nope_layers: list[int] = Field(
        default_factory=list, description="0-based layers (of the full-depth stack when measurable) that apply no RoPE"
    )
    nope_layers_field: str | None = Field(
        None,
        description="config list field, one entry a layer, falsy where the layer applies no RoPE (no_rope_layers)",
    )
    nope_layer_type: str | None = Field(
        None, description="the layer_types value whose layers apply no RoPE (full_attention: EXAONE-4, Cohere2)"
    )
    query_position_scale: QueryPositionScale | None = Field(
        None,
        description="queries scaled by a function of their absolute position (probed with RoPE held fixed); "
        "None when only relative positions reach the scores",
    )
    clip_qkv: float | None = Field(None, description="clamp of the q/k/v projections to [-c, c] (the config's value)")
    clip_qkv_field: str | None = Field(
        None, description="config field that clamps q/k/v; set when the forward reads it, even if the default is None"
    )
    clip_qkv_after_qk_norm: bool | None = Field(
        None,
        description="with a QK norm too: q and k clamped after it (OLMoE) or before it (probed); None when "
        "there is no such pair or the probe could not tell",
    )
    heads_per_layer_field: str | None = _optional_fact(
        "config list giving each layer its own query-head count (every entry the head count here), "
        "probed: a layer whose entry moves gets projections of another width"
    )


class FFNFeatures(_Frozen):
    kind: FFNKind = FFNKind.GATED
    activation: str = Field("silu", description="an entry of skill.activations.ACTIVATIONS, else the name as found")
    activation_field: str | None = Field(None, description="config field that names the activation, if any")
    activation_fields: dict[str, str] = Field(
        default_factory=dict,
        description="the activation's constants -> the config fields setting them (clamped_swiglu: alpha, limit)",
    )
    bias: bool = False
    fused_gate_up: bool = False
    intermediate_size: int | None = None
    intermediate_size_field: str | None = Field(
        None, description="config field of the FFN width (intermediate_size, ffn_dim, n_inner)"
    )
    intermediate_multiple: int | None = Field(
        None,
        description="width = multiple * hidden_size when that field is None (GPT-2's n_inner: 4), or when no "
        "config field sets the width (Bloom: 4)",
    )
    intermediate_ratio_field: str | None = Field(
        None, description="config field whose value times hidden_size is the FFN width (MPT's expansion_ratio)"
    )
    sub_norm: NormKind | None = _optional_fact(
        "a norm over the hidden width that the down projection reads (BitNet's ffn_sub_norm), its kind; "
        "measured: the projection's input is the norm's output, with the block norms' eps"
    )


class MoEFeatures(_Frozen):
    num_experts: int
    top_k: int
    output_norm: NormKind | None = _optional_fact(
        "a norm the HF MoE block applies to its own output (routed plus shared experts) before the residual add "
        "(A.X-K1's post_mlp_layernorm), its kind; measured: its input is the branches' sum, its output the "
        "block's, with the block norms' eps"
    )
    router_scoring: RouterScoring = RouterScoring.SOFTMAX
    norm_topk_prob: bool = False
    score_correction_bias: bool = False
    routed_scaling_factor: float | None = None
    routed_scaling_field: str | None = Field(
        None, description="config field of the routed scaling factor, when the forward reads it (even at 1.0)"
    )
    n_group: int | None = Field(None, description="grouped (node-limited) top-k: number of groups")
    topk_group: int | None = Field(None, description="grouped top-k: groups kept per token")
    score_correction_key: str = Field(
        "",
        description="checkpoint key of the score-correction bias inside a layer (mlp.gate.e_score_correction_bias)",
    )
    score_correction_shape: list[int] = Field(default_factory=list, description="its shape on disk")
    n_group_field: str | None = Field(None, description="config field of the number of expert groups, if any")
    topk_group_field: str | None = Field(None, description="config field of the groups kept per token, if any")
    group_scoring: str = Field(
        "sum_top2",
        description="how grouped top-k scores a group, probed on HF's MoE block: sum_top2 (DeepSeek-V3 "
        "noaux_tc) or max (DeepSeek-V2 group_limited_greedy)",
    )
    shared_experts: int = 0
    shared_experts_field: str | None = Field(
        None,
        description="config field of the shared-expert count (also when it is 0: a config setting it has some)",
    )
    shared_expert_width: str = Field(
        "",
        description="experts_multiple: the shared MLP is shared_experts times an expert's width (AReaL's "
        "num_shared_experts; one such MLP when no field counts them); own_field: "
        "shared_expert_intermediate_size, or the field shared_expert_width_field names; empty when none or "
        "unmeasured",
    )
    shared_expert_width_field: str | None = _optional_fact(
        "the config field that sets the shared MLP's own width when it is not shared_expert_intermediate_size "
        "(measured: moving it moves the width; MiniMax-M3's shared_intermediate_size)"
    )
    shared_expert_gate: bool = False
    moe_layers: list[int] = Field(default_factory=list, description="0-based layers with routed experts")
    n_layers: int = Field(0, description="layers in the full-size config, for moe_layers")
    moe_layer_rule: str = Field(
        "",
        description="the config rule that reproduces moe_layers: sparse_step (decoder_sparse_step, "
        "mlp_only_layers), first_k_dense (first_k_dense_replace or num_dense_layers), layer_types (mlp_layer_types), "
        "start_end_interval (moe_layer_start_index/end_index/interval); empty when none does",
    )
    moe_layer_fields: list[str] = Field(default_factory=list, description="config fields the layer rule reads")
    expert_layout: ExpertLayout = ExpertLayout.PER_EXPERT_2D
    expert_orientation: WeightOrientation = WeightOrientation.OUT_IN
    expert_key_template: str = Field(
        "", description="the experts' gate/up (or up) key, {} for the layer and (per-expert layout) the expert"
    )
    expert_down_key_template: str = Field("", description="the experts' down-projection key, {} as above")
    expert_gate_up: GateUpOrder = Field(
        GateUpOrder.SEPARATE, description="fused layout: how one tensor stacks gate and up (probed)"
    )
    expert_bias: bool = Field(False, description="the routed experts' projections have biases")
    expert_bias_key_templates: list[str] = Field(
        default_factory=list,
        description="fused layout: the gate/up (or up) and down biases' keys ({} for the layer), '' where unplaced",
    )
    router_bias: bool = Field(False, description="the router's linear layer has a bias")
    num_experts_field: str | None = Field(None, description="config field of the routed expert count")
    top_k_field: str | None = Field(None, description="config field of the experts per token")
    router_jitter_field: str | None = Field(
        None, description="sparsemixer: config field of the threshold epsilon (router_jitter_noise)"
    )
    norm_topk_prob_ignored: bool = Field(
        False,
        description="the config has norm_topk_prob but the forward never reads it: flipping it leaves the "
        "routing weights HF's MoE block computes unchanged (DeepSeek-V2, Cohere2-MoE's softmax router)",
    )
    group_switch_field: str | None = Field(
        None,
        description="config field whose value turns the group limit on (topk_method), when n_group alone does not",
    )
    group_switch_value: str | None = Field(None, description="the value of that field that limits the groups")
    group_switch_values: list[str] = Field(
        default_factory=list, description="every value of that field the forward implements (others fail there)"
    )
    selection_bias_placement: str = Field(
        "",
        description="where a per-expert selection bias enters the top-k (probed): scores (added to the "
        "scored experts, AReaL's expert_bias), logits (added to the router logits before the score "
        "function, for selection only); empty when there is none or the probe cannot tell",
    )
    renormalises_when_ignored: bool | None = Field(
        None,
        description="when norm_topk_prob is ignored: whether HF's router still rescales its top-k weights "
        "to one sum with the field False (probed on the router module; Cohere2-MoE's softmax over the "
        "top-k logits: True; DeepSeek-V2: False); None when the field is read or the probe cannot tell",
    )
    per_layer_list_fields: list[str] = Field(
        default_factory=list,
        description="MoE config fields (experts, experts per token) whose config class accepts a per-layer "
        "list; the port reads one value and refuses a list",
    )
    score_before_experts: bool | None = _optional_fact(
        "the routing weights scale what the experts read, not what they return (Llama 4: sum_e E_e(w_e * x); "
        "AReaL's MoEArgs.score_before_experts); measured on the rows the experts read"
    )
    router_softcap_field: str | None = _optional_fact(
        "config field soft-capping the router logits (tanh), off here (0 or None) and read by the forward "
        "when set (probed): the port's router reads its logits uncapped and refuses a cap"
    )

    @property
    def grouped_topk(self) -> bool:
        return self.n_group is not None and self.n_group > 1


class PositionFeatures(_Frozen):
    kind: PositionKind = PositionKind.ROPE
    rope_type: str | None = Field("default", description="rope_parameters['rope_type'] (default, linear, yarn, ...)")
    rope_scaling: dict[str, Any] = Field(default_factory=dict, description="the scaling parameters besides theta")
    theta: float | None = None
    rotary_style: RotaryStyle = RotaryStyle.HALF
    rotary_direction: RotaryDirection = Field(
        RotaryDirection.STANDARD,
        description="which way the rotary function turns each pair, probed on HF's apply_rotary_pos_emb "
        "(standard when the function takes another signature: the evidence says so)",
    )
    partial_rotary_factor: float = 1.0
    per_layer_type_rope: bool = Field(False, description="different RoPE parameters per layer type")
    rope_layer_types: list[str] = Field(
        default_factory=list, description="the layer types rope_parameters holds parameters for, when per layer type"
    )
    layer_rotary_factors: dict[str, float] | None = _optional_fact(
        "per-layer-type RoPE where some layer type rotates only part of each head: each layer type's "
        "rotated share of head_dim, probed on HF's rotary tables (one per layer type)"
    )
    table_key: str | None = Field(
        None, description="checkpoint key of a learned absolute-position table (transformer.wpe.weight)"
    )
    table_offset: int = Field(
        0, description="position p reads row p + offset of the learned or sinusoidal table (OPT, XGLM: 2), probed"
    )
    table_zero_row_field: str | None = Field(
        None, description="config field naming the sinusoidal table's row that is zeroed (XGLM: pad_token_id), probed"
    )
    alibi_slopes: list[float] = Field(
        default_factory=list, description="ALiBi: the per-head slopes of the tiny model's layer-0 score bias, probed"
    )
    table_rows_field: str | None = Field(
        None, description="config field whose value plus the offset is the table's row count"
    )


class NormFeatures(_Frozen):
    kind: NormKind = NormKind.RMS
    eps: float | None = Field(None, description="the config's value, else the value measured on the norm")
    eps_field: str | None = None
    placement: NormPlacement = NormPlacement.PRE
    block_norms: dict[str, str] = Field(
        default_factory=dict,
        description="layer-0 norm module name -> role (pre_attention, post_attention, pre_ffn, post_ffn; post-LN: "
        "attention_residual, ffn_residual), probed",
    )
    final_norm: bool = Field(
        True, description="a norm runs on the last layer's output before the LM head (post-LN stacks have none)"
    )


# The Archon block norm that plays each role ``NormFeatures.block_norms`` probes. Post-LN: the
# norm of each residual sum keeps the pre-norm block's name.
BLOCK_NORM_NAMES = {
    "pre_attention": "attention_norm",
    "post_attention": "post_attention_norm",
    "pre_ffn": "ffn_norm",
    "post_ffn": "post_ffn_norm",
    "attention_residual": "attention_norm",
    "ffn_residual": "ffn_norm",
}


class ScalarFeatures(_Frozen):
    embedding_scale: float | None = Field(None, description="factor on embeddings before layer 0 (tiny probe)")
    embedding_scale_kind: str = Field(
        "none", description="none, sqrt_dim, or constant (also when a config field sets it, even to 1.0)"
    )
    embedding_scale_source: ConfigScalar | None = Field(None, description="config field of a constant scale")
    embedding_norm: NormKind | None = Field(None, description="a norm on the embeddings before layer 0 (probed)")
    embedding_norm_module: str | None = Field(
        None, description="its module path, whose weight/bias keys the checkpoint holds"
    )
    residual_multiplier: float | None = Field(None, description="the default config's value when not 1.0")
    residual_multiplier_field: str | None = Field(
        None, description="config field of the residual multiplier, when the forward reads it (even at 1.0)"
    )
    residual_multiplier_source: ConfigScalar | None = Field(
        None, description="how that field sets the factor (with the model size it is divided by, if any)"
    )
    logit_multiplier: float | None = Field(None, description="factor on the logits (1/x for a divisor)")
    logit_multiplier_source: ConfigScalar | None = Field(
        None, description="config field of the logit factor, when the forward reads it (even at 1.0)"
    )
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = Field(
        False, description="HF's LM head is the token embedding, for this config (probed)"
    )
    tying_field: str | None = Field(
        "tie_word_embeddings",
        description="the config field HF's tying follows, probed with it True and False; None when HF ties, or "
        "keeps its own head, whatever it says (remote code that defines no tying)",
    )
    padding_idx_field: str | None = Field(
        None,
        description="config field naming the token embedding's row HF gives no gradient through its lookups "
        "(nn.Embedding's padding_idx: pad_token_id), probed with two ids; None when every row trains",
    )
    lm_head_bias: bool = Field(False, description="the LM head (output projection) has a bias the checkpoint holds")
    embedding_projection_field: str | None = Field(
        None,
        description="config field of the embedding width when the token embeddings (and the LM head) are narrower "
        "than hidden_size: projected in before layer 0, out after the final norm (OPT's word_embed_proj_dim)",
    )
    embedding_projection_in: str | None = Field(None, description="module path of the projection in (no bias)")
    embedding_projection_out: str | None = Field(None, description="module path of the projection out (no bias)")


class NamedFact(_Frozen):
    """A measured fact outside the vocabulary (an ``other`` entry of the checklist), keyed so
    that the feature module porting it (:mod:`skill.feature_modules`) can claim it; ``data``
    holds what the detector measured, so the module reads the fact instead of measuring it again."""

    key: str = Field(description="the fact's kind, the ``claims`` of the feature module that ports it")
    data: dict[str, Any] = Field(default_factory=dict, description="the measured values, JSON")


class Checklist(_Frozen):
    """The guide's step-1 checklist for one family, in the fixed vocabulary."""

    attention: AttentionFeatures
    ffn: FFNFeatures
    moe: MoEFeatures | None = None
    positions: PositionFeatures
    norm: NormFeatures
    scalars: ScalarFeatures
    transposed_weights: list[str] = Field(
        default_factory=list,
        description="layer checkpoint keys ({} for the layer) stored as [in, out] (transformers' Conv1D), probed",
    )
    pinned_nested_fields: list[str] = Field(
        default_factory=list,
        description="fields of a nested config (MPT's attn_config.clip_qkv) the forward reads, found unset (None): "
        "no edit reads a nested field, so a port reproduces them unset and refuses a config that sets them (probed)",
    )
    nullable_fields: list[str] = Field(
        default_factory=list,
        description="config fields whose class allows None, set here, with which HF's forward differs (None is "
        "no ordinary value: no cap, no window, no latent): a port proves each with a case or refuses None (probed)",
    )
    forward_switches: dict[str, bool] = Field(
        default_factory=dict,
        description="boolean config fields (not mapped to Archon args) whose other value changes the logits, with "
        "the family's value: a port reproduces that value and refuses a config that flips it (probed)",
    )
    other: list[str] = Field(default_factory=list, description="features outside this vocabulary, named")
    linear_attention: LinearAttentionLayers | None = _optional_fact(
        "layers mixing tokens by a Gated DeltaNet, beside softmax-attention ones (a hybrid); None: attention only"
    )
    feature_modules: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        exclude_if=is_empty,
        description="facts outside the fixed vocabulary that a feature module ports (skill.feature_modules): the "
        "module's name -> the value it read off the measured fact",
    )


class HandEditPlace(_Frozen):
    """Where the hand edit of a feature no edit supports goes in the Archon module contract,
    measured on the HF model (the tiny instance's forward), so the marker ``edit_model`` leaves
    and the package header name the same place."""

    class_name: str | None = Field(description="the contract class (Attention, FeedForward, ...); None: the model")
    function: str = Field(description="the method the hand edit goes in")
    anchor: str | None = Field(default=None, description="the code of the statement the hand edit goes before")
    statement: str = Field(description="that statement, in words: 'before the output projection wo'")
    width: str | None = Field(
        default=None, description="a norm's width as Archon args (measured: the input it normalises)"
    )

    def where(self, model_class: str) -> str:
        width = f", over {self.width}" if self.width else ""
        return f"{self.class_name or model_class}.{self.function}, {self.statement}{width}"


# ----------------------------------------------------------------- atomic features


class Feature(StrEnum):
    """One portable decision; a delta and an edit are both about one of these."""

    QKV_BIAS = "qkv_bias"
    O_BIAS = "o_bias"
    QK_NORM = "qk_norm"
    QK_NORM_PLACEMENT = "qk_norm_placement"
    GQA = "gqa"
    EXPLICIT_HEAD_DIM = "explicit_head_dim"
    SLIDING_WINDOW = "sliding_window"
    ATTN_SOFTCAP = "attn_softcap"
    ATTN_SCALING = "attn_scaling"
    FUSED_QKV = "fused_qkv"
    FUSED_QKV_LAYOUT = "fused_qkv_layout"
    MLA = "mla"
    ATTN_SINKS = "attn_sinks"
    ATTN_OUTPUT_GATE = "attn_output_gate"
    ATTN_SUB_NORM = "attn_sub_norm"
    DIFFERENTIAL_ATTENTION = "differential_attention"
    CHUNKED_ATTENTION = "chunked_attention"
    O_BIAS_LAYERS = "o_bias_layers"
    QKV_CLIP = "qkv_clip"
    QUERY_POSITION_SCALE = "query_position_scale"
    NOPE_LAYERS = "nope_layers"
    FFN_KIND = "ffn_kind"
    ACTIVATION = "activation"
    FFN_BIAS = "ffn_bias"
    FUSED_GATE_UP = "fused_gate_up"
    FFN_SUB_NORM = "ffn_sub_norm"
    MOE = "moe"
    ROUTER_SCORING = "router_scoring"
    NORM_TOPK_PROB = "norm_topk_prob"
    SCORE_CORRECTION_BIAS = "score_correction_bias"
    ROUTED_SCALING = "routed_scaling"
    GROUPED_TOPK = "grouped_topk"
    SHARED_EXPERTS = "shared_experts"
    SHARED_EXPERT_GATE = "shared_expert_gate"
    MOE_LAYER_PATTERN = "moe_layer_pattern"
    EXPERT_LAYOUT = "expert_layout"
    EXPERT_BIAS = "expert_bias"
    ROUTER_BIAS = "router_bias"
    SELECTION_BIAS_PLACEMENT = "selection_bias_placement"
    MOE_OUTPUT_NORM = "moe_output_norm"
    POSITION_KIND = "position_kind"
    ROPE_TYPE = "rope_type"
    ROTARY_STYLE = "rotary_style"
    ROTARY_DIRECTION = "rotary_direction"
    PARTIAL_ROTARY = "partial_rotary"
    PER_LAYER_ROPE = "per_layer_rope"
    NORM_KIND = "norm_kind"
    NORM_PLACEMENT = "norm_placement"
    FINAL_NORM = "final_norm"
    EMBEDDING_SCALE = "embedding_scale"
    EMBEDDING_NORM = "embedding_norm"
    RESIDUAL_MULTIPLIER = "residual_multiplier"
    LOGIT_MULTIPLIER = "logit_multiplier"
    FINAL_SOFTCAP = "final_softcap"
    WEIGHT_TYING = "weight_tying"
    PADDING_IDX = "padding_idx"
    LM_HEAD_BIAS = "lm_head_bias"
    EMBEDDING_PROJECTION = "embedding_projection"
    PROJECTION_ORIENTATION = "projection_orientation"
    LINEAR_ATTENTION = "linear_attention"
    OTHER = "other"


# Plain-language names, for reports and "unsupported: ..." lines.
FEATURE_TITLES: dict[Feature, str] = {
    Feature.QKV_BIAS: "q/k/v projection bias",
    Feature.O_BIAS: "output projection bias",
    Feature.QK_NORM: "QK norm",
    Feature.QK_NORM_PLACEMENT: "QK norm placement",
    Feature.GQA: "grouped-query attention",
    Feature.EXPLICIT_HEAD_DIM: "explicit head_dim",
    Feature.SLIDING_WINDOW: "sliding-window attention",
    Feature.ATTN_SOFTCAP: "attention logit soft-capping",
    Feature.ATTN_SCALING: "custom attention scaling",
    Feature.FUSED_QKV: "fused qkv projection",
    Feature.FUSED_QKV_LAYOUT: "fused qkv row layout",
    Feature.MLA: "multi-head latent attention",
    Feature.ATTN_SINKS: "attention sinks",
    Feature.ATTN_OUTPUT_GATE: "gated attention output",
    Feature.LINEAR_ATTENTION: "linear-attention layers (Gated DeltaNet) beside attention",
    Feature.ATTN_SUB_NORM: "norm on the attention output before its projection",
    Feature.DIFFERENTIAL_ATTENTION: "differential attention",
    Feature.CHUNKED_ATTENTION: "chunked local attention",
    Feature.O_BIAS_LAYERS: "layers whose output projection has a bias",
    Feature.QKV_CLIP: "q/k/v clipping",
    Feature.QUERY_POSITION_SCALE: "query scaled by absolute position",
    Feature.NOPE_LAYERS: "layers without RoPE",
    Feature.FFN_KIND: "FFN kind",
    Feature.ACTIVATION: "activation",
    Feature.FFN_BIAS: "FFN bias",
    Feature.FUSED_GATE_UP: "fused gate/up projection",
    Feature.FFN_SUB_NORM: "norm on the FFN hidden state before the down projection",
    Feature.MOE: "mixture of experts",
    Feature.ROUTER_SCORING: "router scoring",
    Feature.NORM_TOPK_PROB: "top-k renormalisation",
    Feature.SCORE_CORRECTION_BIAS: "router score-correction bias",
    Feature.ROUTED_SCALING: "routed scaling factor",
    Feature.GROUPED_TOPK: "grouped top-k routing",
    Feature.SHARED_EXPERTS: "shared experts",
    Feature.SHARED_EXPERT_GATE: "shared-expert gate",
    Feature.MOE_LAYER_PATTERN: "MoE layer pattern",
    Feature.EXPERT_LAYOUT: "expert layout on disk",
    Feature.EXPERT_BIAS: "expert projection biases",
    Feature.ROUTER_BIAS: "router linear bias",
    Feature.SELECTION_BIAS_PLACEMENT: "router selection bias on the logits",
    Feature.MOE_OUTPUT_NORM: "norm on the MoE block's output",
    Feature.POSITION_KIND: "position encoding",
    Feature.ROPE_TYPE: "RoPE scaling type",
    Feature.ROTARY_STYLE: "rotary pairing",
    Feature.ROTARY_DIRECTION: "RoPE rotation direction",
    Feature.PARTIAL_ROTARY: "partial rotary",
    Feature.PER_LAYER_ROPE: "per-layer-type RoPE",
    Feature.NORM_KIND: "norm kind",
    Feature.NORM_PLACEMENT: "norm placement",
    Feature.FINAL_NORM: "final norm",
    Feature.EMBEDDING_SCALE: "embedding scale",
    Feature.EMBEDDING_NORM: "embedding norm",
    Feature.RESIDUAL_MULTIPLIER: "residual multiplier",
    Feature.LOGIT_MULTIPLIER: "logit multiplier",
    Feature.FINAL_SOFTCAP: "final logit soft-capping",
    Feature.WEIGHT_TYING: "weight tying",
    Feature.PADDING_IDX: "embedding row without gradient (padding_idx)",
    Feature.LM_HEAD_BIAS: "LM head bias",
    Feature.EMBEDDING_PROJECTION: "embedding projection in/out",
    Feature.PROJECTION_ORIENTATION: "projection weights stored [in, out]",
    Feature.OTHER: "other",
}

# Activations only experts compute (two inputs, gate and up): the MoE edits write them for
# the routed and the shared experts (model_edits.clamped_swiglu_experts), the one activation
# table has no entry for them.
EXPERT_ACTIVATIONS = frozenset({"clamped_swiglu"})

# Target values a port can reach without hand-written code: what the reference code
# (qwen2, qwen3/qwen3_moe and the shared MoE module they use) implements behind a
# config switch, plus what a committed edit of the porting engine produces. The porting
# engine adds a value here in the same commit as the edit that produces it; the
# analyser reads this table to name what is left ("unsupported: ...").
SUPPORTED_EDITS: dict[Feature, frozenset[str]] = {
    # Reference code: qwen2 has q/k/v bias, qwen3 switches it with attention_bias.
    Feature.QKV_BIAS: frozenset({"true", "false"}),
    # Every kind, whatever the block norms compute: the per-head and full-width edits place
    # them, model_edits.qk_norm_kind builds them as what they compute where that differs.
    Feature.QK_NORM: frozenset(
        {
            QKNormKind.NONE,
            QKNormKind.PER_HEAD_RMS,
            QKNormKind.FULL_WIDTH_RMS,
            QKNormKind.RMS_ONE_PLUS_W,
            QKNormKind.LAYER_NORM,
            QKNormKind.WEIGHTLESS,
        }
    ),
    # After RoPE: the qk_norm_after_rope edit (a per-head norm of any kind).
    Feature.QK_NORM_PLACEMENT: frozenset(
        {QKNormPlacement.NONE, QKNormPlacement.BEFORE_ROPE, QKNormPlacement.AFTER_ROPE}
    ),
    Feature.GQA: frozenset({"true", "false"}),
    Feature.EXPLICIT_HEAD_DIM: frozenset({"true", "false"}),
    Feature.WEIGHT_TYING: frozenset({"true", "false"}),
    # The references' embedding freezes the pad_token_id row as HF's does (padding_idx);
    # model_edits.trained_pad_row drops it where HF's embedding trains every row.
    Feature.PADDING_IDX: frozenset({"pad_token_id", "none"}),
    # Shared MoE module (MoEArgs): sigmoid scoring, renormalisation, route scale,
    # node-limited groups, shared experts with a gate; qwen3's decoder_sparse_step.
    Feature.MOE: frozenset({"true", "false"}),
    Feature.ROUTER_SCORING: frozenset({RouterScoring.SOFTMAX, RouterScoring.SIGMOID, RouterScoring.SPARSEMIXER}),
    Feature.NORM_TOPK_PROB: frozenset({"true", "false"}),
    # Router edits (skill/porting/edit_args.py router_setup): the config's routed scaling
    # factor -> MoEArgs.route_scale; n_group/topk_group -> num_expert_groups /
    # num_limited_groups (groups scored by their two best experts, as AReaL's router does);
    # a score-correction bias -> MoE.expert_bias (selection only, AReaL's semantics); one
    # stored [1, E] is reshaped both ways by the adapter (edit_adapter_map.apply_unit_axes_adapter).
    Feature.ROUTED_SCALING: frozenset({"none", "constant"}),
    Feature.GROUPED_TOPK: frozenset({"false", "true"}),
    Feature.SCORE_CORRECTION_BIAS: frozenset({"false", "true", "true, stored with unit axes"}),
    # Shared experts: AReaL's num_shared_experts (a count field, or one MLP an expert wide
    # when no field counts it), or shared_expert_intermediate_size, gated or not.
    Feature.SHARED_EXPERTS: frozenset({"true", "false"}),
    Feature.SHARED_EXPERT_GATE: frozenset({"true", "false"}),
    # Layer-rule edits (edit_args.py is_moe_layer): the config rule the analysis names.
    Feature.MOE_LAYER_PATTERN: frozenset({"all", "interleaved", "leading_dense"}),
    Feature.EXPERT_LAYOUT: frozenset({ExpertLayout.PER_EXPERT_2D, ExpertLayout.FUSED_3D}),
    # model_edits.expert_bias (snippets/experts.py BiasedGroupedExperts, sharded with the
    # experts under EP by the package's expert-parallel styles) and model_edits.router_bias.
    Feature.EXPERT_BIAS: frozenset({"true", "false"}),
    Feature.ROUTER_BIAS: frozenset({"true", "false"}),
    # model_edits.logit_selection_bias (snippets/router.py LogitBiasRouter): the selection bias
    # joins the logits before the score function (reported only then; on the scores it is
    # AReaL's expert_bias, the score-correction bias above).
    Feature.SELECTION_BIAS_PLACEMENT: frozenset({"logits"}),
    # model_edits.moe_output_norm: the block norms' class on the MoE's output in the block, on MoE
    # layers (engine_limits refuses one of another kind than the block norms').
    Feature.MOE_OUTPUT_NORM: frozenset(kind for kind in NormKind if kind is not NormKind.OTHER),
    # Edits of the porting engine (skill/porting/model_edits.py, set_rope.py).
    Feature.O_BIAS: frozenset({"true", "false"}),
    Feature.SLIDING_WINDOW: frozenset(
        {SlidingWindowKind.NONE, SlidingWindowKind.ALL_LAYERS, SlidingWindowKind.PER_LAYER_PATTERN}
    ),
    Feature.ATTN_SOFTCAP: frozenset({"true", "false"}),
    Feature.ATTN_SINKS: frozenset({"true", "false"}),  # attention_sinks edit: one learned logit per head
    # output_gate edit: a separate gate projection of the block input (sigmoid or softplus,
    # per element or per head) scales the attention output before wo; query_gate edit: the
    # gate is the second half of each head's rows of wq.
    Feature.ATTN_OUTPUT_GATE: frozenset(
        {
            "false",
            OutputGateKind.SIGMOID_PER_ELEMENT,
            OutputGateKind.SIGMOID_PER_HEAD,
            OutputGateKind.SOFTPLUS_PER_ELEMENT,
            OutputGateKind.SOFTPLUS_PER_HEAD,
            OutputGateKind.SIGMOID_IN_QUERY,
            OutputGateKind.SOFTPLUS_IN_QUERY,
        }
    ),
    Feature.QKV_CLIP: frozenset({"true", "false"}),  # clamped as they leave the projections
    # model_edits.query_position_scale: q * (1 + beta * log(1 + floor(p / period))) after RoPE.
    Feature.QUERY_POSITION_SCALE: frozenset({"none", "log_floor"}),
    Feature.ATTN_SCALING: frozenset({"default", "custom"}),  # custom: a config multiplier (Granite)
    Feature.FFN_KIND: frozenset({FFNKind.GATED, FFNKind.PLAIN}),
    # Entries of the one activation table (skill/activations.py) the activation edit writes.
    # xielu (learned, module=True): proven by apertus, its scalars replicated over TP.
    # clamped_swiglu: routed experts, biased or not, and shared experts
    # (model_edits.clamped_swiglu_experts; engine_limits refuses it on a dense layer's MLP).
    Feature.ACTIVATION: frozenset(
        {"silu", "gelu_pytorch_tanh", "gelu", "quick_gelu", "relu", "relu2", "xielu", "clamped_swiglu"}
    ),
    Feature.FFN_BIAS: frozenset({"true", "false"}),
    # model_edits.last_layer_o_bias: the last layer's output projection alone is biased.
    Feature.O_BIAS_LAYERS: frozenset({"last"}),
    # model_edits.attention_sub_norm / ffn_sub_norm: the block norms' class over the width the
    # projection reads (engine_limits refuses one of another kind than the block norms').
    Feature.ATTN_SUB_NORM: frozenset(kind for kind in NormKind if kind is not NormKind.OTHER),
    # model_edits.differential_attention: head pairs over paired values, lambda, the pair norm.
    Feature.DIFFERENTIAL_ATTENTION: frozenset({"true"}),
    # model_edits.chunked_attention: the chunks become the kernel's documents, on every layer
    # or on the layers of one layer_types kind.
    Feature.CHUNKED_ATTENTION: frozenset({"all_layers", "per_layer_kind"}),
    Feature.FFN_SUB_NORM: frozenset(kind for kind in NormKind if kind is not NormKind.OTHER),
    Feature.NORM_KIND: frozenset(
        {
            NormKind.RMS,
            NormKind.RMS_ONE_PLUS_W,
            NormKind.RMS_WEIGHTLESS,
            NormKind.LAYER_NORM,
            NormKind.LAYER_NORM_NO_BIAS,
            NormKind.LAYER_NORM_WEIGHTLESS,
            NormKind.LAYER_NORM_ONE_PLUS_W,
        }
    ),
    # post_ln: model_edits.post_ln (each residual sum normalised, x = norm(x + f(x))).
    Feature.NORM_PLACEMENT: frozenset(
        {
            NormPlacement.PRE,
            NormPlacement.POST_SUBLAYER,
            NormPlacement.SANDWICH,
            NormPlacement.PARALLEL,
            NormPlacement.POST_LN,
        }
    ),
    # false: model_edits.no_final_norm (the last block's output goes straight to the LM head).
    Feature.FINAL_NORM: frozenset({"true", "false"}),
    Feature.EMBEDDING_SCALE: frozenset({"none", "sqrt_dim", "constant"}),
    # model_edits.embedding_norm: the block norm's class on the embeddings, whatever it computes
    # (the analysis refuses an embedding norm of another kind than the block norms').
    Feature.EMBEDDING_NORM: frozenset({"none", *(kind for kind in NormKind if kind is not NormKind.OTHER)}),
    Feature.RESIDUAL_MULTIPLIER: frozenset({"none", "constant"}),
    Feature.LOGIT_MULTIPLIER: frozenset({"none", "constant"}),
    Feature.FINAL_SOFTCAP: frozenset({"true", "false"}),
    # model_edits.py lm_head_bias: the output projection gains a bias (ColwiseParallel shards it
    # with the weight's rows; the adapter maps lm_head.bias -> output.bias).
    Feature.LM_HEAD_BIAS: frozenset({"true", "false"}),
    # model_edits.py embedding_projection: embeddings and LM head at the config's width, a
    # projection in before layer 0 and out after the final norm where it differs from dim.
    Feature.EMBEDDING_PROJECTION: frozenset({"none", "in_out"}),
    Feature.ROPE_TYPE: frozenset({"default", "linear", "llama3", "yarn"}),
    Feature.ROTARY_STYLE: frozenset({RotaryStyle.HALF, RotaryStyle.INTERLEAVED}),
    # model_edits.reversed_rotation: the RoPE cache holds -sin (the rotation by minus the angle).
    Feature.ROTARY_DIRECTION: frozenset({RotaryDirection.STANDARD, RotaryDirection.REVERSED}),
    # Partial rotary: one width (snippets/rope.py apply_rotary_emb, which rotates the cache's
    # width), or one per layer type (model_edits.py per_layer_rope, edit_args.py sliding_rotary_dim).
    Feature.PARTIAL_ROTARY: frozenset({"true", "false", "per_layer_type"}),
    # One RoPE cache per layer type (model_edits.py per_layer_rope, edit_args.py sliding_rope_*).
    Feature.PER_LAYER_ROPE: frozenset({"true", "false"}),
    # RoPE left out per layer as the config says (model_edits.py nope_layers).
    Feature.NOPE_LAYERS: frozenset({"false", "per_layer_field", "layer_type"}),
    # Learned absolute positions (model_edits.py: remove_rope, learned_positions); ALiBi
    # (remove_rope, alibi_attention: snippets/attention.py AlibiAttention); a fixed sinusoidal
    # table (remove_rope, sinusoidal_positions: snippets/positions.py).
    Feature.POSITION_KIND: frozenset(
        {PositionKind.ROPE, PositionKind.LEARNED, PositionKind.ALIBI, PositionKind.SINUSOIDAL}
    ),
    # Adapter edits (skill/porting/edit_adapter_map.py): the model keeps wq/wk/wv and w1/w3,
    # the adapter splits a fused checkpoint tensor along dim 0 and concatenates it back.
    Feature.FUSED_QKV: frozenset({"true", "false"}),
    # The adapter regroups a per-KV-head interleaved fused tensor (GPT-NeoX, Bloom, Falcon) and
    # unblocks a fixed-block one (CodeGen's 4 blocks of q, v, k).
    Feature.FUSED_QKV_LAYOUT: frozenset(
        {FusedQKVLayout.NONE, FusedQKVLayout.STACKED, FusedQKVLayout.GROUPED, FusedQKVLayout.BLOCKED}
    ),
    Feature.FUSED_GATE_UP: frozenset({"true", "false"}),
    # The adapter transposes Conv1D-stored projections (edit_adapter_map.apply_transposed_adapter).
    Feature.PROJECTION_ORIENTATION: frozenset({WeightOrientation.OUT_IN, WeightOrientation.IN_OUT}),
}

# The references the engine's edits are written against (their attention and MoE contract):
# the built-in edits and the feature modules (skill.feature_modules) target these.
EDITABLE_REFERENCES = ("qwen2", "qwen3")

# The values an edit produces on the deepseek_v3 (MLA) reference, whose attention, router and
# RoPE no edit targets: only edits written against the block, embedding and logits contract
# that model_edits.MLA_MODEL_EDITS / edit_args apply there. Everything else from deepseek_v3
# is supported only where the reference itself has the value.
MLA_SUPPORTED_EDITS: dict[Feature, frozenset[str]] = {
    # model_edits.dense_layers: a SwiGLU feed-forward on every layer, no MoE (MoEArgs) at all.
    Feature.MOE: frozenset({"false"}),
    # The block, embedding and logit scalar edits (embedding_multiplier, residual_multiplier,
    # logits_scaling / logits_multiplier), their args fields by edit_args.mla_scalar_fields.
    Feature.EMBEDDING_SCALE: frozenset({"constant"}),
    Feature.RESIDUAL_MULTIPLIER: frozenset({"constant"}),
    Feature.LOGIT_MULTIPLIER: frozenset({"constant"}),
    # skill/porting/mla_router.py rewrites the copied _moe_args: softmax scores (AReaL's
    # score_func="softmax"), no score-correction bias (no load_balance_coeff, no adapter key;
    # model_edits.no_correction_bias drops the block's expert_bias set-up),
    # a norm_topk_prob HF never reads fixed as HF applies it; groups scored by their best expert
    # (DeepSeek-V2's group_limited_greedy, switched by topk_method) are the package's router
    # (model_edits.max_group_router, snippets/router.py MaxGroupTopKRouter).
    Feature.ROUTER_SCORING: frozenset({RouterScoring.SOFTMAX}),
    Feature.SCORE_CORRECTION_BIAS: frozenset({"false"}),
    Feature.GROUPED_TOPK: frozenset({"max_group_score"}),
    # No shared experts: the reference's _moe_args reads n_shared_experts (0 when the config
    # has none), AReaL's MoE then builds none, and the TP plan skips them when None.
    Feature.SHARED_EXPERTS: frozenset({"false"}),
    # model_edits.moe_output_norm writes it in the block, which this reference shares.
    Feature.MOE_OUTPUT_NORM: frozenset(kind for kind in NormKind if kind is not NormKind.OTHER),
}


class FeatureDelta(_Frozen):
    """One feature whose value differs between the reference and the target family."""

    feature: Feature | str = Field(description="a Feature, or the name of the feature module porting it")
    title: str
    reference: str
    target: str
    supported: bool = Field(description="the reference or an engine edit covers the target value")


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _partial_rotary(pos: PositionFeatures) -> str:
    """``"per_layer_type"`` when the layer types rotate different shares of each head,
    ``"true"`` when every layer rotates the same part of it, ``"false"`` for whole heads."""
    factors = set((pos.layer_rotary_factors or {}).values())
    if len(factors) > 1:
        return "per_layer_type"
    return _flag(pos.partial_rotary_factor != 1.0 or any(f != 1.0 for f in factors))


def _multiplier(value: float | None, source: object) -> str:
    """``"constant"`` when the family scales by a factor: a non-neutral value, or a config
    field the forward reads (a checkpoint sets it even where the default is 1.0)."""
    return "none" if value in (None, 1.0) and source is None else "constant"


def _nope_rule(att: AttentionFeatures) -> str:
    """``"false"``, or how the config says which layers skip RoPE: a per-layer list field
    (``"per_layer_field"``), a layer type (``"layer_type"``), or ``"true"`` when no
    config field the analysis found reproduces the measured layers."""
    if not att.nope_layers:
        return "false"
    if att.nope_layers_field is not None:
        return "per_layer_field"
    if att.nope_layer_type is not None:
        return "layer_type"
    return "true"


def _linear_attention_value(layers: LinearAttentionLayers) -> str:
    """The mixer, and how its checkpoint stacks the reference's projections where it does
    (the layout itself is ``layers.fused``)."""
    kinds = sorted({"by key head" if weight.grouped else "whole" for weight in layers.fused})
    return layers.kind + (f", stacked {' and '.join(kinds)}" if kinds else "")


# The linear-attention values a port from the qwen3_5 reference writes: its own, and the
# checkpoint stacking its projections one way (skill.porting.hybrid_package).
HYBRID_LINEAR_ATTENTION = frozenset(
    {"gated_deltanet", "gated_deltanet, stacked by key head", "gated_deltanet, stacked whole"}
)


def _layer_pattern(moe: MoEFeatures) -> str:
    if not moe.moe_layers:
        return "none"
    if moe.n_layers and len(moe.moe_layers) == moe.n_layers:
        return "all"
    dense = [i for i in range(moe.n_layers) if i not in set(moe.moe_layers)]
    pattern = "leading_dense" if dense == list(range(len(dense))) else "interleaved"
    # A port generates the rule, not the list: without a config rule there is nothing to read.
    return pattern if moe.moe_layer_rule else f"{pattern}, no config rule"


def _correction_bias(moe: MoEFeatures) -> str:
    if not moe.score_correction_bias:
        return "false"
    if not moe.score_correction_key:
        return "true, no checkpoint key"  # seen in the module tree only: nothing to map
    if len(moe.score_correction_shape) > 1:
        # Leading axes of size 1 only (the analysis takes no other key): [1, E] on disk.
        return "true, stored with unit axes"
    return "true"


def _shared_experts(moe: MoEFeatures) -> str:
    if moe.shared_experts <= 0:
        return "false"
    if moe.shared_expert_width in ("experts_multiple", "own_field"):
        return "true"
    return "true, width unmeasured"


def _grouped_topk(moe: MoEFeatures) -> str:
    if moe.group_scoring == "max":
        return "max_group_score"  # DeepSeek-V2's group_limited_greedy
    if moe.grouped_topk or moe.n_group_field is not None:
        return "true"
    return "false"


def feature_values(checklist: Checklist) -> dict[Feature, str]:
    """Reduce a checklist to one string value per :class:`Feature`, in enum order.

    Numeric details (window sizes, ranks, multipliers) stay in the checklist; the value
    here is the decision an edit is about (``"custom"`` scaling, ``"constant"``
    multiplier). ``Feature.OTHER`` holds the out-of-vocabulary names joined by "; ".
    """
    att, ffn, moe, pos, norm, sc = (
        checklist.attention,
        checklist.ffn,
        checklist.moe,
        checklist.positions,
        checklist.norm,
        checklist.scalars,
    )
    qkv = att.q_bias or att.k_bias or att.v_bias
    values: dict[Feature, str] = {
        Feature.QKV_BIAS: _flag(qkv),
        Feature.O_BIAS: _flag(att.o_bias),
        Feature.QK_NORM: att.qk_norm.value,
        Feature.QK_NORM_PLACEMENT: att.qk_norm_placement.value,
        Feature.GQA: _flag(att.gqa),
        Feature.EXPLICIT_HEAD_DIM: _flag(att.explicit_head_dim),
        Feature.SLIDING_WINDOW: att.sliding_window.kind.value,
        Feature.ATTN_SOFTCAP: _flag(att.logit_softcap is not None),
        Feature.ATTN_SCALING: "custom" if att.custom_scaling else "default",
        Feature.FUSED_QKV: _flag(att.fused_qkv),
        Feature.FUSED_QKV_LAYOUT: att.fused_qkv_layout.value,
        Feature.MLA: _flag(att.mla is not None),
        Feature.ATTN_SINKS: _flag(att.sinks),
        Feature.ATTN_OUTPUT_GATE: (att.output_gate_kind or OutputGateKind.UNMATCHED).value
        if att.output_gate
        else "false",
        Feature.QKV_CLIP: _flag(att.clip_qkv is not None or att.clip_qkv_field is not None),
        Feature.QUERY_POSITION_SCALE: "log_floor" if att.query_position_scale is not None else "none",
        Feature.NOPE_LAYERS: _nope_rule(att),
        Feature.FFN_KIND: ffn.kind.value,
        Feature.ACTIVATION: ffn.activation,
        Feature.FFN_BIAS: _flag(ffn.bias),
        Feature.FUSED_GATE_UP: _flag(ffn.fused_gate_up),
        Feature.MOE: _flag(moe is not None),
        Feature.POSITION_KIND: pos.kind.value,
        Feature.NORM_KIND: norm.kind.value,
        Feature.NORM_PLACEMENT: norm.placement.value,
        Feature.FINAL_NORM: _flag(norm.final_norm),
        Feature.EMBEDDING_SCALE: sc.embedding_scale_kind,
        Feature.EMBEDDING_NORM: sc.embedding_norm.value if sc.embedding_norm is not None else "none",
        Feature.RESIDUAL_MULTIPLIER: _multiplier(sc.residual_multiplier, sc.residual_multiplier_field),
        Feature.LOGIT_MULTIPLIER: _multiplier(sc.logit_multiplier, sc.logit_multiplier_source),
        Feature.FINAL_SOFTCAP: _flag(sc.final_logit_softcap is not None),
        Feature.WEIGHT_TYING: _flag(sc.tie_word_embeddings),
        Feature.PADDING_IDX: sc.padding_idx_field or "none",
        Feature.LM_HEAD_BIAS: _flag(sc.lm_head_bias),
        Feature.EMBEDDING_PROJECTION: "in_out" if sc.embedding_projection_field is not None else "none",
        Feature.PROJECTION_ORIENTATION: (
            WeightOrientation.IN_OUT if checklist.transposed_weights else WeightOrientation.OUT_IN
        ).value,
        Feature.OTHER: "; ".join(checklist.other),
    }
    # Only a family with the norm has the feature: the others' reports read as before.
    if att.sub_norm is not None:
        values[Feature.ATTN_SUB_NORM] = att.sub_norm.value
    if att.differential is not None:
        values[Feature.DIFFERENTIAL_ATTENTION] = "true"
    if att.chunked is not None:
        values[Feature.CHUNKED_ATTENTION] = "all_layers" if att.chunked.chunked_kind is None else "per_layer_kind"
    if att.o_bias_last_layer_key is not None:
        values[Feature.O_BIAS_LAYERS] = "last"
    if ffn.sub_norm is not None:
        values[Feature.FFN_SUB_NORM] = ffn.sub_norm.value
    if checklist.linear_attention is not None:
        values[Feature.LINEAR_ATTENTION] = _linear_attention_value(checklist.linear_attention)
    if pos.kind is PositionKind.ROPE:
        # RoPE details only mean something for a rotary family.
        values.update(
            {
                Feature.ROPE_TYPE: pos.rope_type or "default",
                Feature.ROTARY_STYLE: pos.rotary_style.value,
                Feature.ROTARY_DIRECTION: pos.rotary_direction.value,
                Feature.PARTIAL_ROTARY: _partial_rotary(pos),
                Feature.PER_LAYER_ROPE: _flag(pos.per_layer_type_rope),
            }
        )
    if moe is not None:
        values.update(
            {
                Feature.ROUTER_SCORING: moe.router_scoring.value,
                Feature.NORM_TOPK_PROB: _flag(moe.norm_topk_prob),
                Feature.SCORE_CORRECTION_BIAS: _correction_bias(moe),
                Feature.ROUTED_SCALING: _multiplier(moe.routed_scaling_factor, moe.routed_scaling_field),
                Feature.GROUPED_TOPK: _grouped_topk(moe),
                Feature.SHARED_EXPERTS: _shared_experts(moe),
                Feature.SHARED_EXPERT_GATE: _flag(moe.shared_expert_gate),
                Feature.MOE_LAYER_PATTERN: _layer_pattern(moe),
                Feature.EXPERT_LAYOUT: moe.expert_layout.value,
                Feature.EXPERT_BIAS: _flag(moe.expert_bias),
                Feature.ROUTER_BIAS: _flag(moe.router_bias),
            }
        )
        if moe.selection_bias_placement == "logits":
            values[Feature.SELECTION_BIAS_PLACEMENT] = "logits"
        if moe.output_norm is not None:
            values[Feature.MOE_OUTPUT_NORM] = moe.output_norm.value
    return {feature: values[feature] for feature in Feature if feature in values}


def is_supported(feature: Feature, target: str, reference_values: set[str] | frozenset[str] = frozenset()) -> bool:
    """Whether a target value is covered: a reference has it or an edit produces it."""
    if feature is Feature.OTHER:
        return target == ""
    return target in reference_values or target in SUPPORTED_EDITS.get(feature, frozenset())
