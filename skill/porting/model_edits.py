"""Named feature edits that specialise a copied reference ``model.py`` to a family.

Each edit is chosen from the family's measured profile (``FamilyProfile``), rewrites
only the classes and statements that feature touches (through libcst), and is a no-op
when already applied. What remains reads like hand-written code for the family: an
edit that removes a feature deletes its code instead of adding a flag.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from skill.codemod.cst import (
    add_parameter,
    insert_after_statement_assigning,
    insert_before_class,
    prune_unused_imports,
    remove_class,
    remove_function,
    remove_from_all,
    replace_class,
    replace_in_function,
    replace_name,
    replace_statement_assigning,
    set_call_kwarg,
    set_docstring,
)
from skill.porting.family import ACTIVATIONS, FamilyProfile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EditContext:
    camel: str
    model_class: str
    profile: FamilyProfile


@dataclass(frozen=True)
class ModelEdit:
    name: str
    description: str
    applies: Callable[[FamilyProfile], bool]
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


SLIDING_WINDOW_ATTENTION = '''
class SlidingWindowAttention(nn.Module):
    """Causal attention over packed documents in which each token sees only the last
    ``window`` tokens of its own document, itself included (HF's sliding-window mask).

    Archon's shared attention wrappers have no window, so it lives in this package: one
    SDPA call per document with a banded causal mask, on every backend.
    """

    def __init__(self, window: int):
        super().__init__()
        if window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {window}.")
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """``q`` ``[1, H, T, D]``, ``k``/``v`` ``[1, H_kv, T, D]`` -> ``[1, H, T, D]``."""
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[-1] < q.shape[2]:
            bounds.append(q.shape[2])  # trailing padding attends as its own document
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            index = torch.arange(end - start, device=q.device)
            distance = index[:, None] - index[None, :]
            mask = (distance >= 0) & (distance < self.window)
            outputs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start:end],
                    k[:, :, start:end],
                    v[:, :, start:end],
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=q.shape[1] != k.shape[1],
                )
            )
        return torch.cat(outputs, dim=2)
'''


def _sliding_window(text: str, ctx: EditContext) -> str:
    text = insert_before_class(text, "Attention", SLIDING_WINDOW_ATTENTION)
    text = replace_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.packed_attn",
        "self.packed_attn = SlidingWindowAttention(model_args.sliding_window)\n",
    )
    return text


EAGER_ATTENTION = '''
class EagerAttention(nn.Module):
    """Attention over packed documents computed step by step, because SDPA cannot
    soft-cap scores: ``softcap * tanh(scores / softcap)`` before the causal (and, for a
    sliding-window layer, banded) mask and an fp32 softmax, as HF's eager path does.

    Archon's shared attention wrappers have neither soft-capping nor windows, so this
    lives in the package. One document at a time; no document attends to another.
    """

    def __init__(self, softcap: float | None = None, window: int | None = None):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {window}.")
        self.softcap = softcap
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """``q`` ``[1, H, T, D]``, ``k``/``v`` ``[1, H_kv, T, D]`` -> ``[1, H, T, D]``."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        n_rep = q.shape[1] // k.shape[1]
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[-1] < q.shape[2]:
            bounds.append(q.shape[2])  # trailing padding attends as its own document
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            keys = k[:, :, start:end].repeat_interleave(n_rep, dim=1)
            values = v[:, :, start:end].repeat_interleave(n_rep, dim=1)
            scores = torch.matmul(q[:, :, start:end], keys.transpose(2, 3)) * scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            index = torch.arange(end - start, device=q.device)
            distance = index[:, None] - index[None, :]
            allowed = distance >= 0
            if self.window is not None:
                allowed = allowed & (distance < self.window)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            outputs.append(torch.matmul(probs, values))
        return torch.cat(outputs, dim=2)
'''


def _eager_attention(text: str, ctx: EditContext) -> str:
    profile = ctx.profile
    text = insert_before_class(text, "Attention", EAGER_ATTENTION)
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
            "sliding = model_args.layer_types[layer_id] == \"sliding_attention\"\n"
            "self.attention = Attention(model_args, sliding_window=model_args.sliding_window if sliding else None)\n",
        )
    return text


def _query_pre_attn_scalar(text: str, ctx: EditContext) -> str:
    return replace_in_function(
        text,
        "Attention",
        "__init__",
        "self.scaling = self.head_dim**-0.5",
        "self.scaling = model_args.query_pre_attn_scalar**-0.5\n",
    )


def _sandwich_norm(text: str, ctx: EditContext) -> str:
    text = replace_in_function(
        text,
        "TransformerBlock",
        "__init__",
        "self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)",
        "self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n"
        "self.post_attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n"
        "self.post_ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "init_weights",
        "self.ffn_norm.reset_parameters()",
        "self.ffn_norm.reset_parameters()\nself.post_attention_norm.reset_parameters()\nself.post_ffn_norm.reset_parameters()\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "forward",
        "x = x + self.attention(self.attention_norm(x), rope_cache, positions, cu_seqlens, max_seqlen)",
        "attn_out = self.attention(self.attention_norm(x), rope_cache, positions, cu_seqlens, max_seqlen)\n"
        "x = x + self.post_attention_norm(attn_out)\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "forward",
        "return x + self.feed_forward(self.ffn_norm(x))",
        "return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x)))\n",
    )
    return set_docstring(
        text,
        "TransformerBlock",
        "Sandwich norms: ``x + post_norm(attention(norm(x)))``, then the same around the feed-forward.",
    )


def _final_softcap(text: str, ctx: EditContext) -> str:
    return replace_in_function(
        text,
        ctx.model_class,
        "forward",
        "return head(h) if head is not None else h",
        """if head is None:
    return h
if self.is_critic:
    return head(h)
# The LM head's logits are soft-capped: cap * tanh(logits / cap).
cap = self.model_args.final_logit_softcapping
return torch.tanh(head(h) / cap) * cap
""",
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
    """RMSNorm over the whole q (and k) projection output, before the heads split and RoPE."""
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
    text = replace_in_function(
        text,
        "TransformerBlock",
        "__init__",
        "self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)",
        "self.post_attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "__init__",
        "self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)",
        "self.post_ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text, "TransformerBlock", "init_weights", "self.attention_norm.reset_parameters()",
        "self.post_attention_norm.reset_parameters()\n",
    )
    text = replace_in_function(
        text, "TransformerBlock", "init_weights", "self.ffn_norm.reset_parameters()",
        "self.post_ffn_norm.reset_parameters()\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "forward",
        "x = x + self.attention(self.attention_norm(x), rope_cache, positions, cu_seqlens, max_seqlen)",
        "x = x + self.post_attention_norm(self.attention(x, rope_cache, positions, cu_seqlens, max_seqlen))\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "forward",
        "return x + self.feed_forward(self.ffn_norm(x))",
        "return x + self.post_ffn_norm(self.feed_forward(x))\n",
    )
    return set_docstring(
        text, "TransformerBlock", "Post-norm: ``x + norm(attention(x))``, then ``x + norm(feed_forward(x))``."
    )


def _rope_scaling(text: str, ctx: EditContext) -> str:
    """Hand the checkpoint's RoPE scaling parameters to the package's precompute_rope_cache."""
    return replace_in_function(
        text,
        ctx.model_class,
        "_precompute_rope_cache",
        "return precompute_rope_cache(self.model_args.head_dim, self.model_args.max_seq_len, self.model_args.rope_theta)",
        "args = self.model_args\n"
        "return precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_freq_scaling)\n",
    )


def _partial_rotary(text: str, ctx: EditContext) -> str:
    """A RoPE cache for the rotary part of each head only."""
    return replace_in_function(
        text,
        ctx.model_class,
        "_precompute_rope_cache",
        "return precompute_rope_cache(self.model_args.head_dim, self.model_args.max_seq_len, self.model_args.rope_theta)",
        "# Only the first rotary_dim features of each head rotate.\n"
        "return precompute_rope_cache(self.model_args.rotary_dim, self.model_args.max_seq_len, self.model_args.rope_theta)\n",
    )


def _attention_multiplier(text: str, ctx: EditContext) -> str:
    return replace_in_function(
        text,
        "Attention",
        "__init__",
        "self.scaling = self.head_dim**-0.5",
        "self.scaling = model_args.attention_multiplier\n",
    )


# --- norms ------------------------------------------------------------------------------

OFFSET_RMS_NORM = '''class RMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, all in fp32 and cast back at the end (as HF does).

    The weight is stored as an offset from one, so it starts at zero.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
'''


def _norm_offset(text: str, ctx: EditContext) -> str:
    return replace_class(text, "RMSNorm", OFFSET_RMS_NORM)


def _layer_norm(text: str, ctx: EditContext) -> str:
    text = remove_class(text, "RMSNorm")
    text = remove_from_all(text, ["RMSNorm"])
    return replace_name(text, "RMSNorm", "nn.LayerNorm")


# --- MLP --------------------------------------------------------------------------------


def _activation_call(profile: FamilyProfile, inner: str) -> str:
    if profile.activation == "gelu_pytorch_tanh":
        return f'F.gelu({inner}, approximate="tanh")'
    return f"{ACTIVATIONS[profile.activation]}({inner})"


def _activation_name(profile: FamilyProfile) -> str:
    return {"silu": "SiLU", "gelu_pytorch_tanh": "tanh-approximated GELU", "gelu": "GELU"}[profile.activation]


def _gated_activation(text: str, ctx: EditContext) -> str:
    new = f"return self.w2({_activation_call(ctx.profile, 'self.w1(x)')} * self.w3(x))\n"
    text = replace_in_function(text, "FeedForward", "forward", "return self.w2(F.silu(self.w1(x)) * self.w3(x))", new)
    return set_docstring(
        text,
        "FeedForward",
        f"Gated MLP ``w2(act(w1(x)) * w3(x))`` with the {_activation_name(ctx.profile)} activation; "
        "``w1`` is HF's gate_proj, ``w3`` up_proj, ``w2`` down_proj.",
    )


def _plain_mlp(text: str, ctx: EditContext) -> str:
    bias = "True" if ctx.profile.mlp_bias else "False"
    zero_bias = (
        "\n        for linear in (self.w1, self.w2):\n            nn.init.zeros_(linear.bias)" if ctx.profile.mlp_bias else ""
    )
    return replace_class(
        text,
        "FeedForward",
        f'''class FeedForward(nn.Module):
    """Two-layer MLP ``w2(act(w1(x)))`` with the {_activation_name(ctx.profile)} activation;
    ``w1`` is HF's c_fc, ``w2`` c_proj."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias={bias})
        self.w2 = nn.Linear(hidden_dim, dim, bias={bias})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2({_activation_call(ctx.profile, "self.w1(x)")})

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std){zero_bias}
''',
    )


def _mlp_bias(text: str, ctx: EditContext) -> str:
    for target in ("self.w1", "self.w2", "self.w3"):
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
    return replace_in_function(
        text,
        ctx.model_class,
        "forward",
        EMBED,
        """if self.tok_embeddings is not None:
    h = self.tok_embeddings(tokens) * self.model_args.embedding_multiplier
else:
    h = tokens
""",
    )


def _residual_multiplier(text: str, ctx: EditContext) -> str:
    text = replace_in_function(
        text,
        "TransformerBlock",
        "__init__",
        "self.dim = model_args.dim",
        "self.dim = model_args.dim\nself.residual_multiplier = model_args.residual_multiplier\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "forward",
        "x = x + self.attention(self.attention_norm(x), rope_cache, positions, cu_seqlens, max_seqlen)",
        "attn_out = self.attention(self.attention_norm(x), rope_cache, positions, cu_seqlens, max_seqlen)\n"
        "x = x + attn_out * self.residual_multiplier\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "forward",
        "return x + self.feed_forward(self.ffn_norm(x))",
        "return x + self.feed_forward(self.ffn_norm(x)) * self.residual_multiplier\n",
    )
    return set_docstring(
        text,
        "TransformerBlock",
        "``x + residual_multiplier * attention(norm(x))``, then the same around the feed-forward.",
    )


def _logits_scaling(text: str, ctx: EditContext) -> str:
    return replace_in_function(
        text,
        ctx.model_class,
        "forward",
        "return head(h) if head is not None else h",
        """if head is None:
    return h
# The LM head's logits are divided by logits_scaling; a critic's scores are not.
return head(h) if self.is_critic else head(h) / self.model_args.logits_scaling
""",
    )


MODEL_EDITS: tuple[ModelEdit, ...] = (
    ModelEdit(
        "remove_qk_norm",
        "no QK norm (the qwen3 reference has one)",
        lambda p: p.qk_norm == "none",
        _remove_qk_norm,
        needed=lambda text: "self.q_norm" in text,
    ),
    ModelEdit("projection_bias", "q/k/v and output projection biases as the checkpoint has them", lambda p: True, _projection_bias),
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
    ModelEdit("query_pre_attn_scalar", "attention scale from query_pre_attn_scalar", lambda p: p.query_pre_attn_scalar, _query_pre_attn_scalar),
    ModelEdit("rope_scaling", "RoPE frequencies scaled as rope_parameters say", lambda p: p.rope_type != "default", _rope_scaling),
    ModelEdit("partial_rotary", "RoPE on the leading rotary_dim features of each head", lambda p: p.partial_rotary, _partial_rotary),
    ModelEdit("full_width_qk_norm", "RMSNorm over the full q/k projections", lambda p: p.qk_norm == "full", _full_width_qk_norm),
    ModelEdit("post_norm", "norms after each sub-layer, none before", lambda p: p.block == "post_norm", _post_norm),
    ModelEdit("sandwich_norm", "norms before and after each sub-layer", lambda p: p.block == "sandwich", _sandwich_norm),
    ModelEdit("final_softcap", "logits soft-capped by tanh", lambda p: p.final_softcap, _final_softcap),
    ModelEdit("attention_multiplier", "attention scores scaled by a config multiplier", lambda p: "attention_multiplier" in p.multipliers, _attention_multiplier),
    ModelEdit("norm_offset", "RMSNorm scaled by (1 + weight)", lambda p: p.norm == "rms_offset", _norm_offset),
    ModelEdit("layer_norm", "LayerNorm (with bias) instead of RMSNorm", lambda p: p.norm == "layernorm", _layer_norm),
    ModelEdit("gated_activation", "gated MLP with another activation than SiLU", lambda p: p.mlp == "gated" and p.activation != "silu", _gated_activation),
    ModelEdit("mlp_bias", "biases on the gated MLP projections", lambda p: p.mlp == "gated" and p.mlp_bias, _mlp_bias),
    ModelEdit("plain_mlp", "two-layer (non-gated) MLP", lambda p: p.mlp == "plain", _plain_mlp),
    ModelEdit("embedding_sqrt_dim", "embeddings scaled by sqrt(dim)", lambda p: p.embedding_scale == "sqrt_dim", _embedding_sqrt_dim),
    ModelEdit("embedding_multiplier", "embeddings scaled by a config multiplier", lambda p: p.embedding_scale == "multiplier", _embedding_multiplier),
    ModelEdit("residual_multiplier", "sub-layer outputs scaled before the residual add", lambda p: "residual_multiplier" in p.multipliers, _residual_multiplier),
    ModelEdit("logits_scaling", "logits divided by a config factor", lambda p: "logits_scaling" in p.multipliers, _logits_scaling),
)

EDITS_BY_NAME = {edit.name: edit for edit in MODEL_EDITS}


def select_edits(profile: FamilyProfile, text: str) -> list[str]:
    """The edits the family's features call for, given the copied reference's ``model.py``."""
    return [edit.name for edit in MODEL_EDITS if edit.applies(profile) and edit.needed(text)]


BLOCK_NAMES = {"pre_norm": "pre-norm", "sandwich": "sandwich-norm", "post_norm": "post-norm"}


def describe(profile: FamilyProfile, camel: str) -> str:
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
    if profile.moe:
        extras.append("mixture-of-experts MLPs" + (" with a gated shared expert" if profile.shared_expert else ""))
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


def _attention_features(profile: FamilyProfile) -> str:
    sentences = []
    if profile.qkv_bias:
        sentences.append("The q/k/v projections have biases" + (", and so does the output projection." if profile.o_bias else "."))
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
    for name in names:
        if name not in EDITS_BY_NAME:
            raise ValueError(f"unknown model edit {name!r}; known: {sorted(EDITS_BY_NAME)}")
        text = EDITS_BY_NAME[name].apply(text, ctx)
    profile = ctx.profile
    text = set_docstring(text, "Attention", ATTENTION_DOC.format(features=_attention_features(profile)))
    text = set_docstring(text, None, describe(profile, ctx.camel))
    return prune_unused_imports(text)
