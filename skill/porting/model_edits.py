"""Named feature edits that specialise a copied reference ``model.py`` to a family.

Each edit is chosen from the family's port plan (read off the analysis report), is
addressed to the Archon module contract (the attention's projections and kernel, the
block's residual branches, the norm and feed-forward classes, the embedding and the LM
head; see ``skill.codemod.contract``), and is a no-op when already applied. Two edits on
one place compose: the sandwich norms and the residual multiplier both wrap the same
residual branch, the logit divisor and the final soft-cap both transform the logits, on
either reference. The code an edit inserts is a class of ``skill/porting/snippets/``,
never a string. What remains reads like hand-written code for the family: an edit that
removes a feature deletes its code instead of adding a flag.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from skill.codemod.contract import (
    parallel_branches,
    prepend_to_block_forward,
    replace_call,
    replace_in_residual_branch,
    wrap_residual_branch,
)
from skill.codemod.cst import (
    add_parameter,
    insert_after_statement_assigning,
    insert_before_class,
    prune_unused_imports,
    remove_class,
    remove_from_all,
    remove_function,
    replace_class,
    replace_in_function,
    replace_name,
    replace_statement_assigning,
    set_call_kwarg,
    set_docstring,
)
from skill.porting.plan import ACTIVATIONS, PortPlan
from skill.porting.snippets import snippet

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EditContext:
    camel: str
    model_class: str
    profile: PortPlan


@dataclass(frozen=True)
class ModelEdit:
    name: str
    description: str
    applies: Callable[[PortPlan], bool]
    apply: Callable[[str, EditContext], str]
    # Whether the copied reference's source still needs it (default: always).
    needed: Callable[[str], bool] = lambda text: True


# --- attention --------------------------------------------------------------------------


def _projection_bias(text: str, ctx: EditContext) -> str:
    qkv = "True" if ctx.profile.qkv_bias else "False"
    for target in ("self.wq", "self.wk", "self.wv"):
        text = set_call_kwarg(text, "nn.Linear", "bias", qkv, target=target)
    text = set_call_kwarg(text, "nn.Linear", "bias", "True" if ctx.profile.o_bias else "False", target="self.wo")
    return replace_in_function(text, "Attention", "__init__", "bias = model_args.attention_bias", "")


def _sliding_window(text: str, ctx: EditContext) -> str:
    text = insert_before_class(text, "Attention", snippet("attention", "SlidingWindowAttention"))
    text = replace_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.packed_attn",
        "self.packed_attn = SlidingWindowAttention(model_args.sliding_window)\n",
    )
    return text


def _eager_attention(text: str, ctx: EditContext) -> str:
    profile = ctx.profile
    text = insert_before_class(text, "Attention", snippet("attention", "EagerAttention"))
    softcap = "model_args.attn_logit_softcapping" if profile.attn_softcap else "None"
    if profile.sliding_layer_types:
        text = add_parameter(text, "Attention", "__init__", "sliding_window: int | None = None")
        window = "sliding_window"
    elif profile.sliding_window:
        window = "model_args.sliding_window"
    else:
        window = "None"
    text = replace_statement_assigning(
        text, "Attention", "__init__", "self.packed_attn", f"self.packed_attn = EagerAttention({softcap}, {window})\n"
    )
    if profile.sliding_layer_types:
        text = replace_in_function(
            text,
            "TransformerBlock",
            "__init__",
            "self.attention = Attention(model_args)",
            "# Layers marked sliding_attention see a window of their document; the others all of it.\n"
            'sliding = model_args.layer_types[layer_id] == "sliding_attention"\n'
            "self.attention = Attention(model_args, sliding_window=model_args.sliding_window if sliding else None)\n",
        )
    return text


def _attention_scale(text: str, ctx: EditContext) -> str:
    """Scores scaled by the config field that sets them (``x`` or ``x**-0.5``)."""
    scale = ctx.profile.attn_scale
    assert scale is not None
    value = f"model_args.{scale.field}" + ("**-0.5" if scale.relation == "x**-0.5" else "")
    return replace_statement_assigning(text, "Attention", "__init__", "self.scaling", f"self.scaling = {value}\n")


def _add_block_norms(text: str, names: tuple[str, ...]) -> str:
    """Block norms ``names`` built like the block's existing ones, reset with them."""
    for name in names:
        if f"self.{name} =" in text:
            continue
        text = (
            insert_after_statement_assigning(
                text,
                "TransformerBlock",
                "__init__",
                "self.ffn_norm",
                f"self.{name} = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n",
            )
            if "self.ffn_norm =" in text
            else insert_after_statement_assigning(
                text,
                "TransformerBlock",
                "__init__",
                "self.attention",
                f"self.{name} = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n",
            )
        )
        text = _append_to_function(text, "TransformerBlock", "init_weights", f"self.{name}.reset_parameters()")
    return text


def _append_to_function(text: str, class_name: str, func: str, statement: str) -> str:
    """Append ``statement`` after the function's last ``*.reset_parameters()`` call."""
    if statement in text:
        return text
    for anchor in (
        "self.post_attention_norm.reset_parameters()",
        "self.ffn_norm.reset_parameters()",
        "self.attention_norm.reset_parameters()",
    ):
        if anchor in text and anchor != statement:
            return replace_in_function(text, class_name, func, anchor, f"{anchor}\n{statement}\n")
    raise ValueError(f"{class_name}.{func} resets no norm to add {statement!r} after")


def _block_wiring(plan: PortPlan) -> tuple[str, bool]:
    """The block's wiring in one sentence, and whether edits compose on it (a residual
    multiplier or an all-MoE feed-forward on top of the norm placement)."""
    mult = " * residual_multiplier" if plan.residual_multiplier_field else ""
    mlp, call = ("MoE", "moe") if plan.all_layers_moe else ("feed-forward", "feed_forward")
    if plan.block == "parallel":
        norms = "norm(x)" if plan.shared_block_norm else "attention_norm(x)"
        ffn_norm = "norm(x)" if plan.shared_block_norm else "ffn_norm(x)"
        sentence = f"Parallel attention and {mlp}: ``x + attention({norms}){mult} + {call}({ffn_norm}){mult}``" + (
            ", one norm feeding both." if plan.shared_block_norm else ", each with its own norm of the input."
        )
    elif plan.block == "sandwich":
        sentence = f"Sandwich norms: ``x + post_norm(attention(norm(x))){mult}``, then the same around the {mlp}."
    elif plan.block == "post_norm":
        sentence = f"Post-norm: ``x + norm(attention(x)){mult}``, then ``x + norm({call}(x)){mult}``."
    else:
        sentence = f"``x + attention(norm(x)){mult}``, then ``x + {call}(norm(x)){mult}``."
    if plan.all_layers_moe:
        sentence += " Every layer routes its tokens to experts."
    return sentence, bool(mult) or plan.all_layers_moe or plan.block == "parallel"


def _set_block_doc(text: str, plan: PortPlan) -> str:
    """``TransformerBlock``'s docstring from the plan, so composed edits describe one block."""
    sentence, composed = _block_wiring(plan)
    lines = textwrap.wrap(sentence, width=88, break_on_hyphens=False) if composed else [sentence]
    doc = lines[0] if len(lines) == 1 else "\n    ".join(lines) + "\n    "
    return set_docstring(text, "TransformerBlock", doc)


def _post_branches(text: str) -> str:
    text = wrap_residual_branch(text, "attention", "self.post_attention_norm({})", applied_if="post_attention_norm")
    return wrap_residual_branch(text, "ffn", "self.post_ffn_norm({})", applied_if="post_ffn_norm")


def _sandwich_norm(text: str, ctx: EditContext) -> str:
    """Norms before and after each sub-layer: ``x + post_norm(f(norm(x)))``."""
    text = _add_block_norms(text, ("post_attention_norm", "post_ffn_norm"))
    return _post_branches(text)


HEAD_RETURN = "return head(h) if head is not None else h"
LOGITS_BLOCK = """if head is None:
    return h
if self.is_critic:
    return head(h)
logits = head(h)
return logits
"""


def _transform_logits(text: str, ctx: EditContext, statements: str) -> str:
    """Add ``statements`` (rewriting ``logits``) between the LM head and the return; a
    critic's scores are left alone. Logit transforms compose in the edits' order."""
    first = statements.strip().splitlines()[-1]
    if first in text:
        return text
    text = replace_in_function(text, ctx.model_class, "forward", HEAD_RETURN, LOGITS_BLOCK)
    return replace_in_function(text, ctx.model_class, "forward", "return logits", f"{statements}return logits\n")


def _final_softcap(text: str, ctx: EditContext) -> str:
    return _transform_logits(
        text,
        ctx,
        "# The LM head's logits are soft-capped: cap * tanh(logits / cap).\n"
        "cap = self.model_args.final_logit_softcapping\n"
        "logits = torch.tanh(logits / cap) * cap\n",
    )


def _remove_qk_norm(text: str, ctx: EditContext) -> str:
    """Drop the reference's per-head QK norm (qwen3) from a family that has none."""
    if "self.q_norm" not in text:
        return text
    for statement in (
        "self.q_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)",
        "self.k_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)",
    ):
        text = replace_in_function(text, "Attention", "__init__", statement, "")
    for statement in ("self.q_norm.reset_parameters()", "self.k_norm.reset_parameters()"):
        text = replace_in_function(text, "Attention", "init_weights", statement, "")
    for statement in ("xq = maybe_to_local(self.q_norm(xq))", "xk = maybe_to_local(self.k_norm(xk))"):
        text = replace_in_function(text, "Attention", "forward", statement, "")
    return remove_function(text, "maybe_to_local")


def _full_width_qk_norm(text: str, ctx: EditContext) -> str:
    """RMSNorm over the whole q (and k) projection output, before the heads split and RoPE.

    On a copy that carries per-head QK norms (qwen3), those go first."""
    if "self.q_norm = RMSNorm(self.head_dim" in text:
        text = _remove_qk_norm(text, ctx)
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        "# Queries and keys are normalised over all heads at once (the full projection width).\n"
        "self.q_norm = RMSNorm(self.n_heads * self.head_dim, eps=model_args.norm_eps)\n"
        "self.k_norm = RMSNorm(self.n_kv_heads * self.head_dim, eps=model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "init_weights",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)\n"
        "self.q_norm.reset_parameters()\nself.k_norm.reset_parameters()\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "forward",
        "xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)",
        "xq = self.q_norm(self.wq(x)).view(bs, seqlen, -1, self.head_dim)\n",
    )
    return replace_in_function(
        text,
        "Attention",
        "forward",
        "xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)",
        "xk = self.k_norm(self.wk(x)).view(bs, seqlen, -1, self.head_dim)\n",
    )


def _post_norm(text: str, ctx: EditContext) -> str:
    """Norms after each sub-layer instead of before it: ``x + norm(f(x))``."""
    text = (
        replace_in_residual_branch(text, "attention", "self.attention_norm(x)", "x")
        if "self.attention_norm(x)" in text
        else text
    )
    text = replace_in_residual_branch(text, "ffn", "self.ffn_norm(x)", "x") if "self.ffn_norm(x)" in text else text
    for old, new in (("attention_norm", "post_attention_norm"), ("ffn_norm", "post_ffn_norm")):
        if f"self.{old} =" in text:
            text = replace_statement_assigning(
                text,
                "TransformerBlock",
                "__init__",
                f"self.{old}",
                f"self.{new} = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n",
            )
            text = replace_in_function(
                text,
                "TransformerBlock",
                "init_weights",
                f"self.{old}.reset_parameters()",
                f"self.{new}.reset_parameters()\n",
            )
    return _post_branches(text)


def _parallel_block(text: str, ctx: EditContext) -> str:
    """Attention and feed-forward both read the block input: ``x + attention(norm(x)) +
    mlp(norm'(x))``; with one shared norm, ``norm(x)`` is computed once and feeds both."""
    text = parallel_branches(text)
    if not ctx.profile.shared_block_norm or "self.ffn_norm" not in text:
        return text
    text = replace_in_residual_branch(text, "attention", "self.attention_norm(x)", "h")
    text = replace_in_residual_branch(text, "ffn", "self.ffn_norm(x)", "h")
    norm = "self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)"
    text = replace_in_function(text, "TransformerBlock", "__init__", norm, "")
    text = replace_in_function(text, "TransformerBlock", "init_weights", "self.ffn_norm.reset_parameters()", "")
    shared = "One norm of the block input feeds both branches."
    return prepend_to_block_forward(text, "h = self.attention_norm(x)", shared)


ROPE_CACHE_CALL = (
    "return precompute_rope_cache(self.model_args.head_dim, self.model_args.max_seq_len, self.model_args.rope_theta)"
)


def _rope_cache(text: str, ctx: EditContext) -> str:
    """The RoPE cache the family needs: over the rotary part of each head only (partial
    rotary) and/or with the checkpoint's frequency scaling (rope_parameters)."""
    plan = ctx.profile
    width = "args.rotary_dim" if plan.partial_rotary else "args.head_dim"
    scaling = ", args.rope_freq_scaling" if plan.rope_type != "default" else ""
    comment = "# Only the first rotary_dim features of each head rotate.\n" if plan.partial_rotary else ""
    return replace_in_function(
        text,
        ctx.model_class,
        "_precompute_rope_cache",
        ROPE_CACHE_CALL,
        f"args = self.model_args\n{comment}"
        f"return precompute_rope_cache({width}, args.max_seq_len, args.rope_theta{scaling})\n",
    )


# --- norms ------------------------------------------------------------------------------


def _norm_offset(text: str, ctx: EditContext) -> str:
    return replace_class(text, "RMSNorm", snippet("norms", "OffsetRMSNorm", rename="RMSNorm"))


def _layer_norm(text: str, ctx: EditContext) -> str:
    text = remove_class(text, "RMSNorm")
    text = remove_from_all(text, ["RMSNorm"])
    return replace_name(text, "RMSNorm", "nn.LayerNorm")


# --- MLP --------------------------------------------------------------------------------


def _activation_call(plan: PortPlan, inner: str) -> str:
    return ACTIVATIONS[plan.activation].replace("{}", inner)


def _activation_name(plan: PortPlan) -> str:
    return {"silu": "SiLU", "gelu_pytorch_tanh": "tanh-approximated GELU", "gelu": "GELU"}[plan.activation]


def _activation(text: str, ctx: EditContext) -> str:
    """The feed-forward's activation, whatever MLP shape the other edits chose."""
    text = replace_call(text, "FeedForward", "forward", "F.silu", _activation_call(ctx.profile, "{}"))
    gated = "self.w3" in text.split("class FeedForward", 1)[1].split("\nclass ", 1)[0]
    shape = "Gated MLP ``w2(act(w1(x)) * w3(x))``" if gated else "Two-layer MLP ``w2(act(w1(x)))``"
    roles = (
        "``w1`` is HF's gate_proj, ``w3`` up_proj, ``w2`` down_proj."
        if gated
        else "``w1`` is HF's up projection (c_fc, fc1), ``w2`` its down projection (c_proj, fc2)."
    )
    sentence = f"{shape} with the {_activation_name(ctx.profile)} activation; {roles}"
    lines = textwrap.wrap(sentence, width=88, break_on_hyphens=False)
    doc = lines[0] if len(lines) == 1 else "\n    ".join(lines) + "\n    "
    return set_docstring(text, "FeedForward", doc)


def _plain_mlp(text: str, ctx: EditContext) -> str:
    return replace_class(text, "FeedForward", snippet("mlp", "PlainFeedForward", rename="FeedForward"))


def _mlp_bias(text: str, ctx: EditContext) -> str:
    for target in ("self.w1", "self.w2", "self.w3"):
        if f"{target} = nn.Linear(" in text.split("class FeedForward", 1)[1]:
            text = set_call_kwarg(text, "nn.Linear", "bias", "True", target=target)
    return text


# --- block and model scalars ------------------------------------------------------------

EMBED = "h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens"


def _embedding_sqrt_dim(text: str, ctx: EditContext) -> str:
    return replace_in_function(
        text,
        ctx.model_class,
        "forward",
        EMBED,
        """if self.tok_embeddings is not None:
    # Embeddings are scaled by sqrt(dim), the factor rounded to the activation dtype as in HF.
    h = self.tok_embeddings(tokens)
    h = h * torch.tensor(self.model_args.dim**0.5, dtype=h.dtype)
else:
    h = tokens
""",
    )


def _embedding_multiplier(text: str, ctx: EditContext) -> str:
    field = ctx.profile.embedding_scale_field
    return replace_in_function(
        text,
        ctx.model_class,
        "forward",
        EMBED,
        f"""if self.tok_embeddings is not None:
    h = self.tok_embeddings(tokens) * self.model_args.{field}
else:
    h = tokens
""",
    )


def _residual_multiplier(text: str, ctx: EditContext) -> str:
    """Both residual branches scaled before the add, whatever norms wrap them."""
    field = ctx.profile.residual_multiplier_field
    if "self.residual_multiplier =" not in text:
        text = insert_after_statement_assigning(
            text, "TransformerBlock", "__init__", "self.attention", f"self.residual_multiplier = model_args.{field}\n"
        )
    for branch in ("attention", "ffn"):
        text = wrap_residual_branch(
            text, branch, "{} * self.residual_multiplier", applied_if="self.residual_multiplier"
        )
    return text


def _logits_scaling(text: str, ctx: EditContext) -> str:
    field = ctx.profile.logit_divisor_field
    return _transform_logits(
        text, ctx, f"# The LM head's logits are divided by {field}.\nlogits = logits / self.model_args.{field}\n"
    )


def _logits_multiplier(text: str, ctx: EditContext) -> str:
    field = ctx.profile.logit_multiplier_field
    return _transform_logits(
        text, ctx, f"# The LM head's logits are multiplied by {field}.\nlogits = logits * self.model_args.{field}\n"
    )


def _all_layers_moe(text: str, ctx: EditContext) -> str:
    """Every layer routes its tokens to experts: no dense feed-forward, no per-layer switch.

    ``moe_enabled`` stays as a constant attribute: AReaL's parallelize helpers read it."""
    for statement in ("self.moe: MoE | None = None", "self.feed_forward: FeedForward | None = None"):
        text = replace_in_function(text, "TransformerBlock", "__init__", statement, "")
    text = replace_statement_assigning(
        text, "TransformerBlock", "__init__", "self.moe_enabled", "self.moe_enabled = True  # every layer is MoE\n"
    )
    text = replace_statement_assigning(
        text,
        "TransformerBlock",
        "__init__",
        "self.moe",
        "self.moe = MoE(model_args.moe_args, dim=model_args.dim, hidden_dim=model_args.moe_inter_dim)\n",
    )
    for func in ("forward", "init_weights"):
        text = replace_in_function(
            text, "TransformerBlock", func, "mlp = self.moe if self.moe_enabled else self.feed_forward", ""
        )
    # Whatever the norm edits made of the feed-forward branch, its callee is now the MoE.
    text = replace_call(text, "TransformerBlock", "forward", "mlp", "self.moe({})")
    text = replace_in_function(
        text,
        "TransformerBlock",
        "init_weights",
        "mlp.init_weights(self.weight_init_std)",
        "self.moe.init_weights(self.weight_init_std)",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "init_buffers",
        "if self.moe is not None:\n    self.moe.init_buffers(buffer_device)",
        "self.moe.init_buffers(buffer_device)",
    )
    text = remove_class(text, "FeedForward")
    text = remove_from_all(text, ["FeedForward"])
    return text


# The canonical order: where two edits touch one place, the inner one comes first
# (norms wrap a residual branch before the multiplier scales it; the logit divisor
# before the soft-cap; the MLP's shape before its activation and bias).
MODEL_EDITS: tuple[ModelEdit, ...] = (
    ModelEdit(
        "remove_qk_norm",
        "no QK norm (the qwen3 reference has one)",
        lambda p: p.qk_norm == "none",
        _remove_qk_norm,
        needed=lambda text: "self.q_norm" in text,
    ),
    ModelEdit(
        "full_width_qk_norm",
        "RMSNorm over the full q/k projections",
        lambda p: p.qk_norm == "full",
        _full_width_qk_norm,
    ),
    ModelEdit(
        "projection_bias",
        "q/k/v and output projection biases as the checkpoint has them",
        lambda p: True,
        _projection_bias,
    ),
    ModelEdit(
        "sliding_window",
        "sliding-window attention inside each document",
        lambda p: p.sliding_window and not p.sliding_layer_types and not p.attn_softcap,
        _sliding_window,
    ),
    ModelEdit(
        "eager_attention",
        "explicit attention for soft-capped scores and/or a per-layer sliding window",
        lambda p: p.attn_softcap or p.sliding_layer_types,
        _eager_attention,
    ),
    ModelEdit(
        "attention_scale",
        "attention scores scaled by a config field",
        lambda p: p.attn_scale is not None,
        _attention_scale,
    ),
    ModelEdit(
        "rope_cache",
        "RoPE cache over the rotary part of each head and/or with scaled frequencies",
        lambda p: p.partial_rotary or p.rope_type != "default",
        _rope_cache,
    ),
    ModelEdit("post_norm", "norms after each sub-layer, none before", lambda p: p.block == "post_norm", _post_norm),
    ModelEdit(
        "sandwich_norm", "norms before and after each sub-layer", lambda p: p.block == "sandwich", _sandwich_norm
    ),
    ModelEdit(
        "parallel_block",
        "attention and feed-forward in parallel on the block input",
        lambda p: p.block == "parallel",
        _parallel_block,
    ),
    ModelEdit(
        "residual_multiplier",
        "sub-layer outputs scaled before the residual add",
        lambda p: p.residual_multiplier_field is not None,
        _residual_multiplier,
    ),
    ModelEdit(
        "all_layers_moe",
        "every layer MoE: no dense switch",
        lambda p: p.all_layers_moe,
        _all_layers_moe,
        needed=lambda text: "self.moe_enabled = model_args" in text,
    ),
    ModelEdit("norm_offset", "RMSNorm scaled by (1 + weight)", lambda p: p.norm == "rms_offset", _norm_offset),
    ModelEdit("layer_norm", "LayerNorm (with bias) instead of RMSNorm", lambda p: p.norm == "layernorm", _layer_norm),
    ModelEdit(
        "plain_mlp", "two-layer (non-gated) MLP", lambda p: p.mlp == "plain" and not p.all_layers_moe, _plain_mlp
    ),
    ModelEdit(
        "activation",
        "feed-forward activation other than SiLU",
        lambda p: p.activation != "silu" and not p.all_layers_moe,
        _activation,
        needed=lambda text: "class FeedForward" in text,
    ),
    ModelEdit(
        "mlp_bias",
        "biases on the feed-forward projections",
        lambda p: p.mlp_bias and not p.all_layers_moe,
        _mlp_bias,
        needed=lambda text: "class FeedForward" in text,
    ),
    ModelEdit(
        "embedding_sqrt_dim",
        "embeddings scaled by sqrt(dim)",
        lambda p: p.embedding_scale == "sqrt_dim",
        _embedding_sqrt_dim,
    ),
    ModelEdit(
        "embedding_multiplier",
        "embeddings scaled by a config multiplier",
        lambda p: p.embedding_scale == "multiplier",
        _embedding_multiplier,
    ),
    ModelEdit(
        "logits_scaling",
        "logits divided by a config factor",
        lambda p: p.logit_divisor_field is not None,
        _logits_scaling,
    ),
    ModelEdit(
        "logits_multiplier",
        "logits multiplied by a config factor",
        lambda p: p.logit_multiplier_field is not None,
        _logits_multiplier,
    ),
    ModelEdit("final_softcap", "logits soft-capped by tanh", lambda p: p.final_softcap, _final_softcap),
)

EDITS_BY_NAME = {edit.name: edit for edit in MODEL_EDITS}


def select_edits(profile: PortPlan, text: str) -> list[str]:
    """The edits the family's features call for, given the copied reference's ``model.py``."""
    return [edit.name for edit in MODEL_EDITS if edit.applies(profile) and edit.needed(text)]


BLOCK_NAMES = {
    "pre_norm": "pre-norm",
    "sandwich": "sandwich-norm",
    "post_norm": "post-norm",
    "parallel": "parallel attention/MLP",
}


def describe(profile: PortPlan, camel: str) -> str:
    """A one-line module docstring naming the family's architecture."""
    attention = ["GQA"]
    if profile.qkv_bias:
        attention.append("q/k/v bias" + (" and output bias" if profile.o_bias else ""))
    if profile.qk_norm == "full":
        attention.append("full-width QK RMSNorm")
    elif profile.qk_norm == "per_head":
        attention.append("per-head QK RMSNorm")
    if profile.sliding_window:
        attention.append("sliding-window attention" + (" on some layers" if profile.sliding_layer_types else ""))
    if profile.attn_softcap:
        attention.append("soft-capped attention scores")
    norm = {"rms": "RMSNorm", "rms_offset": "(1 + w) RMSNorm", "layernorm": "LayerNorm"}[profile.norm]
    mlp = (
        ("SwiGLU" if profile.activation == "silu" else f"gated {_activation_name(profile)}")
        if profile.mlp == "gated"
        else f"two-layer {_activation_name(profile)}"
    )
    extras = []
    if profile.rope_type != "default":
        extras.append(f"{profile.rope_type}-scaled RoPE")
    if profile.partial_rotary:
        extras.append("partial rotary embeddings")
    if profile.rotary_interleaved:
        extras.append("RoPE over adjacent feature pairs (interleaved)")
    if profile.moe:
        extras.append(
            "mixture-of-experts MLPs"
            + (" routed by per-expert sigmoid scores" if profile.router_scoring == "sigmoid" else "")
            + (" with a gated shared expert" if profile.shared_expert else "")
        )
    if profile.embedding_scale == "sqrt_dim":
        extras.append("sqrt(dim)-scaled embeddings")
    if profile.multipliers:
        extras.append("scalar multipliers (" + ", ".join(profile.multipliers) + ")")
    if profile.final_softcap:
        extras.append("soft-capped logits")
    if profile.tied:
        extras.append("tied embeddings")
    tail = ", ".join(extras)
    sentence = (
        f"{camel}: a {BLOCK_NAMES[profile.block]} decoder with {', '.join(attention)}, RoPE, {norm} and a {mlp} MLP"
        + (f"; {tail}" if tail else "")
        + ", over packed documents."
    )
    lines = textwrap.wrap(sentence, width=92, break_on_hyphens=False)
    return lines[0] if len(lines) == 1 else "\n".join(lines) + "\n"


ATTENTION_DOC = """Grouped-query self-attention with Ulysses sequence parallelism.
{features}
    Under Ulysses (``set_cp_group`` with a group of size > 1) every rank holds a slice of
    the sequence; an all-to-all trades it for a slice of the heads over the whole
    sequence before attention, and back afterwards.
    """


def _attention_features(profile: PortPlan) -> str:
    sentences = []
    if profile.qkv_bias:
        sentences.append(
            "The q/k/v projections have biases" + (", and so does the output projection." if profile.o_bias else ".")
        )
    elif profile.o_bias:
        sentences.append("The output projection has a bias.")
    if profile.sliding_layer_types:
        sentences.append(
            "On layers marked ``sliding_attention`` each token attends to the last ``sliding_window`` "
            "tokens of its own document."
        )
    elif profile.sliding_window:
        sentences.append("Each token attends to the last ``sliding_window`` tokens of its own document.")
    if profile.attn_softcap:
        sentences.append("Scores are soft-capped before the softmax.")
    if profile.qk_norm == "full":
        sentences.append(
            "``q_norm``/``k_norm`` normalise the whole q and k projections (all heads at once) before RoPE."
        )
    if not sentences:
        return ""
    wrapped = textwrap.wrap(" ".join(sentences), width=88, break_on_hyphens=False)
    return "\n" + "".join(f"    {line}\n" for line in wrapped)


def apply_model_edits(text: str, ctx: EditContext, names: list[str]) -> str:
    """Apply the named edits in the canonical order of :data:`MODEL_EDITS` (whatever order
    they are named in), so two edits on one place always nest the same way."""
    unknown = [name for name in names if name not in EDITS_BY_NAME]
    if unknown:
        raise ValueError(f"unknown model edit(s) {unknown}; known: {sorted(EDITS_BY_NAME)}")
    order = list(EDITS_BY_NAME)
    for name in sorted(dict.fromkeys(names), key=order.index):
        text = EDITS_BY_NAME[name].apply(text, ctx)
    profile = ctx.profile
    if profile.block != "pre_norm" or _block_wiring(profile)[1]:
        # The block's wiring as the edits composed it (the reference's own otherwise).
        text = _set_block_doc(text, profile)
    text = set_docstring(text, "Attention", ATTENTION_DOC.format(features=_attention_features(profile)))
    text = set_docstring(text, None, describe(profile, ctx.camel))
    return prune_unused_imports(text)
