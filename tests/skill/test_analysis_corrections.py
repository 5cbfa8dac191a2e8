"""The analysis errors an independent per-feature survey found (issue 19), each on the
family's real HF classes: a checkpoint that fuses or renames what memory keeps apart, a
router's bias saved under the experts, a rotary width the model never reads, a layer rule
under another field name, MLA's own head widths, experts beside a mixture of attention, and
a query scale that depends on the absolute position.

Families that only a newer transformers ships are skipped on older ones, naming the version.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig
from transformers.utils import logging as hf_logging

from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model
from skill.features import Feature, FusedQKVLayout
from skill.harness.models import unknown_model_type

hf_logging.set_verbosity_error()


@functools.cache
def report_for(source: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=source))


def needs(model_type: str):
    unknown = unknown_model_type(model_type)
    return pytest.mark.skipif(unknown is not None, reason=unknown or "")


# ------------------------------------------------------------- saved by another name


# A remote-code family: Llama in memory, SarvamMoE's names on disk (one
# attention.query_key_value, attention.dense, model.word_embeddings), by a checkpoint
# conversion mapping registered for its class as transformers registers its own.
FUSED_ON_DISK_CONFIGURATION = """
from transformers import LlamaConfig


class FusedOnDiskConfig(LlamaConfig):
    model_type = "fused_on_disk"
"""
FUSED_ON_DISK_MODELING = """
from transformers import LlamaForCausalLM
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Split, WeightConverter, WeightRenaming

from .configuration_fused_on_disk import FusedOnDiskConfig


class FusedOnDiskForCausalLM(LlamaForCausalLM):
    config_class = FusedOnDiskConfig


register_checkpoint_conversion_mapping(
    "FusedOnDiskForCausalLM",
    [
        WeightRenaming(r"^model\\.word_embeddings\\.", "model.embed_tokens."),
        WeightRenaming(r"\\.attention\\.", ".self_attn."),
        WeightConverter(
            source_patterns="query_key_value", target_patterns=["q_proj", "k_proj", "v_proj"], operations=[Split(dim=0)]
        ),
        WeightRenaming(r"\\.self_attn\\.dense\\.", ".self_attn.o_proj."),
    ],
    overwrite=True,
)
"""


def _fused_on_disk_folder(folder: Path) -> Path:
    (folder / "configuration_fused_on_disk.py").write_text(FUSED_ON_DISK_CONFIGURATION)
    (folder / "modeling_fused_on_disk.py").write_text(FUSED_ON_DISK_MODELING)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2
    ).to_dict()
    config.update(
        model_type="fused_on_disk",
        architectures=["FusedOnDiskForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_fused_on_disk.FusedOnDiskConfig",
            "AutoModelForCausalLM": "modeling_fused_on_disk.FusedOnDiskForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_checkpoint_that_fuses_separate_projections_is_reported_fused(tmp_path: Path) -> None:
    source = str(_fused_on_disk_folder(tmp_path))
    report = analyze_hf_model(AnalyzeInput(source=source, trust_remote_code=True))
    attention = report.checklist.attention
    assert attention.fused_qkv and attention.fused_qkv_layout is FusedQKVLayout.STACKED
    assert report.checkpoint.fused_modules == {
        "model.layers.{}.attention.query_key_value": [
            "layers.{}.attention.wq",
            "layers.{}.attention.wk",
            "layers.{}.attention.wv",
        ]
    }
    assert report.checkpoint.module_map["model.layers.{}.attention.dense"] == "layers.{}.attention.wo"
    assert report.checkpoint.module_map["model.word_embeddings"] == "tok_embeddings"
    assert any("saved as one tensor" in line for line in report.evidence)


@needs("sarvam_moe")
def test_sarvam_moe_reports_its_fused_query_key_value() -> None:
    # transformers' conversion mapping: SarvamMoE checkpoints hold attention.query_key_value,
    # split into q_proj / k_proj / v_proj (Glm4MoeAttention) on load.
    report = report_for("sarvam_moe")
    assert report.checklist.attention.fused_qkv
    assert report.checklist.attention.fused_qkv_layout is FusedQKVLayout.STACKED
    assert "model.layers.{}.attention.query_key_value" in report.checkpoint.fused_modules
    assert report.checkpoint.module_map["model.layers.{}.attention.query_layernorm"] == "layers.{}.attention.q_norm"


@needs("exaone")
def test_exaone_attention_saved_under_transformer_h_is_mapped() -> None:
    # EXAONE checkpoints name the attention transformer.h.{i}.attn.attention.{q,k,v,out}_proj.
    report = report_for("exaone")
    module_map = report.checkpoint.module_map
    assert module_map["transformer.h.{}.attn.attention.q_proj"] == "layers.{}.attention.wq"
    assert module_map["transformer.h.{}.attn.attention.out_proj"] == "layers.{}.attention.wo"


# ------------------------------------------------------------------ MoE readings


def test_laguna_correction_bias_saved_under_the_experts_is_the_routers() -> None:
    # LagunaTopKRouter.e_score_correction_bias; the conversion mapping saves it as
    # mlp.experts.e_score_correction_bias. LagunaExperts holds no biases.
    moe = report_for("laguna").checklist.moe
    assert moe is not None
    assert moe.expert_bias is False
    assert moe.score_correction_bias and moe.score_correction_key == "mlp.experts.e_score_correction_bias"
    assert moe.selection_bias_placement == "scores"


def test_laguna_router_softcap_is_no_attention_softcap() -> None:
    # LagunaTopKRouter caps its logits by moe_router_logit_softcapping (0.0: off); the
    # attention scores are never capped (read as a 0.0 cap, the port asked for a field
    # LagunaConfig lacks, attn_logit_softcapping).
    report = report_for("laguna")
    assert report.checklist.attention.logit_softcap is None


def test_afmoe_leading_dense_layers_follow_num_dense_layers() -> None:
    # AfmoeDecoderLayer: self.moe_enabled = layer_idx >= config.num_dense_layers.
    report = report_for("afmoe")
    assert report.checklist.moe is not None
    assert report.checklist.moe.moe_layer_rule == "first_k_dense"
    assert report.checklist.moe.moe_layer_fields == ["num_dense_layers"]
    assert not any("MoE layer pattern" in line for line in report.unsupported)


def test_jetmoe_experts_are_read_beside_its_mixture_of_attention() -> None:
    # JetMoeMoE (mlp.input_linear / output_linear, 3D) beside JetMoeMoA's own 3D experts.
    report = report_for("jetmoe")
    moe = report.checklist.moe
    assert moe is not None
    assert moe.expert_layout == "fused_3d"
    assert moe.expert_key_template == "model.layers.{}.mlp.input_linear.weight"
    assert not any("expert layout" in line for line in report.unsupported)
    assert any("JetMoeMoA" in line for line in report.unsupported)  # the attention's experts stay out


# ------------------------------------------------------------------ attention widths


def test_minimax_m3_rotates_the_whole_head_whatever_rotary_dim_says() -> None:
    # MiniMaxM3VLRotaryEmbedding: dim = head_dim * rope_parameters.get("partial_rotary_factor", 1.0);
    # the config's rotary_dim=64 is never read.
    report = report_for("minimax_m3_vl_text")
    assert report.checklist.positions.partial_rotary_factor == 1.0
    assert any("rotary_dim=64: not what the model rotates" in line for line in report.evidence)


def test_gptj_partial_rotary_still_comes_from_rotary_dim() -> None:
    # GPT-J has no rotary table to read: its rotary_dim (64 of 256) is the rotated width.
    assert report_for("gptj").checklist.positions.partial_rotary_factor == 0.25


def test_mla_head_width_is_its_own_fields(tmp_path: Path) -> None:
    # A DeepSeek-V3 config like SarvamMLA's: 64 heads of hidden 4096, so hidden / heads is the
    # RoPE slice (64) and no head_dim says more. A query/key head is qk_nope + qk_rope = 192 wide.
    config = AutoConfig.for_model("deepseek_v3").to_dict()
    config.update(hidden_size=4096, num_attention_heads=64, num_key_value_heads=64)
    config.pop("head_dim", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    report = analyze_hf_model(AnalyzeInput(source=str(tmp_path)))
    assert report.reference == "deepseek_v3"
    assert report.checklist.attention.head_dim == 192 and report.checklist.attention.explicit_head_dim
    assert report.unsupported == []
    assert Feature.EXPLICIT_HEAD_DIM not in {d.feature for d in report.deltas}


@needs("sarvam_mla")
def test_sarvam_mla_ports_from_deepseek_v3() -> None:
    report = report_for("sarvam_mla")
    assert report.checklist.attention.head_dim == 192 and report.checklist.attention.explicit_head_dim
    assert report.unsupported == []


# ------------------------------------------------------------------ absolute positions


def test_ministral3_query_scale_by_position_is_measured() -> None:
    # Ministral3Attention: query_states *= 1 + beta * log(1 + floor(position_ids / original_max)),
    # beta = rope_parameters["llama_4_scaling_beta"].
    report = report_for("ministral3")
    scale = report.checklist.attention.query_position_scale
    assert scale is not None
    assert scale.beta_field == "rope_parameters.llama_4_scaling_beta"
    assert scale.period_field == "rope_parameters.original_max_position_embeddings"
    deltas = {d.feature: d for d in report.deltas}
    assert deltas[Feature.QUERY_POSITION_SCALE].target == "log_floor" and deltas[Feature.QUERY_POSITION_SCALE].supported


def test_relative_rope_families_have_no_query_position_scale() -> None:
    for family in ("mistral", "qwen2"):
        assert report_for(family).checklist.attention.query_position_scale is None


# ------------------------------------------------------------- a config attribute a newer version adds


def test_a_multi_query_switch_fixes_one_kv_head_whatever_count_the_config_also_carries(tmp_path):
    """transformers 5.25's FalconConfig carries num_key_value_heads (1 under multi_query, for
    the KV cache) while its attention reads multi_query: the port keeps one KV head fixed by
    the switch, as on 5.23, so `add falcon` writes the same package on both. Here the pinned
    version's FalconConfig is given that attribute, so the test runs on every version."""
    from transformers import FalconConfig

    from skill.porting.plan import plan_for

    config = FalconConfig()
    config.num_key_value_heads = 1
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 1

    plan = plan_for(str(tmp_path), False)

    assert plan.mqa_flag == "multi_query"
    assert plan.single_kv_head


@needs("minicpm5_moe")
def test_minicpm5_moe_query_projection_also_yields_the_output_gate() -> None:
    # MiniCPM5MoeAttention: q_gate_proj (2 * heads * head_dim rows, each head's query then its
    # gate) beside its own k_proj and v_proj; the default config has half as many KV heads as
    # query heads at the tiny size, so the width alone also read as a fused q/k/v ("other").
    report = report_for("minicpm5_moe")
    attention = report.checklist.attention
    assert not attention.fused_qkv and attention.fused_qkv_layout is FusedQKVLayout.NONE
    assert attention.output_gate and attention.output_gate_kind == "sigmoid_in_query"
    assert attention.output_gate_key == "self_attn.q_gate_proj"
    # transformers saves q_gate_proj as q_proj: the port's wq loads it whole.
    assert report.checkpoint.module_map["model.layers.{}.self_attn.q_proj"] == "layers.{}.attention.wq"
    assert report.unsupported == []


def test_a_prediction_head_between_the_final_norm_and_the_lm_head_is_named() -> None:
    # ModernBertDecoderForCausalLM: decoder(lm_head(final_norm(h))), lm_head a dense layer, an
    # activation and a LayerNorm; read as a plain head, the port would leave them out.
    report = report_for("modernbert-decoder")
    line = "unsupported: a transform between the final norm and the LM head: lm_head (ModernBertDecoderPredictionHead)"
    assert line in report.unsupported
    # A constant factor in between is no transform (MiniCPM3 divides by its width scale), and a
    # norm that also runs on the embeddings is read on its last call (NanoChat).
    for family in ("minicpm3", "nanochat"):
        assert not any("LM head" in line for line in report_for(family).unsupported), family
