"""Absolute positions and GPT-2-era layouts: what the analyser measures, and the edits and
adapter rules that port them (learned position tables, their row offset, the layer prefix
``transformer.h.{}``, multi-query attention behind a flag, an FFN width left ``None``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from skill.codemod.contract import append_to_embedding_stage
from skill.codemod.cst import Document
from skill.features import Feature, feature_values
from skill.porting.edit_adapter_map import derive_from_hf_map, detect_fused_keys
from skill.porting.hf_source import generalise_key
from skill.porting.model_edits import EditContext, apply_model_edits, select_edits
from skill.porting.plan import plan_for
from skill.porting.write_parallelize import ROPE_ATTENTION_INPUTS, _plan_position_table, _plan_without_rope
from tests.skill.test_analyze_families import report_for

REPO = Path(__file__).resolve().parents[2]
MODELS = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}
PARALLELIZE = {name: (REPO / f"archon_models/{name}/infra/parallelize.py").read_text() for name in ("qwen2", "qwen3")}
MODEL_CLASS = {"qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}

# ----------------------------------------------------------------- measurements


@pytest.mark.parametrize(
    ("model_type", "key", "offset"),
    [
        # GPTBigCodeModel: self.wpe = nn.Embedding(max_position_embeddings, embed_dim); wpe(position_ids).
        ("gpt_bigcode", "transformer.wpe.weight", 0),
        # GPT2Model: the same table and call.
        ("gpt2", "transformer.wpe.weight", 0),
        # OPTLearnedPositionalEmbedding: offset = 2, num_embeddings + offset rows, and
        # forward returns super().forward(position_ids + self.offset).
        ("opt", "model.decoder.embed_positions.weight", 2),
    ],
)
def test_learned_position_table_key_and_offset(model_type: str, key: str, offset: int) -> None:
    report = report_for(model_type)
    positions = report.checklist.positions
    assert positions.kind == "learned"
    assert positions.table_key == key
    assert positions.table_offset == offset
    assert positions.table_rows_field == "max_position_embeddings"
    assert feature_values(report.checklist)[Feature.POSITION_KIND] == "learned"
    assert not any("position encoding" in line for line in report.unsupported)


def test_gpt_bigcode_multi_query_flag_and_unset_ffn_width() -> None:
    # GPTBigCodeAttention: kv_heads = 1 if multi_query else num_heads (config default True);
    # GPTBigCodeBlock: inner_dim = n_inner if n_inner is not None else 4 * hidden_size.
    report = report_for("gpt_bigcode")
    attention, ffn = report.checklist.attention, report.checklist.ffn
    assert attention.n_kv_heads == 1
    assert attention.mqa_flag == "multi_query"
    assert ffn.intermediate_size_field == "n_inner"
    assert ffn.intermediate_multiple == 4
    assert ffn.intermediate_size == 4 * 768
    assert report.unsupported == []


def test_opt_ffn_width_field() -> None:
    # OPTDecoderLayer: fc1 = nn.Linear(embed_dim, config.ffn_dim).
    ffn = report_for("opt").checklist.ffn
    assert (ffn.intermediate_size_field, ffn.intermediate_multiple, ffn.intermediate_size) == ("ffn_dim", None, 3072)


def test_rotary_families_keep_no_table_and_no_flag() -> None:
    report = report_for("llama")
    assert report.checklist.positions.table_key is None
    assert report.checklist.attention.mqa_flag is None
    assert report.checklist.ffn.intermediate_size_field == "intermediate_size"


# ----------------------------------------------------------------------- edits

EMBEDDING_EDITS = ("remove_rope", "learned_positions", "embedding_sqrt_dim")


def _learned_plan(offset: int, **update: object):
    return plan_for("llama").model_copy(
        update={"positions": "learned", "position_offset": offset, "embedding_scale": "sqrt_dim", **update}
    )


@pytest.mark.parametrize("reference", sorted(MODELS))
def test_learned_positions_compose_with_an_embedding_scale_in_any_order(reference: str) -> None:
    """On both references, every order of the three edits gives one module: RoPE gone, the
    scale applied to the token embeddings before the position rows are added."""
    ctx = EditContext(camel="Toy", model_class=MODEL_CLASS[reference], profile=_learned_plan(2))
    results = {
        order: apply_model_edits(MODELS[reference], ctx, list(order))
        for order in itertools.permutations(EMBEDDING_EDITS)
    }
    canonical = results[EMBEDDING_EDITS]
    assert all(text == canonical for text in results.values())
    for gone in ("rope_cache", "apply_rotary_emb", "precompute_rope_cache", "_precompute_rope_cache"):
        assert gone not in canonical
    assert "self.pos_embeddings = nn.Embedding(model_args.max_seq_len + 2, model_args.dim)" in canonical
    scale = canonical.index("h = h * torch.tensor(self.model_args.dim**0.5, dtype=h.dtype)")
    add = canonical.index("h = h + self.pos_embeddings(positions + 2)")
    assert scale < add
    assert "h = layer(h, cu_seqlens, max_seqlen)" in canonical
    assert "nn.init.normal_(self.pos_embeddings.weight)" in canonical
    # Applied again, nothing changes.
    assert apply_model_edits(canonical, ctx, list(EMBEDDING_EDITS)) == canonical
    compile(canonical, "<edited>", "exec")


@pytest.mark.parametrize("reference", sorted(MODELS))
def test_position_table_without_offset_and_rope_selected_only_without_rope(reference: str) -> None:
    plan = _learned_plan(0, embedding_scale="none")
    text = MODELS[reference]
    assert {"remove_rope", "learned_positions"} <= set(select_edits(plan, text))
    edited = apply_model_edits(text, EditContext("Toy", MODEL_CLASS[reference], plan), select_edits(plan, text))
    assert "h = h + self.pos_embeddings(positions)\n" in edited
    assert "nn.Embedding(model_args.max_seq_len, model_args.dim)" in edited
    rotary = plan_for("llama")
    assert not {"remove_rope", "learned_positions"} & set(select_edits(rotary, text))


def test_embedding_stage_appends_after_the_last_statement() -> None:
    text = MODELS["qwen2"]
    once = append_to_embedding_stage(Document(text), "Qwen2Model", "h = self.embedding_norm(h)\n")
    twice = append_to_embedding_stage(once, "Qwen2Model", "h = h + self.pos_embeddings(positions)\n").code
    assert twice.index("h = self.embedding_norm(h)") < twice.index("h = h + self.pos_embeddings(positions)")
    assert append_to_embedding_stage(Document(twice), "Qwen2Model", "h = self.embedding_norm(h)\n").code == twice


@pytest.mark.parametrize("reference", sorted(PARALLELIZE))
def test_tp_plan_without_rope_and_with_a_position_table(reference: str) -> None:
    text = _plan_position_table(_plan_without_rope(Document(PARALLELIZE[reference]))).code
    assert "input_layouts=(Shard(1), None, None)," in text
    assert "None, None, None, None" not in text
    assert 'root_plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))' in text
    assert _plan_position_table(_plan_without_rope(Document(text))).code == text
    compile(text, "<plan>", "exec")


@pytest.mark.parametrize("reference", sorted(PARALLELIZE))
def test_tp_plan_without_rope_when_a_norm_edit_took_the_entry_comment(reference: str) -> None:
    """A norm placement that drops ``attention_norm`` from the plan takes the attention entry's
    comment with it (fuzzer seed 68: opt naming, post-sublayer norms, learned positions, MoE)."""
    comment = "".join(f"            {line}\n" for line in ROPE_ATTENTION_INPUTS.splitlines()[:2])
    source = PARALLELIZE[reference].replace(comment, "")
    assert comment not in source
    text = _plan_without_rope(Document(source)).code
    assert "input_layouts=(Shard(1), None, None)," in text and "None, None, None, None" not in text
    compile(text, "<plan>", "exec")


# --------------------------------------------------------------------- adapter

GPT_BIGCODE_SHAPES = {
    "transformer.wte.weight": (256, 64),
    "transformer.wpe.weight": (1024, 64),
    "transformer.ln_f.weight": (64,),
    "transformer.ln_f.bias": (64,),
    **{
        f"transformer.h.{i}.{name}": shape
        for i in range(2)
        for name, shape in {
            "attn.c_attn.weight": (96, 64),
            "attn.c_attn.bias": (96,),
            "attn.c_proj.weight": (64, 64),
            "attn.c_proj.bias": (64,),
            "ln_1.weight": (64,),
            "ln_1.bias": (64,),
            "ln_2.weight": (64,),
            "ln_2.bias": (64,),
            "mlp.c_fc.weight": (256, 64),
            "mlp.c_fc.bias": (256,),
            "mlp.c_proj.weight": (64, 256),
            "mlp.c_proj.bias": (64,),
        }.items()
    },
}


class _MQAConfig:
    hidden_size = 64
    num_attention_heads = 4
    num_key_value_heads = 1
    intermediate_size = None


def test_layer_index_is_the_first_numeric_segment() -> None:
    assert generalise_key("transformer.h.11.attn.c_attn.weight") == "transformer.h.{}.attn.c_attn.weight"
    assert generalise_key("model.decoder.layers.3.fc1.bias") == "model.decoder.layers.{}.fc1.bias"
    assert generalise_key("model.layers.3.mlp.experts.7.w1.weight") == "model.layers.{}.mlp.experts.{}.w1.weight"


def test_gpt2_era_keys_map_under_the_report_layer_prefix() -> None:
    prefix = "transformer.h.{}."
    fused = detect_fused_keys(GPT_BIGCODE_SHAPES, _MQAConfig(), layer_prefix=prefix)
    # MQA c_attn: 4 query heads + 1 key head + 1 value head of 16 = 96 rows, stacked on dim 0.
    assert fused == {
        f"{prefix}attn.c_attn.{p}": [f"layers.{{}}.attention.{w}.{p}" for w in ("wq", "wk", "wv")]
        for p in ("bias", "weight")
    }
    mapping = derive_from_hf_map(
        list(GPT_BIGCODE_SHAPES),
        fused=fused,
        norm_roles={"ln_1": "pre_attention", "ln_2": "pre_ffn"},
        layer_prefix=prefix,
        position_table_key="transformer.wpe.weight",
    )
    assert mapping["transformer.wpe.weight"] == "pos_embeddings.weight"
    assert mapping["transformer.wte.weight"] == "tok_embeddings.weight"
    assert mapping["transformer.ln_f.bias"] == "norm.bias"
    assert mapping[f"{prefix}attn.c_proj.weight"] == "layers.{}.attention.wo.weight"
    assert mapping[f"{prefix}mlp.c_proj.weight"] == "layers.{}.feed_forward.w2.weight"
    assert mapping[f"{prefix}ln_2.bias"] == "layers.{}.ffn_norm.bias"


# ------------------------------------------------------- Conv1D-stored projections


def test_gpt2_conv1d_projections_are_probed_as_transposed() -> None:
    # GPT2Attention: c_attn = Conv1D(3 * embed_dim, embed_dim), c_proj = Conv1D(embed_dim, embed_dim);
    # GPT2MLP: c_fc = Conv1D(intermediate_size, embed_dim), c_proj = Conv1D(embed_dim, intermediate_size).
    # Conv1D.forward: torch.addmm(bias, x, weight), weight of (nx, nf) = (in, out). c_attn.c_proj is
    # square: only the probe tells its orientation.
    report = report_for("gpt2")
    assert report.checklist.transposed_weights == [
        "transformer.h.{}.attn.c_attn.weight",
        "transformer.h.{}.attn.c_proj.weight",
        "transformer.h.{}.mlp.c_fc.weight",
        "transformer.h.{}.mlp.c_proj.weight",
    ]
    assert feature_values(report.checklist)[Feature.PROJECTION_ORIENTATION] == "in_out"
    assert not any("[in, out]" in line for line in report.unsupported)


@pytest.mark.parametrize("model_type", ["gpt_bigcode", "llama"])
def test_linear_projections_are_not_transposed(model_type: str) -> None:
    # GPTBigCodeAttention / GPTBigCodeMLP use nn.Linear (out, in), as llama does.
    checklist = report_for(model_type).checklist
    assert checklist.transposed_weights == []
    assert feature_values(checklist)[Feature.PROJECTION_ORIENTATION] == "out_in"


def _adapter_with_transposed_keys(keys: list[str]):
    """The committed gpt_bigcode adapter taught ``keys`` as Conv1D-stored, executed."""
    import sys
    import types

    from skill.porting.common import PackageLayout
    from skill.porting.edit_adapter_map import apply_transposed_adapter

    layout = PackageLayout.for_name("gpt_bigcode")
    text = (REPO / "archon_models/gpt_bigcode/model/state_dict_adapter.py").read_text()
    edited = apply_transposed_adapter(Document(text), layout, keys).code
    assert apply_transposed_adapter(Document(edited), layout, keys).code == edited  # idempotent
    name = "_abspos_transposed_adapter"
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        exec(compile(edited, "<adapter>", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module.GptBigcodeStateDictAdapter


def test_transposed_adapter_roundtrip_with_a_fused_conv1d_key() -> None:
    import torch

    from archon_models.gpt_bigcode.model.args import GptBigcodeModelArgs
    from archon_models.gpt_bigcode.model.model import GptBigcodeModel

    keys = ["transformer.h.{}.attn.c_attn.weight", "transformer.h.{}.mlp.c_fc.weight"]
    adapter_class = _adapter_with_transposed_keys(keys)
    args = GptBigcodeModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16, vocab_size=256, hidden_dim=256)
    torch.manual_seed(0)
    model = GptBigcodeModel(args)
    adapter = adapter_class(args)
    archon = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = adapter.to_hf(archon)
    layer = "layers.1."
    # Fused and Conv1D: [wq; wk; wv] stacked on dim 0, stored transposed (in, 3 * out).
    stacked = torch.cat([archon[f"{layer}attention.{w}.weight"] for w in ("wq", "wk", "wv")], dim=0)
    assert torch.equal(hf["transformer.h.1.attn.c_attn.weight"], stacked.t())
    assert hf["transformer.h.1.attn.c_attn.weight"].shape == (64, 96)
    assert torch.equal(hf["transformer.h.1.mlp.c_fc.weight"], archon[f"{layer}feed_forward.w1.weight"].t())
    # Not listed: kept as nn.Linear stores it.
    assert torch.equal(hf["transformer.h.1.mlp.c_proj.weight"], archon[f"{layer}feed_forward.w2.weight"])
    back = adapter.from_hf(hf)
    assert set(back) == set(archon)
    for key, value in archon.items():
        assert torch.equal(back[key], value), key
    # One parameter at a time (AReaL's weight sync) gives the on-disk orientation too.
    ((key, tensor),) = adapter.convert_single_to_hf(
        f"{layer}feed_forward.w1.weight", archon[f"{layer}feed_forward.w1.weight"]
    )
    assert key == "transformer.h.1.mlp.c_fc.weight" and tensor.shape == (64, 256)


# ------------------------------------------- norm epsilon constant, embedding transforms


@pytest.mark.parametrize("model_type", ["opt", "xglm"])
def test_norm_epsilon_fixed_in_the_modeling_code(model_type: str) -> None:
    # OPTDecoderLayer / XGLMDecoderLayer: nn.LayerNorm(embed_dim) with its default eps=1e-5;
    # neither config has an epsilon field.
    report = report_for(model_type)
    norm = report.checklist.norm
    assert norm.eps_field is None
    assert norm.eps == pytest.approx(1e-5)
    assert not any("epsilon" in line for line in report.unsupported)


def test_eps_constant_reaches_the_args_not_from_hf_config() -> None:
    from skill.porting.edit_args import arg_fields, required_fields
    from skill.porting.hf_source import load_config

    plan = plan_for("opt")
    assert plan.norm_eps_fixed == pytest.approx(1e-5)
    config = load_config("opt")
    (eps,) = [f for f in arg_fields(plan, config) if f.name == "norm_eps"]
    assert (eps.default, eps.expression) == (pytest.approx(1e-5), "")
    assert not any("eps" in name for name in required_fields(plan, config))


def test_bloom_embedding_norm_is_measured() -> None:
    # BloomModel.forward: hidden_states = self.word_embeddings_layernorm(inputs_embeds), a
    # LayerNorm, before the first block.
    report = report_for("bloom")
    scalars = report.checklist.scalars
    assert scalars.embedding_norm == "layer_norm"
    assert scalars.embedding_norm_module == "transformer.word_embeddings_layernorm"
    assert feature_values(report.checklist)[Feature.EMBEDDING_NORM] == "layer_norm"
    assert not any("embedding" in line for line in report.unsupported)


def test_embedding_projection_is_no_longer_other() -> None:
    # OPTDecoder: project_in = nn.Linear(word_embed_proj_dim, hidden_size) when they differ
    # (the tiny config shrinks word_embed_proj_dim to 32 beside hidden 64): measured as the
    # embedding projection (tests/skill/test_analyze_measurements.py), named nowhere as other.
    other = report_for("opt").checklist.other
    assert not any("embedding" in line for line in other)


@pytest.mark.parametrize("reference", sorted(MODELS))
def test_embedding_norm_after_positions_in_any_order(reference: str) -> None:
    """The embedding norm is the last step of the embedding stage, whatever order the
    edits are named in; with layer_norm it is an nn.LayerNorm like the block norms."""
    plan = _learned_plan(0, embedding_norm_module="transformer.word_embeddings_layernorm", norm="layernorm")
    names = ["remove_rope", "layer_norm", "learned_positions", "embedding_norm", "embedding_sqrt_dim"]
    ctx = EditContext("Toy", MODEL_CLASS[reference], plan)
    canonical = apply_model_edits(MODELS[reference], ctx, names)
    for order in (list(reversed(names)), names[2:] + names[:2]):
        assert apply_model_edits(MODELS[reference], ctx, order) == canonical
    assert "self.embedding_norm = nn.LayerNorm(model_args.dim, eps=model_args.norm_eps)" in canonical
    stage = canonical[canonical.index("if self.tok_embeddings is not None:\n            # Embeddings") :]
    assert (
        stage.index("dim**0.5") < stage.index("self.pos_embeddings(positions)") < stage.index("self.embedding_norm(h)")
    )
    assert "self.embedding_norm.reset_parameters()" in canonical
    compile(canonical, "<edited>", "exec")


def test_embedding_norm_keys_and_tp_plan() -> None:
    from skill.porting.write_parallelize import _plan_embedding_norm

    mapping = derive_from_hf_map(
        [
            "transformer.word_embeddings.weight",
            "transformer.word_embeddings_layernorm.weight",
            "transformer.word_embeddings_layernorm.bias",
            "transformer.ln_f.weight",
        ],
        layer_prefix="transformer.h.{}.",
        embedding_norm_module="transformer.word_embeddings_layernorm",
    )
    assert mapping["transformer.word_embeddings_layernorm.weight"] == "embedding_norm.weight"
    assert mapping["transformer.word_embeddings_layernorm.bias"] == "embedding_norm.bias"
    assert mapping["transformer.word_embeddings.weight"] == "tok_embeddings.weight"
    plan = _plan_embedding_norm(Document(PARALLELIZE["qwen2"])).code
    assert 'root_plan["embedding_norm"] = SequenceParallel(use_local_output=True)' in plan
    assert _plan_embedding_norm(Document(plan)).code == plan


def test_stage5_skips_tp_only_for_one_kv_head() -> None:
    """AReaL's validate_tp_constraints refuses tp=2 with one KV head: stage 5 says so rather
    than failing; with two KV heads TP runs."""
    import torch

    from archon_models.gpt_bigcode.model.args import GptBigcodeModelArgs
    from archon_models.gpt_bigcode.model.model import GptBigcodeModel
    from skill.harness.distributed import applicable_parallelisms

    small = {"dim": 64, "n_layers": 1, "n_heads": 4, "head_dim": 16, "vocab_size": 256, "hidden_dim": 128}
    with torch.device("meta"):
        mqa = GptBigcodeModel(GptBigcodeModelArgs(n_kv_heads=1, **small))
        gqa = GptBigcodeModel(GptBigcodeModelArgs(n_kv_heads=2, **small))
    assert "n_kv_heads (1) must be divisible by tp_size (2)" in (applicable_parallelisms(mqa)["tp"] or "")
    assert applicable_parallelisms(gqa)["tp"] is None


def test_top_level_modules_come_from_the_module_tree() -> None:
    # BioGptModel: embed_tokens, layer_norm (the final norm) under "biogpt."; the tied
    # output_projection is not saved.
    report = report_for("biogpt")
    assert report.checkpoint.top_modules == {"biogpt.embed_tokens": "tok_embeddings", "biogpt.layer_norm": "norm"}
    mapping = derive_from_hf_map(
        ["biogpt.embed_tokens.weight", "biogpt.layer_norm.weight", "biogpt.layer_norm.bias"],
        layer_prefix="biogpt.layers.{}.",
        top_modules=report.checkpoint.top_modules,
    )
    assert mapping["biogpt.layer_norm.bias"] == "norm.bias"
    assert mapping["biogpt.embed_tokens.weight"] == "tok_embeddings.weight"


def test_an_unused_epsilon_field_is_not_read() -> None:
    # BioGptConfig.layer_norm_eps = 1e-12, but BioGptDecoderLayer builds nn.LayerNorm(embed_dim)
    # at the default 1e-5: the field is unused, the constant is what the port needs.
    norm = report_for("biogpt").checklist.norm
    assert norm.eps_field is None
    assert norm.eps == pytest.approx(1e-5)
    # A field the norms do read stays the source (LlamaRMSNorm(eps=config.rms_norm_eps)).
    assert report_for("llama").checklist.norm.eps_field == "rms_norm_eps"


def test_the_structural_map_wins_over_the_name_table() -> None:
    """A gated MLP with GPT-2's names (c_gate, c_fc, c_proj): the analysis finds c_fc is the
    up projection (w3); the name table's GPT-2 rule (plain c_fc -> w1) must not override it
    (fuzzer seeds 30, 34, 48 failed stage 2: w3 had no HF name)."""
    prefix = "transformer.h.{}."
    keys = [f"{prefix}mlp.{name}.weight" for name in ("c_gate", "c_fc", "c_proj")]
    module_map = {
        f"{prefix}mlp.c_gate": "layers.{}.feed_forward.w1",
        f"{prefix}mlp.c_fc": "layers.{}.feed_forward.w3",
        f"{prefix}mlp.c_proj": "layers.{}.feed_forward.w2",
    }
    mapping = derive_from_hf_map(keys, layer_prefix=prefix, module_map=module_map)
    assert mapping[f"{prefix}mlp.c_gate.weight"] == "layers.{}.feed_forward.w1.weight"
    assert mapping[f"{prefix}mlp.c_fc.weight"] == "layers.{}.feed_forward.w3.weight"
    assert mapping[f"{prefix}mlp.c_proj.weight"] == "layers.{}.feed_forward.w2.weight"


def test_sinks_are_found_under_the_family_s_own_attention_module() -> None:
    """GPT-2- or Falcon-named attention (attn, self_attention) with sinks: the attention
    module is the parent of the projections the analysis found (fuzzer seeds 12, 54, 93, 94
    failed edit_adapter_map: transformer.h.{}.attn.sinks unmapped)."""
    prefix = "transformer.h.{}."
    keys = [f"{prefix}attn.c_proj.weight", f"{prefix}attn.sinks"]
    mapping = derive_from_hf_map(
        keys, layer_prefix=prefix, module_map={f"{prefix}attn.c_proj": "layers.{}.attention.wo"}
    )
    assert mapping[f"{prefix}attn.sinks"] == "layers.{}.attention.sinks"
