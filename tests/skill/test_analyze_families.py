"""analyze_hf_model against facts read in the HF modeling/config source, per family.

Each entry names a family of the installed transformers and facts about its default
config that its ``modeling_*.py`` / ``configuration_*.py`` state (the comment says
where). Together they span every checklist section: attention variants, FFN, MoE,
positions, norms and scalars.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from transformers.utils import logging as hf_logging

from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model

hf_logging.set_verbosity_error()


@functools.cache
def report_for(model_type: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=model_type))


def lookup(report: ArchitectureReport, path: str) -> Any:
    """``"attention.qk_norm"`` -> the JSON value at that path of the checklist (or report)."""
    data: Any = report.model_dump(mode="json")
    data = data["checklist"] | {k: v for k, v in data.items() if k != "checklist"}
    for part in path.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


FACTS: dict[str, dict[str, Any]] = {
    # Qwen2Attention: q/k/v_proj bias=True, o_proj bias=False; SwiGLU; RMSNorm pre-norm.
    "qwen2": {
        "attention.q_bias": True,
        "attention.o_bias": False,
        "attention.qk_norm": "none",
        "ffn.kind": "gated",
        "ffn.activation": "silu",
        "norm.kind": "rms",
        "norm.placement": "pre",
        "moe": None,
        "reference": "qwen2",
        "unsupported": [],
    },
    # Qwen3Attention: q_norm/k_norm = Qwen3RMSNorm(head_dim) applied before apply_rotary_pos_emb.
    # Dense: copied from qwen2, which gets the per-head QK norm by an edit.
    "qwen3": {
        "attention.qk_norm": "per_head_rms",
        "attention.qk_norm_placement": "before_rope",
        "attention.q_bias": False,
        "reference": "qwen2",
        "unsupported": [],
    },
    # Qwen3MoeSparseMoeBlock: softmax router; saved as experts.{e}.gate_proj (2D).
    "qwen3_moe": {
        "moe.router_scoring": "softmax",
        "moe.num_experts": 128,
        "moe.top_k": 8,
        "moe.expert_layout": "per_expert_2d",
        "moe.expert_orientation": "out_in",
        "moe.shared_experts": 0,
        "reference": "qwen3",
        "unsupported": [],
    },
    # MistralConfig sliding_window=4096, applied by the mask on every layer; 8 KV heads.
    "mistral": {
        "attention.sliding_window.kind": "all_layers",
        "attention.sliding_window.size": 4096,
        "attention.gqa": True,
    },
    # MixtralSparseMoeBlock: softmax, top-2 of 8, renormalised; block_sparse_moe.experts.{e}.w1.
    "mixtral": {
        "moe.num_experts": 8,
        "moe.top_k": 2,
        "moe.norm_topk_prob": True,
        "moe.expert_key_template": "model.layers.{}.block_sparse_moe.experts.{}.w1.weight",
    },
    # Gemma2: (1 + w) RMSNorm, four norms per layer, softcaps 50/30, sqrt(hidden) embedding
    # scale, gelu_pytorch_tanh, alternating sliding/full layer_types.
    "gemma2": {
        "norm.kind": "rms_one_plus_w",
        "norm.placement": "sandwich",
        "attention.logit_softcap": 50.0,
        "scalars.final_logit_softcap": 30.0,
        "scalars.embedding_scale_kind": "sqrt_dim",
        "scalars.embedding_scale": 2304**0.5,
        "attention.sliding_window.kind": "per_layer_pattern",
        "ffn.activation": "gelu_pytorch_tanh",
        "scalars.tie_word_embeddings": True,
    },
    # Gemma3: q_norm/k_norm Gemma3RMSNorm(head_dim) with (1 + w); rope_parameters per layer type.
    "gemma3_text": {
        "attention.qk_norm": "rms_one_plus_w",
        "positions.per_layer_type_rope": True,
        "attention.explicit_head_dim": True,
        "positions.rope_layer_types": ["full_attention", "sliding_attention"],
        # The full-attention layers' base stands for the family (1e6; sliding ones 1e4).
        "positions.theta": 1_000_000.0,
        "attention.qk_norm_placement": "before_rope",
        "unsupported": [],
    },
    # Olmo2: q_norm over num_heads * head_dim; norms on the sublayer outputs (no input norm).
    "olmo2": {"attention.qk_norm": "full_width_rms", "norm.placement": "post_sublayer"},
    # GPT-2: wpe table, Conv1D c_attn (fused), plain MLP gelu_new with biases, LayerNorm.
    "gpt2": {
        "positions.kind": "learned",
        "attention.fused_qkv": True,
        "attention.o_bias": True,
        "ffn.kind": "plain",
        "ffn.bias": True,
        # gelu_new is the tanh approximation: the activation table's gelu_pytorch_tanh.
        "ffn.activation": "gelu_pytorch_tanh",
        "ffn.activation_field": "activation_function",
        "norm.kind": "layer_norm",
        "scalars.tie_word_embeddings": True,
    },
    # Falcon (default parallel_attn=True): one input_layernorm feeding attention and MLP.
    "falcon": {"norm.placement": "parallel", "attention.fused_qkv": True, "ffn.kind": "plain"},
    # Phi: partial_rotary_factor 0.5, parallel attention+MLP, fc1/fc2 gelu_new, dense bias.
    "phi": {
        "positions.partial_rotary_factor": 0.5,
        "norm.placement": "parallel",
        "ffn.kind": "plain",
        "attention.q_bias": True,
    },
    # GPT-NeoX: rotary_pct 0.25, use_parallel_residual=True, query_key_value fused.
    "gpt_neox": {"positions.partial_rotary_factor": 0.25, "norm.placement": "parallel", "attention.fused_qkv": True},
    # BLOOM: ALiBi, word_embeddings_layernorm before layer 0.
    "bloom": {"positions.kind": "alibi", "norm.kind": "layer_norm", "norm.placement": "pre"},
    # DeepSeek-V3: MLA, sigmoid + e_score_correction_bias, n_group 8 / topk_group 4, routed
    # scaling 2.5, one shared expert, first_k_dense_replace=3, rope_interleave=True.
    "deepseek_v3": {
        "attention.mla.kv_lora_rank": 512,
        "attention.mla.q_lora_rank": 1536,
        "moe.router_scoring": "sigmoid",
        "moe.score_correction_bias": True,
        "moe.n_group": 8,
        "moe.topk_group": 4,
        "moe.routed_scaling_factor": 2.5,
        "moe.shared_experts": 1,
        "moe.moe_layers.0": 3,
        "moe.n_layers": 61,
        "positions.rotary_style": "interleaved",
        "attention.custom_scaling": False,
        "attention.output_gate": False,
        "reference": "deepseek_v3",
        "deltas": [],
        "unsupported": [],
    },
    # gpt-oss: per-head sinks, biases, yarn, fused 3D experts stored (E, hidden, 2*inter).
    "gpt_oss": {
        "attention.sinks": True,
        "attention.o_bias": True,
        "positions.rope_type": "yarn",
        "moe.expert_layout": "fused_3d",
        "moe.expert_orientation": "in_out",
        "moe.norm_topk_prob": True,
        "attention.sliding_window.kind": "per_layer_pattern",
        # The sinks (as many as the tiny model's experts) are not a router selection bias.
        "moe.score_correction_bias": False,
        "moe.expert_bias": True,
        "moe.router_bias": True,
        "ffn.activation": "clamped_swiglu",
        "unsupported": [],
    },
    # Qwen2-MoE: one shared expert scaled by sigmoid(shared_expert_gate); q/k/v bias.
    "qwen2_moe": {
        "moe.shared_experts": 1,
        "moe.shared_expert_gate": True,
        "attention.q_bias": True,
        "moe.norm_topk_prob": False,
    },
    # Llama4 text: L2 qk norm without weight after RoPE, no RoPE every 4th layer, sigmoid
    # router, one shared expert, complex (interleaved) rotation, chunked attention.
    "llama4_text": {
        "attention.qk_norm": "weightless",
        "attention.qk_norm_placement": "after_rope",
        "attention.nope_layers.0": 3,
        "moe.router_scoring": "sigmoid",
        "moe.shared_experts": 1,
        "positions.rotary_style": "interleaved",
    },
    # SmolLM3: no_rope_layer_interval=4 -> layers 3, 7, ... skip RoPE.
    # SmolLM3Attention: use_rope = config.no_rope_layers[layer_idx] (1 rotates, 0 does not).
    "smollm3": {
        "attention.nope_layers.0": 3,
        "attention.nope_layers.1": 7,
        "attention.nope_layers_field": "no_rope_layers",
        "attention.nope_layer_type": None,
        "unsupported": [],
    },
    # GLM: fused gate_up_proj, partial_rotary_factor 0.5, rotate_half on even/odd pairs.
    "glm": {
        "ffn.fused_gate_up": True,
        "positions.partial_rotary_factor": 0.5,
        "positions.rotary_style": "interleaved",
        "attention.q_bias": True,
    },
    # Cohere: LayerNorm without bias, parallel block, logit_scale 0.0625, repeat_interleave RoPE.
    "cohere": {
        "norm.kind": "layer_norm_no_bias",
        "norm.placement": "parallel",
        "scalars.logit_multiplier": 0.0625,
        "positions.rotary_style": "interleaved",
    },
    # Starcoder2: c_fc/c_proj plain MLP with bias, gelu_pytorch_tanh, LayerNorm, biases.
    "starcoder2": {
        "ffn.kind": "plain",
        "ffn.bias": True,
        "ffn.activation": "gelu_pytorch_tanh",
        "norm.kind": "layer_norm",
        "attention.o_bias": True,
    },
    # HunYuan dense: query_layernorm/key_layernorm applied after apply_rotary_pos_emb.
    "hunyuan_v1_dense": {
        "attention.qk_norm": "per_head_rms",
        "attention.qk_norm_placement": "after_rope",
        "unsupported": [],
    },
    # Nemotron: LayerNorm1P ((1 + w), centred), relu2 plain MLP, partial_rotary_factor 0.5.
    "nemotron": {
        "norm.kind": "layer_norm_one_plus_w",
        "ffn.activation": "relu2",
        "ffn.kind": "plain",
        "positions.partial_rotary_factor": 0.5,
    },
    # Persimmon: q_layernorm/k_layernorm (LayerNorm per head), fused query_key_value.
    "persimmon": {"attention.qk_norm": "layer_norm", "attention.fused_qkv": True},
    # GPTBigCode: multi_query=True -> one KV head; learned positions.
    "gpt_bigcode": {"attention.gqa": True, "positions.kind": "learned"},
    # EXAONE 4: post-sublayer norms, 3:1 sliding/full pattern, per-head qk norm.
    # Exaone4Attention rotates only `if self.sliding_window is None or self.is_sliding`: the
    # full_attention layers of layer_types have no RoPE.
    "exaone4": {
        "norm.placement": "post_sublayer",
        "attention.sliding_window.kind": "per_layer_pattern",
        "attention.qk_norm": "per_head_rms",
        "attention.nope_layer_type": "full_attention",
        "attention.nope_layers_field": None,
        "reference": "qwen2",
        "unsupported": [],
    },
    # MellumConfig: layer_types default all full_attention, but rope_parameters has a
    # sliding_attention entry and sliding_window=1024: a checkpoint's sliding layers use both.
    "mellum": {
        "positions.per_layer_type_rope": True,
        "attention.sliding_window.kind": "per_layer_pattern",
        "attention.sliding_window.size": 1024,
        "unsupported": [],
    },
    # MPT: ALiBi, LayerNorm without bias (no_bias=True), fused Wqkv.
    "mpt": {"positions.kind": "alibi", "norm.kind": "layer_norm_no_bias", "attention.fused_qkv": True},
    # AFMoE: gate_proj (hidden -> heads * head_dim) gates the attention output; sigmoid router
    # with a selection-only expert_bias; num_dense_layers=1; four norms per layer.
    "afmoe": {
        "attention.output_gate": True,
        "attention.output_gate_kind": "sigmoid_per_element",
        "attention.output_gate_key": "self_attn.gate_proj",
        "moe.router_scoring": "sigmoid",
        "moe.score_correction_bias": True,
        "moe.moe_layers.0": 1,
        "norm.placement": "sandwich",
    },
    # Laguna: g_proj gate per head (softplus) on the attention output, sigmoid routing.
    "laguna": {
        "attention.output_gate": True,
        "attention.output_gate_kind": "softplus_per_head",
        "attention.output_gate_key": "self_attn.g_proj",
        "moe.router_scoring": "sigmoid",
    },
    # DiffLlama: differential attention, measured on every layer (skill/analysis/differential.py).
    "diffllama": {
        "reference": "qwen2",
        "attention.differential.lambda_vectors": ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"],
        "attention.differential.lambda_keys": [
            "self_attn.lambda_q1",
            "self_attn.lambda_k1",
            "self_attn.lambda_q2",
            "self_attn.lambda_k2",
        ],
        "attention.differential.norm": "groupnorm",
        "attention.differential.lambda_init": "0.8 - 0.6 * exp(-0.3 * layer)",
    },
}


@pytest.mark.parametrize("model_type", sorted(FACTS))
def test_family_facts(model_type: str) -> None:
    report = report_for(model_type)
    assert report.model_type == model_type
    for path, expected in FACTS[model_type].items():
        actual = lookup(report, path)
        if isinstance(expected, float):
            assert actual == pytest.approx(expected, rel=1e-6), path
        else:
            assert actual == expected, f"{model_type}: {path} = {actual!r}, HF source says {expected!r}"


def test_every_section_kind_is_covered_by_the_facts() -> None:
    covered = {path.split(".")[0] for facts in FACTS.values() for path in facts}
    assert {"attention", "ffn", "moe", "positions", "norm", "scalars"} <= covered
    assert len(FACTS) >= 25


def test_out_of_vocabulary_parts_are_named_unsupported() -> None:
    report = report_for("doge")
    assert any("A (DogeAttention)" in item for item in report.checklist.other)
    assert any(line.startswith("unsupported: ") and "A (DogeAttention)" in line for line in report.unsupported)


def test_deltas_follow_feature_order_and_flag_support() -> None:
    report = report_for("gemma2")
    order = [delta.feature for delta in report.deltas]
    from skill.features import Feature

    assert order == [f for f in Feature if f in set(order)]
    by_feature = {d.feature: d for d in report.deltas}
    assert by_feature[Feature.NORM_PLACEMENT].target == "sandwich"
    # The engine's eager_attention edit ports gemma2's soft-capping.
    assert by_feature[Feature.ATTN_SOFTCAP].supported
    assert report.unsupported == []

    cohere = report_for("cohere")
    deltas = {d.feature: d for d in cohere.deltas}
    # The parallel block and the LayerNorm without bias are both edits now.
    assert deltas[Feature.NORM_PLACEMENT].supported and deltas[Feature.NORM_PLACEMENT].target == "parallel"
    assert deltas[Feature.NORM_KIND].supported and deltas[Feature.NORM_KIND].target == "layer_norm_no_bias"
    assert cohere.unsupported == []


def test_report_lists_keys_fields_and_variants() -> None:
    report = report_for("qwen3_moe")
    assert report.variant_types == ["qwen3", "qwen3_moe"]
    keys = {k.key for k in report.checkpoint.layer0}
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys  # on-disk 2D, not in-memory 3D
    assert report.checkpoint.layer_prefix == "model.layers.0."
    assert {k.key for k in report.checkpoint.top_level} >= {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    fields = {f.name: f for f in report.config_fields}
    assert fields["hidden_size"].archon_field == "dim"
    assert fields["rms_norm_eps"].archon_field == "norm_eps"
    assert fields["num_local_experts"].archon_field == "moe_args.num_experts"  # stored name of num_experts
    assert fields["router_aux_loss_coef"].archon_field == "unmapped"
    assert [f.name for f in report.config_fields] == sorted(fields)


def test_report_json_is_stable() -> None:
    report = report_for("mistral")
    first = report.model_dump_json(exclude={"seconds"})
    second = analyze_hf_model(AnalyzeInput(source="mistral")).model_dump_json(exclude={"seconds"})
    assert first == second
    assert "mask probe" in " ".join(report.evidence)
