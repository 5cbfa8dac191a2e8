"""Edits on the Archon module contract compose: on either reference, in any order."""

from __future__ import annotations

from pathlib import Path

import pytest

from skill.codemod.contract import residual_branch_code, wrap_residual_branch
from skill.codemod.cst import Document
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import plan_for

REPO = Path(__file__).resolve().parents[2]
REFERENCES = {name: (REPO / f"archon_models/{name}/model/model.py").read_text() for name in ("qwen2", "qwen3")}

WRAPS = {
    "post_norm": ("self.post_attention_norm({})", "post_attention_norm"),
    "multiplier": ("{} * self.residual_multiplier", "residual_multiplier"),
}


@pytest.mark.parametrize("reference", sorted(REFERENCES))
def test_residual_branch_wraps_compose_on_both_references(reference):
    text = Document(REFERENCES[reference])
    (branch,) = residual_branch_code(text, "attention")
    wrapped = wrap_residual_branch(text, "attention", *WRAPS["post_norm"][:1], applied_if=WRAPS["post_norm"][1])
    wrapped = wrap_residual_branch(wrapped, "attention", WRAPS["multiplier"][0], applied_if=WRAPS["multiplier"][1])
    assert residual_branch_code(wrapped, "attention") == [
        f"self.post_attention_norm({branch}) * self.residual_multiplier"
    ]
    # Idempotent: applying both again changes nothing.
    again = wrap_residual_branch(wrapped, "attention", WRAPS["post_norm"][0], applied_if=WRAPS["post_norm"][1])
    again = wrap_residual_branch(again, "attention", WRAPS["multiplier"][0], applied_if=WRAPS["multiplier"][1])
    assert again.code == wrapped.code
    # The feed-forward branch is untouched by attention-branch edits.
    assert residual_branch_code(wrapped, "ffn") == residual_branch_code(text, "ffn")


def _ctx(plan, model_class: str) -> EditContext:
    return EditContext(camel="Toy", model_class=model_class, profile=plan)


@pytest.mark.parametrize("reference,model_class", [("qwen2", "Qwen2Model"), ("qwen3", "Qwen3Model")])
def test_sandwich_norms_residual_multiplier_and_logit_transforms_compose(reference, model_class):
    """Every order of the four edits that touch the same two places gives one result
    (an edit list applied as named once put the multiplier inside the post-norm)."""
    plan = plan_for("llama").model_copy(
        update={
            "block": "sandwich",
            "residual_multiplier_field": "residual_multiplier",
            "logit_divisor_field": "logits_scaling",
            "final_softcap": True,
        }
    )
    names = ["sandwich_norm", "residual_multiplier", "logits_scaling", "final_softcap"]
    # The canonical order, its reverse, and orders that put each outer edit first.
    orders = [
        tuple(names),
        tuple(reversed(names)),
        ("residual_multiplier", "sandwich_norm", "final_softcap", "logits_scaling"),
        ("final_softcap", "residual_multiplier", "logits_scaling", "sandwich_norm"),
    ]
    results = {
        order: apply_model_edits(REFERENCES[reference], _ctx(plan, model_class), list(order)) for order in orders
    }
    canonical = results[tuple(names)]
    (attention,) = residual_branch_code(Document(canonical), "attention")
    assert attention.startswith("self.post_attention_norm(self.attention(") and attention.endswith(
        "* self.residual_multiplier"
    )
    (ffn,) = residual_branch_code(Document(canonical), "ffn")
    assert ffn.startswith("self.post_ffn_norm(") and ffn.endswith("* self.residual_multiplier")
    assert "logits = logits / self.model_args.logits_scaling" in canonical
    assert "logits = torch.tanh(logits / cap) * cap" in canonical
    # Named in any order, the edits nest the same way (norm inside the multiplier,
    # divisor before the soft-cap): one module.
    for order, text in results.items():
        assert text == canonical, order


@pytest.mark.parametrize("reference,model_class", [("qwen2", "Qwen2Model"), ("qwen3", "Qwen3Model")])
def test_attention_sinks_compose_with_windows_and_block_edits(reference, model_class):
    """The sinks edit takes the family's window (per layer here), owns the kernel (no
    EagerAttention left behind), passes this rank's sinks to it, and nests the same way
    whatever order the edits are named in, on either reference."""
    plan = plan_for("llama").model_copy(
        update={
            "attn_sinks": True,
            "sliding_window": True,
            "sliding_layer_types": True,
            "residual_multiplier_field": "residual_multiplier",
            "block": "sandwich",
        }
    )
    names = ["attention_sinks", "sandwich_norm", "residual_multiplier"]
    texts = {
        order: apply_model_edits(REFERENCES[reference], _ctx(plan, model_class), list(order))
        for order in (tuple(names), tuple(reversed(names)))
    }
    text = texts[tuple(names)]
    assert texts[tuple(reversed(names))] == text
    compile(text, "model.py", "exec")
    assert "self.sinks = nn.Parameter(torch.zeros(self.n_heads))" in text
    assert "self.packed_attn = SinkAttention(sliding_window)" in text
    assert "sinks=self.local_sinks(xq.shape[2])" in text
    assert "nn.init.zeros_(self.sinks)" in text
    assert "class EagerAttention" not in text and "class SlidingWindowAttention" not in text
    assert text.count("def per_document(") == 1 and text.count("def flex_packed(") == 1
    assert "def fold_sinks(" in text and "def flash_varlen_keywords(" not in text
    assert 'sliding = model_args.layer_types[layer_id] == "sliding_attention"' in text
    # Applied again, nothing changes.
    assert apply_model_edits(text, _ctx(plan, model_class), names) == text


@pytest.mark.parametrize("reference,model_class", [("qwen2", "Qwen2Model"), ("qwen3", "Qwen3Model")])
def test_lm_head_bias_composes_with_logit_transforms(reference, model_class):
    """The LM head gains a bias (zero at init) whatever order it is named in beside the logit
    transforms that rewrite the head's output; a critic's score head keeps none."""
    plan = plan_for("llama").model_copy(
        update={"lm_head_bias": True, "logit_multiplier_field": "logit_scale", "final_softcap": True}
    )
    names = ["lm_head_bias", "logits_multiplier", "final_softcap"]
    texts = {
        order: apply_model_edits(REFERENCES[reference], _ctx(plan, model_class), list(order))
        for order in (tuple(names), tuple(reversed(names)), ("logits_multiplier", "lm_head_bias", "final_softcap"))
    }
    text = texts[tuple(names)]
    for order, other in texts.items():
        assert other == text, order
    compile(text, "model.py", "exec")
    assert "self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=True)" in text
    assert "self.score = nn.Linear(model_args.dim, model_args.num_labels, bias=False)" in text
    assert text.count("nn.init.zeros_(self.output.bias)") == 1
    assert "logits = logits * self.model_args.logit_scale" in text
    assert "logits = torch.tanh(logits / cap) * cap" in text
    # Applied again, nothing changes; without the feature the head has no bias.
    assert apply_model_edits(text, _ctx(plan, model_class), names) == text
    plain = apply_model_edits(REFERENCES[reference], _ctx(plan, model_class), names[1:])
    assert "vocab_size, bias=False)" in plain and "self.output.bias" not in plain


def test_lm_head_bias_runs_and_starts_at_zero():
    """The edited qwen2 model builds, holds ``output.bias`` (zero after init_weights) and adds
    it to every position's logits."""
    import importlib.util
    import sys

    import torch

    from archon_models.qwen2.model.args import Qwen2ModelArgs

    plan = plan_for("llama").model_copy(update={"lm_head_bias": True})
    text = apply_model_edits(REFERENCES["qwen2"], _ctx(plan, "Qwen2Model"), ["lm_head_bias"])
    spec = importlib.util.spec_from_loader("archon_models.qwen2.model._lm_head_bias_probe", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        exec(compile(text, "model.py", "exec"), module.__dict__)
        args = Qwen2ModelArgs(
            dim=32,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=64,
            head_dim=8,
            hidden_dim=64,
            max_seq_len=16,
            enable_weight_tying=False,
            attn_type="sdpa",
        )
        model = module.Qwen2Model(args)
        model.init_weights()
        assert torch.equal(model.output.bias, torch.zeros(64))
        tokens = torch.arange(6).unsqueeze(0)
        positions = torch.arange(6).unsqueeze(0)
        cu_seqlens = torch.tensor([0, 6], dtype=torch.int32)
        base = model(tokens, positions, cu_seqlens, 6)
        with torch.no_grad():
            model.output.bias.copy_(torch.arange(64, dtype=torch.float32))
        shifted = model(tokens, positions, cu_seqlens, 6)
        torch.testing.assert_close(shifted - base, torch.arange(64, dtype=torch.float32).expand_as(base))
    finally:
        sys.modules.pop(spec.name, None)


def test_kernel_edits_insert_only_the_drivers_their_kernel_uses():
    """A soft-capped family's kernel runs per document on CPU and compiled flex on CUDA: it
    gets those drivers and not the flash kernel's signature reader nor the sink fold; a
    sliding-window kernel also reads the flash kernel's signature."""
    softcap = plan_for("llama").model_copy(update={"attn_softcap": True})
    text = apply_model_edits(REFERENCES["qwen2"], _ctx(softcap, "Qwen2Model"), ["eager_attention"])
    assert "def per_document(" in text and "def flex_packed(" in text and "def flex_functions(" in text
    assert "def flash_varlen_keywords(" not in text and "def fold_sinks(" not in text
    assert "import inspect" not in text
    assert "self.packed_attn = EagerAttention(model_args.attn_logit_softcapping, None)" in text
    window = plan_for("llama").model_copy(update={"sliding_window": True})
    text = apply_model_edits(REFERENCES["qwen2"], _ctx(window, "Qwen2Model"), ["sliding_window"])
    assert "def per_document(" in text and "def flex_packed(" in text and "def flash_varlen_keywords(" in text
    assert "import inspect" in text and "def fold_sinks(" not in text
    assert "self.packed_attn = SlidingWindowAttention(model_args.sliding_window)" in text


ROPE_EDITS = ["per_head_qk_norm", "eager_attention", "qk_norm_after_rope", "nope_layers", "per_layer_rope"]


def _rope_plan(reference: str):
    return plan_for("llama").model_copy(
        update={
            "reference": reference,
            "qk_norm": "per_head",
            "qk_norm_after_rope": True,
            "nope_layer_type": "full_attention",
            "per_layer_rope": True,
            "sliding_window": True,
            "sliding_layer_types": True,
            "partial_rotary": True,
            "rope_type": "linear",
        }
    )


def _forward_of(text: str, cls: str) -> str:
    return text.split(f"class {cls}(", 1)[1].split("\n    def forward(", 1)[1].split("\n    def ", 1)[0]


@pytest.mark.parametrize("reference,model_class", [("qwen2", "Qwen2Model"), ("qwen3", "Qwen3Model")])
def test_rope_side_edits_compose_in_any_order(reference, model_class):
    """Per-head QK norm after RoPE, NoPE layers, one RoPE cache per layer type and the
    per-layer sliding window all touch the attention's rotation or the model's RoPE cache;
    named in any order they give one module, on either reference."""
    plan = _rope_plan(reference)
    names = [n for n in ROPE_EDITS if not (reference == "qwen3" and n == "per_head_qk_norm")]
    orders = [tuple(names), tuple(reversed(names)), (names[2], names[0], names[-1], *names[1:2], *names[3:-1])]
    results = {
        order: apply_model_edits(REFERENCES[reference], _ctx(plan, model_class), list(order)) for order in orders
    }
    canonical = results[tuple(names)]
    for order, text in results.items():
        assert text == canonical, order
    compile(canonical, "<generated>", "exec")
    attention = _forward_of(canonical, "Attention")
    # The rotation is skipped on NoPE layers; the QK norms follow it, on every layer.
    rope = attention.index("if self.use_rope:\n            xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)")
    assert rope < attention.index("xq = maybe_to_local(self.q_norm(xq))")
    assert attention.count("self.q_norm(") == 1 and attention.count("apply_rotary_emb(") == 1
    assert "use_rope=layer_id not in model_args.nope_layers" in canonical
    assert "sliding_window=model_args.sliding_window if sliding else None" in canonical
    # Two caches over the rotary part of each head, each with its own theta and scaling.
    assert "args.rotary_dim, args.max_seq_len, args.sliding_rope_theta, args.sliding_rope_freq_scaling" in canonical
    assert "args.rotary_dim, args.max_seq_len, args.rope_theta, args.rope_freq_scaling" in canonical
    model_forward = _forward_of(canonical, model_class)
    assert "rope_cache = self.sliding_rope_cache if sliding else self.rope_cache" in model_forward
    assert 'self.sliding_rope_cache = self._precompute_rope_cache("sliding_attention")' in canonical
    # Applying the edits again changes nothing.
    assert apply_model_edits(canonical, _ctx(plan, model_class), names) == canonical


def test_per_head_qk_norm_on_qwen2_matches_the_qwen3_reference():
    """The per-head QK norm edit writes on a qwen2 copy what the qwen3 reference holds."""
    plan = plan_for("llama").model_copy(update={"qk_norm": "per_head"})
    text = apply_model_edits(REFERENCES["qwen2"], _ctx(plan, "Qwen2Model"), ["per_head_qk_norm"])
    for line in (
        "self.q_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)",
        "self.k_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)",
        "xq = maybe_to_local(self.q_norm(xq))",
        "xk = maybe_to_local(self.k_norm(xk))",
        "self.q_norm.reset_parameters()",
        "from torch.distributed.tensor import DTensor",
    ):
        assert line in text and line in REFERENCES["qwen3"], line
    attention = _forward_of(text, "Attention")
    assert attention.index("self.q_norm(xq)") < attention.index("apply_rotary_emb(")


DEEPSEEK_V3 = REPO / "archon_models/deepseek_v3"


@pytest.mark.parametrize(
    "reference,model_class,source",
    [("deepseek_v3", "DeepseekV3Model", DEEPSEEK_V3 / "model/model.py"), ("qwen3", "Qwen3Model", None)],
)
def test_dense_layers_compose_with_the_scalar_edits_in_any_order(reference, model_class, source):
    """A dense family on an MoE-capable reference (MLA's deepseek_v3, or qwen3): the MoE
    switch goes and the residual multiplier still wraps the feed-forward branch, named in
    any order; the embedding and logit factors land in their stages."""
    text = source.read_text() if source is not None else REFERENCES[reference]
    plan = plan_for("llama").model_copy(
        update={
            "residual_multiplier_field": "residual_multiplier",
            "embedding_scale": "multiplier",
            "embedding_scale_field": "scale_emb",
            "logit_multiplier_field": "logit_multiplier",
            "reference": reference,
        }
    )
    names = ["residual_multiplier", "dense_layers", "embedding_multiplier", "logits_multiplier"]
    results = {
        order: apply_model_edits(text, _ctx(plan, model_class), list(order))
        for order in (tuple(names), tuple(reversed(names)), ("dense_layers", *names[:1], *names[2:]))
    }
    canonical = results[tuple(names)]
    assert all(result == canonical for result in results.values())
    block = canonical.split("class TransformerBlock", 1)[1].split("\nclass ", 1)[0]
    for gone in ("moe", "MoE", "mlp ="):
        assert gone not in block, gone
    assert "from archon_models.moe import" not in canonical
    assert residual_branch_code(Document(canonical), "ffn") == [
        "self.feed_forward(self.ffn_norm(x)) * self.residual_multiplier"
    ]
    assert "h = h * self.model_args.scale_emb" in canonical
    assert "logits = logits * self.model_args.logit_multiplier" in canonical
    # Applied again, nothing changes.
    assert apply_model_edits(canonical, _ctx(plan, model_class), names) == canonical
    compile(canonical, "<dense>", "exec")


def test_dense_args_and_adapter_keep_no_moe_machinery():
    from skill.porting.dense_mla import dense_adapter, dense_args

    args = dense_args(Document((DEEPSEEK_V3 / "model/args.py").read_text()), "DeepseekV3ModelArgs").code
    adapter = dense_adapter(
        Document((DEEPSEEK_V3 / "model/state_dict_adapter.py").read_text()), "DeepseekV3StateDictAdapter"
    ).code
    for text in (args, adapter):
        for word in ("MoEArgs", "moe_args", "moe_enabled", "num_experts", "MoEWeightConverter", "_stack_experts"):
            assert word not in text, word
        compile(text, "<dense>", "exec")
    assert dense_args(Document(args), "DeepseekV3ModelArgs").code == args
    assert dense_adapter(Document(adapter), "DeepseekV3StateDictAdapter").code == adapter


def test_derived_scalar_expression_matches_its_value():
    from transformers import AutoConfig

    from skill.features import ConfigScalar
    from skill.porting.edit_args import source_expression, source_value

    residual = ConfigScalar(
        field="scale_depth", relation="x", times=ConfigScalar(field="num_hidden_layers", relation="x**-0.5")
    )
    logits = ConfigScalar(field="dim_model_base", relation="x", times=ConfigScalar(field="hidden_size", relation="1/x"))
    assert source_expression(residual) == "hf_config.scale_depth / hf_config.num_hidden_layers**0.5"
    assert source_expression(logits) == "hf_config.dim_model_base / hf_config.hidden_size"
    config = AutoConfig.for_model("minicpm3")
    for source in (residual, logits):
        value = eval(source_expression(source), {"hf_config": config})
        assert value == pytest.approx(source_value(source, config))
    assert source_value(residual, config) == pytest.approx(config.scale_depth / config.num_hidden_layers**0.5)
    assert source_value(logits, config) == pytest.approx(1 / config.logits_scaling)


POSITION_EDIT_ORDERS = {
    "alibi": ["remove_rope", "alibi_attention", "clip_qkv", "parallel_block", "residual_multiplier", "layer_norm"],
    "sinusoidal": ["remove_rope", "embedding_sqrt_dim", "sinusoidal_positions", "embedding_norm", "layer_norm"],
}


def _position_plan(kind: str, reference: str):
    update: dict = {"reference": reference, "positions": kind, "norm": "layernorm"}
    if kind == "alibi":
        update |= {
            "clip_qkv_field": "clip_qkv",
            "block": "parallel",
            "residual_multiplier_field": "residual_multiplier",
        }
    else:
        update |= {
            "embedding_scale": "sqrt_dim",
            "position_offset": 2,
            "position_zero_row_field": "pad_token_id",
            "embedding_norm_module": "model.embed_norm",
        }
    return plan_for("llama").model_copy(update=update)


@pytest.mark.parametrize("kind", sorted(POSITION_EDIT_ORDERS))
@pytest.mark.parametrize("reference,model_class", [("qwen2", "Qwen2Model"), ("qwen3", "Qwen3Model")])
def test_position_edits_compose_in_any_order(kind, reference, model_class):
    """ALiBi (a kernel with per-rank slopes) and a fixed sinusoidal table (a buffer module
    in the embedding stage) compose with the block, norm and embedding edits on either
    reference, named in any order, and applying them again changes nothing."""
    plan = _position_plan(kind, reference)
    names = POSITION_EDIT_ORDERS[kind]
    if reference == "qwen3":
        names = ["remove_qk_norm", *names]
    orders = [tuple(names), tuple(reversed(names)), (*names[2:], *names[:2])]
    results = {
        order: apply_model_edits(REFERENCES[reference], _ctx(plan, model_class), list(order)) for order in orders
    }
    canonical = results[tuple(names)]
    for order, text in results.items():
        assert text == canonical, order
    compile(canonical, "<generated>", "exec")
    assert "apply_rotary_emb(" not in canonical and "rope_cache" not in canonical
    if kind == "alibi":
        assert "self.packed_attn = AlibiAttention()" in canonical
        assert "slopes=self.local_alibi_slopes(xq.shape[2], xq.device)" in canonical
        assert "self.head_offset = 0" in canonical and "def alibi_slopes(" in canonical
        assert canonical.count("def per_document(") == 1 and canonical.count("def flex_packed(") == 1
        assert "clamp_projection(self.wq(x), self.clip_qkv)" in canonical
    else:
        model_forward = _forward_of(canonical, model_class)
        # The table's rows are added after the sqrt(dim) scale and before the embedding norm.
        scale = model_forward.index("h = h * torch.tensor(self.model_args.dim**0.5")
        positions = model_forward.index("h = h + self.pos_embeddings(positions).to(h.dtype)")
        assert scale < positions < model_forward.index("h = self.embedding_norm(h)")
        assert (
            "self.pos_embeddings = SinusoidalPositions(model_args.max_seq_len, model_args.dim, offset=2, "
            "zero_row=model_args.pad_token_id)"
        ) in canonical
        assert "self.pos_embeddings.table = self.pos_embeddings.build()" in canonical
        assert "No buffers" not in canonical
    assert apply_model_edits(canonical, _ctx(plan, model_class), names) == canonical


def test_alibi_slopes_follow_the_tensor_parallel_head_block():
    """Each rank attends with its block of the heads: the slopes it passes the kernel are
    that block's (head_offset, which parallelize sets), then the Ulysses slice of it."""
    import types

    import torch

    from skill.snippets.attention import alibi_slopes, local_alibi_slopes

    slopes = alibi_slopes(12)
    for head_offset, cp_rank, sp, n_local, start in [(0, 0, False, 12, 0), (6, 0, False, 6, 6), (6, 1, True, 3, 9)]:
        attention = types.SimpleNamespace(n_heads=12, head_offset=head_offset, _cp_rank=cp_rank, _sp_enabled=sp)
        got = local_alibi_slopes(attention, n_local, torch.device("cpu"))
        torch.testing.assert_close(got, slopes[start : start + n_local])
