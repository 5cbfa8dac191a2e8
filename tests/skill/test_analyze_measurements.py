"""What the analyser measures by running the forward, checked against HF modeling source.

Each test names the facts it checks and where transformers states them. The features
here are the ones attribute names or layer 0 alone would get wrong: layers without
RoPE, parts that differ between layers, parameter-less norms, config scalars whose
default is neutral, FFN projections held by the layer itself, rotation inside the
attention class, and multi-query attention behind a flag.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from skill.analysis import AnalyzeInput, analyze_hf_model, probes
from skill.features import SUPPORTED_EDITS, Feature, NormKind, feature_values
from skill.porting.plan import plan_for
from tests.skill.test_analyze_families import report_for

# ----------------------------------------------------------- 1. layers without RoPE


def _full_attention_layers(model_type: str) -> list[int]:
    config = AutoConfig.for_model(model_type)
    return [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]


def test_nope_layers_of_smollm3_by_probe() -> None:
    # SmolLM3Attention: `self.use_rope = config.no_rope_layers[layer_idx]`, and the default
    # no_rope_layers is int((i + 1) % no_rope_layer_interval != 0) with interval 4, 36 layers.
    report = report_for("smollm3")
    assert report.checklist.attention.nope_layers == list(range(3, 36, 4))
    # The config's per-layer list says which: the port reads it (nope_layers edit).
    assert report.checklist.attention.nope_layers_field == "no_rope_layers"
    assert feature_values(report.checklist)[Feature.NOPE_LAYERS] == "per_layer_field"
    assert not [line for line in report.unsupported if "RoPE" in line]


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        # Exaone4Attention: rotary only `if self.sliding_window is None or self.is_sliding`;
        # layer_types: full attention where (i + 1) % 4 == 0, 32 layers.
        ("exaone4", list(range(3, 32, 4))),
        # ExaoneMoeAttention: the same rule, 32 layers.
        ("exaone_moe", list(range(3, 32, 4))),
        # Kolibri1Attention: the same rule; layer_types full where (i + 1) % 5 == 0, 50 layers.
        ("kolibri1", list(range(4, 50, 5))),
        # FlintAttention: rotary only on sliding layers; full attention on layers 0, 1,
        # every i % 4 == 1 and the last of 49.
        ("flint", sorted({0, 1, 48} | set(range(1, 49, 4)))),
    ],
)
def test_nope_layers_without_a_use_rope_attribute(model_type: str, expected: list[int]) -> None:
    report = report_for(model_type)
    assert report.checklist.attention.nope_layers == expected
    assert expected == _full_attention_layers(model_type)  # the HF rule, read from the config
    assert any("position probe" in line and "full-depth" in line for line in report.evidence)
    # The rule is the layer type: the port reads layer_types (nope_layers edit).
    assert report.checklist.attention.nope_layer_type == "full_attention"
    assert feature_values(report.checklist)[Feature.NOPE_LAYERS] == "layer_type"
    assert "unsupported: layers without RoPE" not in report.unsupported


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "mistral"])
def test_every_layer_rotates(model_type: str) -> None:
    # Rotary on every layer (gemma3_text: both local and global layers, with their own bases).
    report = report_for(model_type)
    assert report.checklist.attention.nope_layers == []
    assert feature_values(report.checklist)[Feature.NOPE_LAYERS] == "false"


# ------------------------------------------------------- 2. per-layer differences


def test_a_bias_of_the_last_layers_output_projection_is_measured_not_named() -> None:
    # GPTNeoXJapaneseLayer: attention built with use_bias=layer_number == num_hidden_layers - 1,
    # which adds a `dense_bias` parameter to the last layer's attention only (32 layers), added to
    # `dense`'s output: measured as that projection's bias (folded into it, the logits stay), it is
    # the last_layer_o_bias edit's, no per-layer difference.
    report = report_for("gpt_neox_japanese")
    assert not [item for item in report.checklist.other if item.startswith("per-layer difference:")]
    assert report.checklist.attention.o_bias_last_layer_key == "attention.dense_bias"
    assert not report.checklist.attention.o_bias
    assert report.unsupported == []
    assert plan_for("gpt_neox_japanese").o_bias_last_layer
    assert report_for("llama").checklist.attention.o_bias_last_layer_key is None


def test_qk_norm_missing_from_exactly_the_nope_layers_is_measured_not_named() -> None:
    # Llama4TextAttention: `if self.config.use_qk_norm and self.use_rope: self.qk_norm = ...`,
    # so the no-RoPE layers (every 4th) have no QK norm: a fact the port applies
    # (tests/skill/test_rope_layer_qk_norm.py), no per-layer difference.
    report = report_for("llama4_text")
    assert report.checklist.attention.qk_norm_rope_layers_only is True
    assert not [item for item in report.checklist.other if item.startswith("per-layer difference:")]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "deepseek_v3", "gemma2"])
def test_uniform_layers_have_no_per_layer_difference(model_type: str) -> None:
    # deepseek_v3: first_k_dense_replace=3 dense layers, then MoE: the MoE layer pattern
    # describes that, it is not a per-layer difference.
    report = report_for(model_type)
    assert not [item for item in report.checklist.other if item.startswith("per-layer difference")]


def test_window_on_some_layers_follows_the_field_marking_them() -> None:
    # GPTNeoSelfAttention: a "local" layer (config.attention_layers, from attention_types)
    # masks keys further back than window_size; "global" layers do not.
    report = report_for("gpt_neo")
    window = report.checklist.attention.sliding_window
    assert (window.layer_kinds_field, window.windowed_kind) == ("attention_layers", "local")
    assert not any("sliding window" in line for line in report.unsupported)


def test_window_on_some_layers_no_field_explains_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # The layer-kind field is measured, not taken by its values' names: where windowing
    # every "local" layer does not window every layer, no field explains the window, which
    # reaches some layers but not all: named, never dropped silently.
    monkeypatch.setattr(probes, "probe_window_reaches_all_layers", lambda *args: False)
    report = analyze_hf_model(AnalyzeInput(source="gpt_neo"))
    line = "sliding window (window_size) on some layers only, chosen by a field other than layer_types"
    assert f"unsupported: {line}" in report.unsupported
    assert report.checklist.attention.sliding_window.evidence.endswith("some layers only")


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_window_that_reaches_every_layer_or_none_is_not_refused(model_type: str) -> None:
    # Qwen2Config drops its window unless use_sliding_window (no layer windowed);
    # MistralConfig windows every layer.
    report = report_for(model_type)
    assert not any("sliding window" in line for line in report.unsupported)


# ------------------------------------------------------------ 3. parameter-less norms


def test_weightless_layer_norm_is_pre_norm() -> None:
    # OlmoLayerNorm: F.layer_norm(x, normalized_shape, None, None, eps=1e-5), no parameters;
    # OlmoDecoderLayer: input_layernorm -> self_attn -> residual add (pre-norm).
    report = report_for("olmo")
    assert report.checklist.norm.kind == NormKind.LAYER_NORM_WEIGHTLESS
    assert report.checklist.norm.placement == "pre"
    assert NormKind.LAYER_NORM_WEIGHTLESS in SUPPORTED_EDITS[Feature.NORM_KIND]
    # Its epsilon (1e-5) is hard-coded, no config field: measured on the norm.
    assert (report.checklist.norm.eps_field, report.checklist.norm.eps) == (None, 1e-5)
    assert not any("norm" in line for line in report.unsupported)


def test_weightless_rms_norm() -> None:
    # HrmTextRMSNorm: x * rsqrt(mean(x^2) + eps), no weight.
    assert report_for("hrm_text").checklist.norm.kind == NormKind.RMS_WEIGHTLESS


# ---------------------------------------------------- 4. config-driven scalar factors


def test_granite_multipliers_at_their_neutral_defaults() -> None:
    # GraniteConfig: embedding_multiplier, residual_multiplier, attention_multiplier and
    # logits_scaling all default to 1.0; GraniteModel multiplies the embeddings,
    # GraniteAttention uses scaling = attention_multiplier, the layer scales both
    # sub-layer outputs by residual_multiplier, and the head divides by logits_scaling.
    report = report_for("granite")
    attention, scalars = report.checklist.attention, report.checklist.scalars
    assert attention.custom_scaling
    assert (attention.scaling_source.field, attention.scaling_source.relation) == ("attention_multiplier", "x")
    assert scalars.embedding_scale_kind == "constant"
    assert (scalars.embedding_scale_source.field, scalars.embedding_scale_source.relation) == (
        "embedding_multiplier",
        "x",
    )
    assert scalars.residual_multiplier_field == "residual_multiplier"
    assert scalars.residual_multiplier is None  # the default's value is neutral
    assert (scalars.logit_multiplier_source.field, scalars.logit_multiplier_source.relation) == (
        "logits_scaling",
        "1/x",
    )
    values = feature_values(report.checklist)
    assert values[Feature.EMBEDDING_SCALE] == "constant"
    assert values[Feature.RESIDUAL_MULTIPLIER] == "constant"
    assert values[Feature.LOGIT_MULTIPLIER] == "constant"
    assert values[Feature.ATTN_SCALING] == "custom"


def test_hyperclovax_multiplies_the_logits() -> None:
    # HyperCLOVAXForCausalLM: `logits = self.lm_head(hidden_states) * self.config.logits_scaling`.
    scalars = report_for("hyperclovax").checklist.scalars
    assert (scalars.logit_multiplier_source.field, scalars.logit_multiplier_source.relation) == (
        "logits_scaling",
        "x",
    )
    assert scalars.residual_multiplier_field == "residual_multiplier"


@pytest.mark.parametrize("model_type", ["olmo", "olmoe"])
def test_clip_qkv_defaulting_to_none_is_reported(model_type: str) -> None:
    # OlmoAttention / OlmoeAttention: `if self.config.clip_qkv is not None: states.clamp_(...)`;
    # the config default is None, OLMo checkpoints set 8.0. The clip_qkv edit ports it; OLMoE
    # clamps q and k after its QK norm (`q = self.q_norm(self.q_proj(x))`, then clamp_), an
    # order the probe measures on a tiny model whose config sets the clamp. OLMo has no QK norm.
    report = report_for(model_type)
    attention = report.checklist.attention
    assert attention.clip_qkv_field == "clip_qkv"
    assert attention.clip_qkv is None
    assert "true" in SUPPORTED_EDITS[Feature.QKV_CLIP]
    assert [line for line in report.unsupported if "clipping" in line] == []
    assert attention.clip_qkv_after_qk_norm is (None if model_type == "olmo" else True)
    assert plan_for(model_type).clip_after_qk_norm is (model_type == "olmoe")


def test_clip_with_a_qk_norm_whose_order_the_probe_could_not_tell_is_refused() -> None:
    from skill.analysis.reference import engine_limits

    checklist = report_for("olmoe").checklist
    unmeasured = checklist.attention.model_copy(update={"clip_qkv_after_qk_norm": None})
    limits = engine_limits(checklist.model_copy(update={"attention": unmeasured}))
    assert "q/k/v clipping together with a QK norm (their order is not measured)" in limits


def test_query_pre_attn_scalar_sets_the_scale() -> None:
    # Gemma2Attention: scaling = config.query_pre_attn_scalar ** -0.5 (256 = head_dim by
    # default; the 27B checkpoint sets 144 with head_dim 128).
    attention = report_for("gemma2").checklist.attention
    assert attention.custom_scaling
    assert (attention.scaling_source.field, attention.scaling_source.relation) == ("query_pre_attn_scalar", "x**-0.5")


def test_routed_scaling_factor_at_one_is_config_driven() -> None:
    # DeepseekV2Moe: topk_weight * routed_scaling_factor; DeepseekV2Config default 1.0.
    moe = report_for("deepseek_v2").checklist.moe
    assert moe.routed_scaling_field == "routed_scaling_factor"
    assert feature_values(report_for("deepseek_v2").checklist)[Feature.ROUTED_SCALING] == "constant"


def test_families_without_scalar_fields_report_none() -> None:
    checklist = report_for("llama").checklist
    assert checklist.scalars.residual_multiplier_field is None
    assert checklist.scalars.logit_multiplier_source is None
    assert checklist.scalars.embedding_scale_source is None
    assert checklist.attention.clip_qkv_field is None
    assert not checklist.attention.custom_scaling


# ------------------------------------------------------ 5. FFN held by the layer


@pytest.mark.parametrize(
    ("model_type", "width"),
    [
        # BioGptDecoderLayer: self.fc1 = nn.Linear(hidden, intermediate_size), fc2 back (bias on).
        ("biogpt", 4096),
        # OPTDecoderLayer: fc1/fc2 = nn.Linear(..., bias=config.enable_bias), ffn_dim 3072.
        ("opt", 3072),
        # XGLMDecoderLayer: fc1/fc2 nn.Linear with bias, ffn_dim 4096.
        ("xglm", 4096),
    ],
)
def test_ffn_projections_in_the_layer(model_type: str, width: int) -> None:
    ffn = report_for(model_type).checklist.ffn
    assert ffn.bias is True
    assert ffn.kind == "plain"
    assert ffn.intermediate_size == width


# ------------------------------------------- 6. rotation in attention, multi-query


@pytest.mark.parametrize("model_type", ["codegen", "gptj"])
def test_partial_rotary_inside_attention(model_type: str) -> None:
    # CodeGenAttention / GPTJAttention: no rotary module; embed_positions of rotary_dim=64
    # applied by apply_rotary_pos_emb to the first 64 of head_dim 4096 / 16 = 256, pairs
    # from rotate_every_two (x[..., ::2], x[..., 1::2]).
    positions = report_for(model_type).checklist.positions
    assert positions.kind == "rope"
    assert positions.partial_rotary_factor == pytest.approx(0.25)
    assert positions.rotary_style == "interleaved"


def test_falcon_multi_query() -> None:
    # FalconAttention: num_kv_heads = config.num_kv_heads if new_decoder_architecture or not
    # multi_query else 1; FalconConfig defaults multi_query=True, num_kv_heads=71.
    attention = report_for("falcon").checklist.attention
    assert attention.n_kv_heads == 1
    assert attention.gqa is True


# ------------------------------------------------------------ multi-head latent attention


def test_rope_interleave_field_decides_when_the_modeling_code_branches_on_it() -> None:
    # DeepseekV3Attention: apply_rotary_pos_emb_interleave if config.rope_interleave else
    # apply_rotary_pos_emb. Both helpers are in the file; the field decides.
    from skill.analysis.measure import build_variant_checklist

    assert report_for("deepseek_v3").checklist.positions.rotary_style == "interleaved"
    half = build_variant_checklist("deepseek_v3", (("rope_interleave", False),))
    assert half.positions.rotary_style == "half"


@pytest.mark.parametrize(
    ("model_type", "unsupported"),
    [
        ("deepseek_v3", []),
        # Glm4MoeLite: DeepSeek-V3's MLA and router with one expert group (n_group=1).
        ("glm4_moe_lite", []),
        # DeepseekV2Moe: softmax scores, no correction bias, groups scored by their best
        # expert (the mla_router args rewrite and the max_group_router edit).
        ("deepseek_v2", []),
        # Dense MLA (no experts at all): the dense_layers edit on deepseek_v3.
        ("youtu", []),
        # Dense MLA with scale_emb, scale_depth / sqrt(num_hidden_layers) residuals and
        # logits divided by hidden_size / dim_model_base.
        ("minicpm3", []),
    ],
)
def test_mla_families_start_from_deepseek_v3(model_type: str, unsupported: list[str]) -> None:
    report = report_for(model_type)
    assert report.checklist.attention.mla is not None
    assert report.reference == "deepseek_v3"
    assert report.unsupported == unsupported


def test_minicpm3_scalars_are_named_by_what_they_multiply() -> None:
    # MiniCPM3DecoderLayer: `residual + branch * (scale_depth / sqrt(num_hidden_layers))`;
    # MiniCPM3ForCausalLM: `lm_head(h / logits_scaling)`, logits_scaling = hidden_size /
    # dim_model_base (a property, applied before the head).
    scalars = report_for("minicpm3").checklist.scalars
    assert scalars.residual_multiplier_field == "scale_depth"
    residual = scalars.residual_multiplier_source
    assert (residual.field, residual.relation) == ("scale_depth", "x")
    assert (residual.times.field, residual.times.relation) == ("num_hidden_layers", "x**-0.5")
    assert scalars.residual_multiplier == pytest.approx(1.4 / 62**0.5)
    logit = scalars.logit_multiplier_source
    # Not sqrt(kv_lora_rank) nor vocab_size / hidden_size, whose tiny values happen to fit too:
    # only a field whose move moves the factor explains it.
    assert (logit.field, logit.relation) == ("dim_model_base", "x")
    assert (logit.times.field, logit.times.relation) == ("hidden_size", "1/x")
    assert scalars.logit_multiplier == pytest.approx(256 / 2560)
    assert (scalars.embedding_scale_source.field, scalars.embedding_scale) == ("scale_emb", 12.0)


def test_residual_probe_measures_the_branch_factor() -> None:
    from skill.analysis import modules as mt
    from skill.analysis import probes
    from skill.tiny_model import build_tiny_model, tiny_config

    for model_type, overrides, expected in (
        ("llama", {}, 1.0),
        ("granite", {"residual_multiplier": 0.3}, 0.3),
        ("minicpm3", {"scale_depth": 2.0}, 2.0 / 2**0.5),
    ):
        config = tiny_config(model_type, num_hidden_layers=2, **overrides)
        model = build_tiny_model(config, seed=0)
        anatomy = mt.anatomy(model, 2)
        assert probes.probe_residual_multiplier(model, anatomy, config) == pytest.approx(expected, rel=1e-4)
    # A factor applied to the hidden states before the LM head is a logit factor too.
    config = tiny_config("minicpm3")
    model = build_tiny_model(config, seed=0)
    anatomy = mt.anatomy(model, config.num_hidden_layers)
    assert probes.probe_logit_multiplier(model, anatomy, config) == pytest.approx(1 / config.logits_scaling)


def test_deepseek_v3_values_do_not_cover_qwen_based_families() -> None:
    # Sigmoid routing with a correction bias is the deepseek_v3 reference's, not an edit on
    # qwen3: a non-MLA family with it is still refused.
    from skill.analysis.reference import all_reference_values
    from skill.features import Feature

    assert "true" not in all_reference_values()[Feature.SCORE_CORRECTION_BIAS]
    assert "true" in all_reference_values(("deepseek_v3",))[Feature.SCORE_CORRECTION_BIAS]
    # Group-limited top-k is config-driven in the reference (n_group read, one group or more).
    assert "true" in all_reference_values(("deepseek_v3",))[Feature.GROUPED_TOPK]


def test_nope_rule_names_the_config_fact_that_reproduces_the_layers() -> None:
    from transformers import PretrainedConfig

    from skill.analysis.detect import nope_rule

    flags = PretrainedConfig(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0])
    assert nope_rule(flags, [1, 3]) == ("no_rope_layers", None)
    # A list whose zeros are not exactly the measured layers explains nothing.
    assert nope_rule(flags, [3]) == (None, None)
    types = PretrainedConfig(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, no_rope_layers=[1, 1, 1, 1]
    )
    assert nope_rule(types, [1, 3]) == (None, "full_attention")
    assert nope_rule(types, [0, 1]) == (None, None)
    assert nope_rule(types, []) == (None, None)


def test_nope_layers_without_a_config_rule_stay_unsupported() -> None:
    from skill.features import AttentionFeatures

    measured_only = AttentionFeatures(nope_layers=[3])
    checklist = report_for("llama").checklist.model_copy(update={"attention": measured_only})
    value = feature_values(checklist)[Feature.NOPE_LAYERS]
    assert value == "true"
    assert value not in SUPPORTED_EDITS[Feature.NOPE_LAYERS]


# ------------------------------------------------------------------- LM head bias


@pytest.mark.parametrize("model_type,bias", [("phi", True), ("gptj", True), ("codegen", True), ("llama", False)])
def test_lm_head_bias_is_measured(model_type: str, bias: bool) -> None:
    # PhiForCausalLM: nn.Linear(hidden_size, vocab_size, bias=True); GPTJForCausalLM and
    # CodeGenForCausalLM: nn.Linear(n_embd, vocab_size) with its default bias; save_pretrained
    # writes lm_head.bias. LlamaForCausalLM: bias=False.
    report = report_for(model_type)
    assert report.checklist.scalars.lm_head_bias is bias
    assert feature_values(report.checklist)[Feature.LM_HEAD_BIAS] == ("true" if bias else "false")
    assert not any("LM head" in line for line in report.unsupported)
    assert "true" in SUPPORTED_EDITS[Feature.LM_HEAD_BIAS]


# ----------------------------------------------------------- embedding projection


def test_opt_embedding_projection_is_measured() -> None:
    # OPTDecoder: project_in = nn.Linear(word_embed_proj_dim, hidden_size, bias=False) on the
    # token embeddings before the positions are added, project_out after final_layer_norm,
    # when the widths differ (the tiny config: 32 beside hidden 64; opt-350m: 512 beside 1024).
    report = report_for("opt")
    scalars = report.checklist.scalars
    assert scalars.embedding_projection_field == "word_embed_proj_dim"
    assert scalars.embedding_projection_in == "model.decoder.project_in"
    assert scalars.embedding_projection_out == "model.decoder.project_out"
    assert feature_values(report.checklist)[Feature.EMBEDDING_PROJECTION] == "in_out"
    assert report.unsupported == []
    assert report.checkpoint.module_map["model.decoder.project_in"] == "project_in"
    assert report.checkpoint.module_map["model.decoder.project_out"] == "project_out"


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_no_embedding_projection_where_the_widths_agree(model_type: str) -> None:
    scalars = report_for(model_type).checklist.scalars
    assert scalars.embedding_projection_field is None
    assert feature_values(report_for(model_type).checklist)[Feature.EMBEDDING_PROJECTION] == "none"


# ------------------------------------------------- ALiBi and fixed sinusoidal positions


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_slopes_by_probe(model_type: str) -> None:
    # BloomModel: build_alibi_tensor (slopes from _get_alibi_slopes); MptModel:
    # build_mpt_alibi_tensor (alibi_bias_max=8): both the standard 2**(-8 i / n) sequence.
    from skill.snippets.attention import alibi_slopes

    report = report_for(model_type)
    positions = report.checklist.positions
    assert positions.kind == "alibi"
    n_heads = len(positions.alibi_slopes)
    assert n_heads > 1
    assert positions.alibi_slopes == pytest.approx(alibi_slopes(n_heads).tolist(), rel=1e-5)
    assert feature_values(report.checklist)[Feature.POSITION_KIND] == "alibi"
    assert not [line for line in report.unsupported if "position" in line or "ALiBi" in line]


def test_bloom_ffn_width_and_the_norm_before_its_mlp() -> None:
    # BloomMLP: dense_h_to_4h = Linear(hidden, 4 * hidden), no config field; BloomBlock feeds
    # post_attention_layernorm(attention output incl. the residual) to the MLP: a pre-FFN norm.
    checklist = report_for("bloom").checklist
    assert checklist.ffn.intermediate_size_field is None and checklist.ffn.intermediate_multiple == 4
    assert checklist.ffn.intermediate_size == 4 * AutoConfig.for_model("bloom").hidden_size
    assert checklist.norm.block_norms == {
        "input_layernorm": "pre_attention",
        "post_attention_layernorm": "pre_ffn",
    }


def test_mpt_ffn_width_is_its_expansion_ratio() -> None:
    # MptMLP: up_proj = Linear(hidden, config.expansion_ratio * hidden).
    ffn = report_for("mpt").checklist.ffn
    assert ffn.intermediate_ratio_field == "expansion_ratio"
    assert ffn.intermediate_size == 4 * AutoConfig.for_model("mpt").hidden_size


def test_xglm_sinusoidal_table_offset_zero_row_and_embedding_scale() -> None:
    # XGLMSinusoidalPositionalEmbedding: offset 2, row padding_idx (pad_token_id) zeroed;
    # XGLMScaledWordEmbedding: embed_scale = sqrt(d_model), applied before the positions add.
    report = report_for("xglm")
    positions, scalars = report.checklist.positions, report.checklist.scalars
    assert positions.kind == "sinusoidal"
    assert positions.table_offset == 2
    assert positions.table_zero_row_field == "pad_token_id"
    assert scalars.embedding_scale_kind == "sqrt_dim"
    assert not [line for line in report.unsupported if "embeddings transformed" in line]
    assert Feature.POSITION_KIND in SUPPORTED_EDITS and not report.unsupported


def test_mpt_nested_attention_fields_are_pinned_unset() -> None:
    # MptAttention reads config.attn_config.clip_qkv (clamps the fused qkv) and softmax_scale
    # (None: head_dim**-0.5); both default to None. No edit reads a nested field: the analysis
    # pins them unset and the port refuses a config that sets them.
    from transformers import MptConfig

    from archon_models.mpt.model.args import MptModelArgs

    report = report_for("mpt")
    assert report.checklist.pinned_nested_fields == ["attn_config.clip_qkv", "attn_config.softmax_scale"]
    assert not report.unsupported
    MptModelArgs.from_hf_config(MptConfig())
    for field, value in (("clip_qkv", 6.0), ("softmax_scale", 0.1)):
        with pytest.raises(ValueError, match=f"attn_config.{field}="):
            MptModelArgs.from_hf_config(MptConfig(attn_config={field: value}))


# ------------------------------------------------------ RoPE rotation, probed (issue 20)


@pytest.mark.parametrize(
    ("module", "function", "expected"),
    [
        # transformers' rotate_half: (x1, x2) -> (-x2, x1), halves paired.
        ("llama", "apply_rotary_pos_emb", ("half", False)),
        # NanoChat's rotate_half: "Rotates half the hidden dims of the input with flipped signs".
        ("nanochat", "apply_rotary_pos_emb", ("half", True)),
        # GLM repeats cos/sin per pair and rotates (x[2i], x[2i+1]).
        ("glm", "apply_rotary_pos_emb", ("interleaved", False)),
        # DeepSeek-V3 permutes the features to halves first: the pairs are still adjacent ones.
        ("deepseek_v3", "apply_rotary_pos_emb_interleave", ("interleaved", False)),
        # GPT-J's takes (tensor, sin, cos): another signature, not measured.
        ("gptj", "apply_rotary_pos_emb", None),
    ],
)
def test_the_rotation_of_a_rotary_function_is_probed(module: str, function: str, expected) -> None:
    import importlib

    from skill.analysis.probes import probe_rotation

    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    assert probe_rotation(getattr(modeling, function)) == expected


def test_nanochat_rotates_the_other_way_and_the_port_negates_the_sine() -> None:
    report = report_for("nanochat")
    positions = report.checklist.positions
    assert (positions.rotary_direction.value, positions.rotary_style.value) == ("reversed", "half")
    assert feature_values(report.checklist)[Feature.ROTARY_DIRECTION] == "reversed"
    delta = next(d for d in report.deltas if d.feature is Feature.ROTARY_DIRECTION)
    assert (delta.reference, delta.target, delta.supported) == ("standard", "reversed", True)
    assert "reversed" in SUPPORTED_EDITS[Feature.ROTARY_DIRECTION]
    assert not [line for line in report.unsupported if "rotat" in line.lower()]
    assert plan_for("nanochat").rotary_reversed
    assert report_for("llama").checklist.positions.rotary_direction.value == "standard"


# ------------------------------------------- QK norms measured on their own (issue 22)


def _qk_norm_refusals(unsupported: list[str]) -> list[str]:
    return [line for line in unsupported if "QK norm" in line]


def test_nanochat_weightless_qk_norm_after_rope_and_its_weightless_embedding_norm() -> None:
    # NanoChatAttention: q_norm/k_norm are NanoChatRMSNorm (no weight) applied after
    # apply_rotary_pos_emb; NanoChatModel.forward runs self.norm (the same weightless norm
    # as the final one) on the embeddings before layer 0.
    report = report_for("nanochat")
    att, scalars = report.checklist.attention, report.checklist.scalars
    assert (att.qk_norm_computation, att.qk_norm_placement.value) == (NormKind.RMS_WEIGHTLESS, "after_rope")
    assert att.per_head_qk_norm and report.checklist.norm.kind is NormKind.RMS_WEIGHTLESS
    assert (scalars.embedding_norm, scalars.embedding_norm_module) == (NormKind.RMS_WEIGHTLESS, "model.norm")
    assert report.unsupported == []
    plan = plan_for("nanochat")
    assert (plan.qk_norm, plan.qk_norm_variant, plan.qk_norm_after_rope) == ("per_head", None, True)
    assert plan.first_stage_modules == ("embedding_norm",)


def test_llama4_text_qk_norm_is_measured_apart_from_the_block_norms() -> None:
    # Llama4TextAttention: `self.qk_norm = Llama4TextL2Norm(config.rms_norm_eps)` (no weight),
    # applied to q and k after RoPE; the block norms are Llama4TextRMSNorm (with a weight).
    report = report_for("llama4_text")
    att = report.checklist.attention
    assert (att.qk_norm_computation, att.qk_norm_placement.value) == (NormKind.RMS_WEIGHTLESS, "after_rope")
    assert report.checklist.norm.kind is NormKind.RMS
    assert _qk_norm_refusals(report.unsupported) == []
    plan = plan_for("llama4_text")
    assert (plan.norm, plan.qk_norm, plan.qk_norm_variant, plan.qk_norm_after_rope) == (
        "rms",
        "per_head",
        "rms_weightless",
        True,
    )


@pytest.mark.parametrize(
    ("seed", "computation", "block", "after_rope"),
    [(15, NormKind.LAYER_NORM, NormKind.RMS, False), (56, NormKind.LAYER_NORM, NormKind.LAYER_NORM, True)],
)
def test_fuzzed_qk_norm_kind_and_placement_are_measured(tmp_path, seed, computation, block, after_rope) -> None:
    # The fuzzer's generator (tests/fuzz/attention.py): seed 15 builds a per-head
    # nn.LayerNorm QK norm (with bias) beside RMSNorm block norms, seed 56 a per-head
    # nn.LayerNorm QK norm applied after RoPE; both were refused before the QK norm had a
    # kind of its own.
    from skill.analysis.analyze import analyze_hf_model
    from skill.analysis.report import AnalyzeInput
    from tests.fuzz import sample_family, write_family

    spec = sample_family(seed)
    qk = spec.attention.qk_norm
    assert qk is not None and (qk.width, qk.kind, qk.after_rope) == ("per_head", "layer_norm", after_rope)
    folder = write_family(spec, tmp_path / spec.name)
    report = analyze_hf_model(AnalyzeInput(source=str(folder), trust_remote_code=True))
    att = report.checklist.attention
    assert att.qk_norm_computation is computation and report.checklist.norm.kind is block
    assert att.qk_norm_placement.value == ("after_rope" if after_rope else "before_rope")
    assert _qk_norm_refusals(report.unsupported) == []
    if spec.attention.clip_qkv is not None:
        # Seed 15's config sets clip_qkv=4.0, which binds nothing on a tiny model (nor would
        # 1.37 times it): the probe moves a clamp to one the tiny projections reach. The
        # generator clamps q/k/v as they leave their projections, before the QK norm.
        assert (att.clip_qkv, att.clip_qkv_field, att.clip_qkv_after_qk_norm) == (4.0, "clip_qkv", False)
