"""Named feature edits that specialise a copied reference ``model.py`` to a family.

Each edit is chosen from the family's port plan (read off the analysis report), is
addressed to the Archon module contract (the attention's projections and kernel, the
block's residual branches, the norm and feed-forward classes, the embedding and the LM
head; see ``skill.codemod.contract``), and is a no-op when already applied. Two edits on
one place compose: the sandwich norms and the residual multiplier both wrap the same
residual branch, the logit divisor and the final soft-cap both transform the logits, on
either reference. The code an edit inserts is a class of ``skill/snippets/``,
never a string. What remains reads like hand-written code for the family: an edit that
removes a feature deletes its code instead of adding a flag.
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Callable, Collection
from dataclasses import dataclass

from skill.activations import ACTIVATIONS
from skill.analysis.reference import EDITABLE_REFERENCES
from skill.codemod.contract import (
    append_to_embedding_stage,
    normalise_residual_sum,
    parallel_branches,
    prepend_to_block_forward,
    remove_arguments,
    remove_call_arguments,
    replace_call,
    replace_in_residual_branch,
    wrap_residual_branch,
)
from skill.codemod.cst import (
    CodemodError,
    Document,
    add_parameter,
    append_to_function,
    class_code,
    ensure_import_line,
    has_method,
    insert_after_construction,
    insert_after_statement_assigning,
    insert_before_class,
    keep_else_branch,
    prune_unused_imports,
    remove_call_kwarg,
    remove_class,
    remove_from_all,
    remove_function,
    remove_method,
    remove_statements,
    replace_class,
    replace_function,
    replace_in_function,
    replace_name,
    replace_return,
    replace_statement_assigning,
    replace_text,
    set_call_argument,
    set_call_kwarg,
    set_docstring,
    upsert_method,
)
from skill.feature_modules import FEATURE_MODULES, MODULES_BY_NAME
from skill.features import IN_QUERY_SUFFIX
from skill.porting.hybrid_package import HYBRID_REFERENCE
from skill.porting.plan import PortPlan
from skill.snippets import snippet

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
    apply: Callable[[Document, EditContext], Document]
    # Whether the copied reference's source still needs it (default: always).
    needed: Callable[[str], bool] = lambda text: True


# --- attention --------------------------------------------------------------------------


def _projection_bias(text: Document, ctx: EditContext) -> Document:
    qkv = "True" if ctx.profile.qkv_bias else "False"
    for target in ("self.wq", "self.wk", "self.wv"):
        text = set_call_kwarg(text, "nn.Linear", "bias", qkv, target=target)
    text = set_call_kwarg(text, "nn.Linear", "bias", "True" if ctx.profile.o_bias else "False", target="self.wo")
    return replace_in_function(text, "Attention", "__init__", "bias = model_args.attention_bias", "")


# The helpers each attention kernel of snippets/attention.py runs its documents through:
# one call per document on CPU, compiled flex attention (and for a window the flash varlen
# kernel, where the installed torch's takes one) on CUDA.
FLEX_HELPERS = ("flex_functions", "flex_packed")
KERNEL_HELPERS = {
    "SlidingWindowAttention": ("per_document", *FLEX_HELPERS, "flash_varlen_keywords"),
    "EagerAttention": ("per_document", *FLEX_HELPERS),
    "SinkAttention": ("per_document", *FLEX_HELPERS, "fold_sinks"),
    "SoftCappedSinkAttention": ("per_document", *FLEX_HELPERS, "fold_sinks"),
    "AlibiAttention": ("alibi_slopes", "per_document", *FLEX_HELPERS),
    "WindowedAlibiAttention": ("alibi_slopes", "per_document", *FLEX_HELPERS),
    "SoftCappedAlibiAttention": ("alibi_slopes", "per_document", *FLEX_HELPERS),
}
HELPER_IMPORTS = (
    "import functools",
    "from collections.abc import Callable",
    "from itertools import pairwise",
    "from typing import Any",
)
# Imports a kernel's helpers need beyond those.
KERNEL_IMPORTS = {
    "AlibiAttention": ("import math",),
    "WindowedAlibiAttention": ("import math",),
    "SoftCappedAlibiAttention": ("import math",),
    "SlidingWindowAttention": ("import inspect",),
}


def _insert_kernel(text: Document, kernel: str) -> Document:
    """The kernel class and the document drivers it uses, each once, before ``Attention``."""
    for helper in KERNEL_HELPERS[kernel]:
        if f"def {helper}(" not in text:
            text = insert_before_class(text, "Attention", snippet("attention", helper))
    for line in (*HELPER_IMPORTS, *KERNEL_IMPORTS.get(kernel, ())):
        text = ensure_import_line(text, line)
    return insert_before_class(text, "Attention", snippet("attention", kernel))


PLAIN_ATTENTION = "self.attention = Attention(model_args)"


def per_layer_window(windowed_kind: str) -> str:
    """The block's attention, windowed on the layers of ``windowed_kind``."""
    return (
        f"# Layers marked {windowed_kind} see a window of their document; the others all of it.\n"
        f'sliding = model_args.layer_types[layer_id] == "{windowed_kind}"\n'
        "self.attention = Attention(model_args, sliding_window=model_args.sliding_window if sliding else None)\n"
    )


def _window_argument(text: Document, ctx: EditContext) -> tuple[Document, str]:
    """The kernel's window: a per-layer ``sliding_window`` parameter of ``Attention`` (set by
    the block from ``layer_types``), the config's window on every layer, or none."""
    profile = ctx.profile
    if profile.sliding_layer_types:
        if "sliding_window: int | None = None" not in text:
            text = add_parameter(text, "Attention", "__init__", "sliding_window: int | None = None")
            text = replace_in_function(
                text, "TransformerBlock", "__init__", PLAIN_ATTENTION, per_layer_window(profile.windowed_kind)
            )
        return text, "sliding_window"
    return text, "model_args.sliding_window" if profile.sliding_window else "None"


def _sliding_window(text: Document, ctx: EditContext) -> Document:
    text = _insert_kernel(text, "SlidingWindowAttention")
    text = replace_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.packed_attn",
        "self.packed_attn = SlidingWindowAttention(model_args.sliding_window)\n",
    )
    return text


def _eager_attention(text: Document, ctx: EditContext) -> Document:
    profile = ctx.profile
    text = _insert_kernel(text, "EagerAttention")
    softcap = "model_args.attn_logit_softcapping" if profile.attn_softcap else "None"
    text, window = _window_argument(text, ctx)
    return replace_statement_assigning(
        text, "Attention", "__init__", "self.packed_attn", f"self.packed_attn = EagerAttention({softcap}, {window})\n"
    )


def _attention_sinks(text: Document, ctx: EditContext) -> Document:
    """A learned sink logit per head (HF's ``self_attn.sinks``) joins every softmax row; with
    soft-capped scores, the kernel that caps them before the sink joins (SoftCappedSinkAttention)."""
    if "self.sinks =" in text:
        return text
    text = _insert_kernel(text, "SinkAttention")
    text, window = _window_argument(text, ctx)
    kernel = f"SinkAttention({window})"
    if ctx.profile.attn_softcap:
        text = _insert_kernel(text, "SoftCappedSinkAttention")
        kernel = f"SoftCappedSinkAttention(model_args.attn_logit_softcapping, {window})"
    text = replace_statement_assigning(
        text, "Attention", "__init__", "self.packed_attn", f"self.packed_attn = {kernel}\n"
    )
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        "# One learned logit per head joins each row's softmax and attends to nothing.\n"
        "self.sinks = nn.Parameter(torch.zeros(self.n_heads))\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "init_weights",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)\nnn.init.zeros_(self.sinks)\n",
    )
    text = upsert_method(text, "Attention", "local_sinks", snippet("attention", "local_sinks"), after="init_weights")
    text = set_call_kwarg(text, "self.packed_attn", "sinks", "self.local_sinks(xq.shape[2])", target="out")
    return ensure_import_line(text, "from torch.distributed.tensor import DTensor")


# The gate functions of a gated attention output (``OutputGateKind``), ``{}`` the gate projection.
_GATE_FUNCTIONS = {"sigmoid": "torch.sigmoid({})", "softplus": "F.softplus({})"}


def _output_gate(text: Document, ctx: EditContext) -> Document:
    """A projection of the block input (``wg``, HF's gate projection) gates the attention
    output before ``wo``: every element, or every head's channels by one value, scaled by
    the gate function of the projection."""
    if "self.wg =" in text:
        return text
    kind = ctx.profile.output_gate
    assert kind is not None
    function, granularity = kind.split("_per_")
    width = "self.n_heads" if granularity == "head" else "self.n_heads * self.head_dim"
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        f"# A {function} gate of the block input scales the attention output (one value per "
        f"{granularity}) before wo.\n"
        f"self.wg = nn.Linear(model_args.dim, {width}, bias={ctx.profile.output_gate_bias})\n",
    )
    reset = "nn.init.trunc_normal_(self.wg.weight, mean=0.0, std=0.02)\n"
    if ctx.profile.output_gate_bias:
        reset += "nn.init.zeros_(self.wg.bias)\n"
    text = replace_in_function(
        text,
        "Attention",
        "init_weights",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)",
        f"nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)\n{reset}",
    )
    gate = _GATE_FUNCTIONS[function].format("self.wg(x)")
    if granularity == "head":
        text = insert_before_class(text, "Attention", snippet("attention", "gate_per_head"))
        return replace_call(text, "Attention", "forward", "self.wo", f"self.wo(gate_per_head({{}}, {gate}))")
    return replace_call(text, "Attention", "forward", "self.wo", f"self.wo({{}} * {gate})")


def _query_gate(text: Document, ctx: EditContext) -> Document:
    """The query projection also yields the output gate (MiniCPM5-MoE's ``q_gate_proj``):
    ``wq`` is twice as wide, each head's rows its query then its gate, and the gate
    function of the gate scales the attention output before ``wo``, element by element."""
    if "split_query_gate(" in text:
        return text
    kind = ctx.profile.output_gate
    assert kind is not None
    function = kind.removesuffix(IN_QUERY_SUFFIX)
    text = set_call_argument(text, "nn.Linear", 1, "2 * self.n_heads * self.head_dim", target="self.wq")
    text = insert_before_class(text, "Attention", snippet("attention", "split_query_gate"))
    text = replace_call(text, "Attention", "forward", "self.wq", "query")
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "forward",
        "bs, seqlen, _",
        "# Each head's rows of wq hold its query, then the gate of its attention output.\n"
        "query, gate = split_query_gate(self.wq(x), self.head_dim)\n",
    )
    gate = _GATE_FUNCTIONS[function].format("gate")
    return replace_call(text, "Attention", "forward", "self.wo", f"self.wo({{}} * {gate})")


def _last_layer_o_bias(text: Document, ctx: EditContext) -> Document:
    """The last layer's output projection alone has a bias (GPT-NeoX-Japanese's ``dense_bias``,
    added to ``dense``'s output): ``Attention`` takes ``output_bias`` and the block sets it on the
    last layer."""
    text = add_parameter(text, "Attention", "__init__", "output_bias: bool = False")
    # Set again on a second run: projection_bias writes the projections' biases of layer 0.
    text = set_call_kwarg(text, "nn.Linear", "bias", "output_bias", target="self.wo")
    init = "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)"
    zero = "if self.wo.bias is not None:\n    nn.init.zeros_(self.wo.bias)"
    if "nn.init.zeros_(self.wo.bias)" not in class_code(text, "Attention"):
        text = replace_in_function(text, "Attention", "init_weights", init, f"{init}\n{zero}\n")
    return set_call_kwarg(
        text, "Attention", "output_bias", "layer_id == model_args.n_layers - 1", target="self.attention"
    )


def _attention_sub_norm(text: Document, ctx: EditContext) -> Document:
    """A norm of the block norms' class over every head's output (``n_heads * head_dim``) on
    the input of ``wo``, innermost: ``wo`` reads the norm's output (BitNet's attn_sub_norm)."""
    if "self.sub_norm" in class_code(text, "Attention"):
        return text
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        "# The attention output is normalised over all heads before wo.\n"
        "self.sub_norm = RMSNorm(self.n_heads * self.head_dim, eps=model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "init_weights",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)\nself.sub_norm.reset_parameters()\n",
    )
    return replace_call(text, "Attention", "forward", "self.wo", "self.wo(self.sub_norm({}))")


def _differential_attention(text: Document, ctx: EditContext) -> Document:
    """Differential attention (snippets/differential.py): the block's kernel, whichever the
    other edits chose, wrapped so that it runs over each KV head of a pair and each head pair's
    outputs are subtracted with ``lambda`` (``self.diff_lambda``, HF's four lambda vectors) and
    normalised; ``lambda_init`` follows the layer, so ``Attention`` takes ``layer_id``."""
    if "DifferentialAttention(" in class_code(text, "Attention"):
        return text
    for name in ("differential_lambda_init", "DifferentialLambda", "DifferentialAttention"):
        text = insert_before_class(text, "Attention", snippet("differential", name))
    text = ensure_import_line(text, "import math")
    text = add_parameter(text, "Attention", "__init__", "layer_id: int = 0")
    text = set_call_kwarg(text, "Attention", "layer_id", "layer_id", target="self.attention")
    text = append_to_function(
        text,
        "Attention",
        "__init__",
        "# Differential attention: each head pair's outputs subtracted with a learned lambda, over the\n"
        "# kernel run once per KV head of the pair (the adapter keeps a pair's heads side by side).\n"
        "self.diff_lambda = DifferentialLambda(self.head_dim)\n"
        "self.packed_attn = DifferentialAttention(self.packed_attn, layer_id, self.head_dim, model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "init_weights",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)\nself.diff_lambda.reset_parameters()\n",
    )
    return set_call_kwarg(text, "self.packed_attn", "lambda_diff", "self.diff_lambda()", target="out")


def _alibi_attention(text: Document, ctx: EditContext) -> Document:
    """ALiBi: each head adds its fixed slope times the key's distance behind the query (within
    the document) to its scores. The slopes are no checkpoint tensor: each rank computes
    those of the heads it attends with (``head_offset``: its tensor-parallel block, which
    ``parallelize`` sets). With a sliding window (on every layer or by a per-layer pattern),
    the kernel that also hides the keys behind it (WindowedAlibiAttention); with soft-capped
    scores, the one that caps them before the bias (SoftCappedAlibiAttention)."""
    if "AlibiAttention()" in text or "WindowedAlibiAttention(" in text or "SoftCappedAlibiAttention(" in text:
        return text
    text = _insert_kernel(text, "AlibiAttention")
    kernel = "AlibiAttention()"
    if ctx.profile.sliding_window or ctx.profile.attn_softcap:
        text = _insert_kernel(text, "WindowedAlibiAttention")
        text, window = _window_argument(text, ctx)
        kernel = f"WindowedAlibiAttention({window})"
        if ctx.profile.attn_softcap:
            text = _insert_kernel(text, "SoftCappedAlibiAttention")
            kernel = f"SoftCappedAlibiAttention(model_args.attn_logit_softcapping, {window})"
    text = replace_statement_assigning(
        text, "Attention", "__init__", "self.packed_attn", f"self.packed_attn = {kernel}\n"
    )
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        "# The first of this rank's heads among all n_heads (tensor parallelism sets it): ALiBi's\n"
        "# slope is a function of the head's index.\n"
        "self.head_offset = 0\n",
    )
    text = upsert_method(
        text, "Attention", "local_alibi_slopes", snippet("attention", "local_alibi_slopes"), after="init_weights"
    )
    return set_call_kwarg(
        text, "self.packed_attn", "slopes", "self.local_alibi_slopes(xq.shape[2], xq.device)", target="out"
    )


def _latent_norm_eps(text: Document, ctx: EditContext) -> Document:
    """MLA's latent norms built with the block norms' epsilon (the config's), not the
    reference's fixed ``LATENT_NORM_EPS``."""
    # (the statement's code starts with the comment lines above it)
    text = remove_statements(text, lambda code: re.search(r"^LATENT_NORM_EPS\s*=", code, re.MULTILINE) is not None)
    return replace_name(text, "LATENT_NORM_EPS", "model_args.norm_eps")


def _sparse_indexer(text: Document, ctx: EditContext) -> Document:
    """DeepSeek Sparse Attention on MLA: the indexer (``snippets/indexer.py``) reads the query
    latent and the hidden state, and the attention keeps each query's top-k keys (per document,
    causal). Under Ulysses every rank gathers the indexer's per-token tensors over the whole
    sequence, as the attention gathers its keys."""
    indexer = ctx.profile.indexer
    assert indexer is not None
    if "self.indexer =" in text:
        return text
    rotary = {"apply_rotary_emb": "apply_interleaved_rotary_emb"} if indexer.rotary_interleaved else None
    for name in ("Indexer", "sparse_index_mask", "IndexedAttention"):
        text = insert_before_class(text, "Attention", snippet("indexer", name, names=rotary))
    text = ensure_import_line(text, "from itertools import pairwise")
    text = ensure_import_line(text, "from archon_models.ulysses import ulysses_gather_output")
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        "# DeepSeek Sparse Attention: the indexer picks the keys each query attends to.\n"
        "self.indexer = Indexer(model_args)\n",
    )
    text = replace_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.packed_attn",
        "self.packed_attn = IndexedAttention(model_args.index_topk)\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "init_weights",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)\nself.indexer.init_weights(init_std)\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "forward",
        "q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))",
        "# The indexer reads the query latent, which a family with an indexer always has.\n"
        "q_latent = self.q_norm(self.wq_a(x))\n"
        "q = self.wq_b(q_latent)\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "forward",
        "n_local_heads = q_nope.shape[2]",
        "# The indexer's queries, key and head weights per token (no gradient), over the whole\n"
        "# sequence: under Ulysses each rank holds a slice and gathers the rest.\n"
        "index = self.indexer(x, q_latent, rope_cache, positions)\n"
        "if self._sp_enabled:\n"
        "    index = tuple(ulysses_gather_output(t, self._cp_group, seq_dim=1) for t in index)\n"
        "\n"
        "n_local_heads = q_nope.shape[2]\n",
    )
    return set_call_kwarg(text, "self.packed_attn", "index", "index", target="out")


def _clip_qkv(text: Document, ctx: EditContext) -> Document:
    """The q/k/v projections clamped to ``[-clip_qkv, clip_qkv]`` as they come out of their
    linear layers (before any view, norm or RoPE), when the checkpoint sets the field; q and
    k after their QK norm instead where the analysis measured that order (OLMoE)."""
    if "self.clip_qkv =" in text:
        return text
    text = insert_before_class(text, "Attention", snippet("attention", "clamp_projection"))
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        f"# The checkpoint's {ctx.profile.clip_qkv_field} bounds q, k and v (None: unbounded).\n"
        f"self.clip_qkv = model_args.{ctx.profile.clip_qkv_field}\n",
    )
    after_norm = ctx.profile.clip_after_qk_norm
    if after_norm and not ("self.q_norm(" in text and "self.k_norm(" in text):
        raise CodemodError("q/k are clamped after their QK norm, but the attention has no q_norm/k_norm calls")
    clamped = ("self.q_norm", "self.k_norm", "self.wv") if after_norm else ("self.wq", "self.wk", "self.wv")
    for call in clamped:
        text = replace_call(text, "Attention", "forward", call, f"clamp_projection({call}({{}}), self.clip_qkv)")
    return text


def _attention_scale(text: Document, ctx: EditContext) -> Document:
    """Scores scaled by the config field that sets them (``x`` or ``x**-0.5``)."""
    scale = ctx.profile.attn_scale
    assert scale is not None
    value = f"model_args.{scale.field}" + ("**-0.5" if scale.relation == "x**-0.5" else "")
    return replace_statement_assigning(text, "Attention", "__init__", "self.scaling", f"self.scaling = {value}\n")


def _constant_attention_scale(text: Document, ctx: EditContext) -> Document:
    """Scores scaled by a constant the checkpoint's code fixes and no config field sets
    (GPT-Neo multiplies ``q . k`` by nothing, whatever ``head_dim`` is)."""
    value = ctx.profile.attn_scale_constant
    assert value is not None
    return replace_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.scaling",
        f"# The scores are scaled by {value!r}, not head_dim**-0.5: the family fixes it, no config field sets it.\n"
        f"self.scaling = {value!r}\n",
    )


def _add_block_norms(text: Document, names: tuple[str, ...]) -> Document:
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


def _append_to_function(text: Document, class_name: str, func: str, statement: str) -> Document:
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
    elif plan.block == "post_ln":
        sentence = f"Post-LN: ``x = norm(x + attention(x){mult})``, then ``norm(x + {call}(x){mult})``."
    else:
        sentence = f"``x + attention(norm(x)){mult}``, then ``x + {call}(norm(x)){mult}``."
    if plan.all_layers_moe:
        sentence += " Every layer routes its tokens to experts."
    return sentence, bool(mult) or plan.all_layers_moe or plan.block == "parallel"


def _set_block_doc(text: Document, plan: PortPlan) -> Document:
    """``TransformerBlock``'s docstring from the plan, so composed edits describe one block."""
    sentence, composed = _block_wiring(plan)
    lines = textwrap.wrap(sentence, width=88, break_on_hyphens=False) if composed else [sentence]
    doc = lines[0] if len(lines) == 1 else "\n    ".join(lines) + "\n    "
    return set_docstring(text, "TransformerBlock", doc)


def _post_branches(text: Document) -> Document:
    text = wrap_residual_branch(text, "attention", "self.post_attention_norm({})", applied_if="post_attention_norm")
    return wrap_residual_branch(text, "ffn", "self.post_ffn_norm({})", applied_if="post_ffn_norm")


def _moe_output_norm(text: Document, ctx: EditContext) -> Document:
    """A norm of the block norms' class on the MoE's output, where the block adds it to the
    residual (A.X-K1's post_mlp_layernorm, which HF applies inside its MoE block). Not inside
    Archon's MoE module: under TP its output there is a partial sum until the module's output
    step. Dense layers add their feed-forward's output as it is."""
    if "self.moe_output_norm" in text:
        return text
    norm = "RMSNorm(model_args.dim, eps=model_args.norm_eps)"
    built = norm if ctx.profile.all_layers_moe else f"{norm} if self.moe_enabled else nn.Identity()"
    text = insert_after_statement_assigning(
        text,
        "TransformerBlock",
        "__init__",
        "self.moe_enabled",
        "# The MoE's output (routed plus shared experts) is normalised before the residual add.\n"
        f"self.moe_output_norm = {built}\n",
    )
    reset = "self.moe_output_norm.reset_parameters()"
    if not ctx.profile.all_layers_moe:
        reset = f"if self.moe_enabled:\n    {reset}"
    init = "self.attention.init_weights(self.weight_init_std)"
    text = replace_in_function(text, "TransformerBlock", "init_weights", init, f"{init}\n{reset}\n")
    return wrap_residual_branch(text, "ffn", "self.moe_output_norm({})", applied_if="moe_output_norm")


def _sandwich_norm(text: Document, ctx: EditContext) -> Document:
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


def _transform_logits(text: Document, ctx: EditContext, statements: str) -> Document:
    """Add ``statements`` (rewriting ``logits``) between the LM head and the return; a
    critic's scores are left alone. Logit transforms compose in the edits' order."""
    first = statements.strip().splitlines()[-1]
    if first in text:
        return text
    text = replace_in_function(text, ctx.model_class, "forward", HEAD_RETURN, LOGITS_BLOCK)
    return replace_in_function(text, ctx.model_class, "forward", "return logits", f"{statements}return logits\n")


def _final_softcap(text: Document, ctx: EditContext) -> Document:
    if "final_logit_softcapping" not in ctx.profile.nullable_fields:
        return _transform_logits(
            text,
            ctx,
            "# The LM head's logits are soft-capped: cap * tanh(logits / cap).\n"
            "cap = self.model_args.final_logit_softcapping\n"
            "logits = torch.tanh(logits / cap) * cap\n",
        )
    return _transform_logits(
        text,
        ctx,
        "# The LM head's logits are soft-capped: cap * tanh(logits / cap); no cap when it is None.\n"
        "cap = self.model_args.final_logit_softcapping\n"
        "if cap is not None:\n"
        "    logits = torch.tanh(logits / cap) * cap\n",
    )


HEAD_INIT = """for head in (None if tied else self.output, self.score):
    if head is not None:
        nn.init.trunc_normal_(head.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
"""


def _lm_head_bias(text: Document, ctx: EditContext) -> Document:
    """The LM head adds a bias (HF's ``lm_head.bias``): ``output`` is built with one and
    starts it at zero. A critic's ``score`` head keeps none."""
    text = set_call_kwarg(text, "nn.Linear", "bias", "True", target="self.output")
    if "nn.init.zeros_(self.output.bias)" in text:
        return text
    return replace_in_function(
        text,
        ctx.model_class,
        "init_weights",
        HEAD_INIT,
        f"{HEAD_INIT}if self.output is not None:\n"
        "    # The LM head's bias (the checkpoint's lm_head.bias) starts at zero.\n"
        "    nn.init.zeros_(self.output.bias)\n",
    )


# A q_norm built over one head's features, or over every head's, whatever its class.
PER_HEAD_QK_NORM = re.compile(r"self\.q_norm = [\w.]+\(self\.head_dim\b")
FULL_WIDTH_QK_NORM = re.compile(r"self\.q_norm = [\w.]+\(self\.n_heads \* self\.head_dim\b")


# The forward's per-head QK norm, as the per_head_qk_norm edit and the qwen3 reference write it.
QK_NORM_STATEMENTS = ("xq = maybe_to_local(self.q_norm(xq))", "xk = maybe_to_local(self.k_norm(xk))")


def _remove_qk_norm(text: Document, ctx: EditContext) -> Document:
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
    for statement in QK_NORM_STATEMENTS:
        text = replace_in_function(text, "Attention", "forward", statement, "")
    return remove_function(text, "maybe_to_local")


def _per_head_qk_norm(text: Document, ctx: EditContext) -> Document:
    """RMSNorm over each head's ``head_dim`` features of q and k (one weight shared by the
    heads), before RoPE, on a copy without it (qwen2). The norm class is the block's, so a
    (1 + w) RMSNorm family gets (1 + w) QK norms."""
    if PER_HEAD_QK_NORM.search(text.code):
        return text  # already applied (built as the block norms' class or its own kind)
    text = ensure_import_line(text, "from torch.distributed.tensor import DTensor")
    text = insert_before_class(text, "Attention", snippet("attention", "maybe_to_local"))
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        "self.q_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)\n"
        "self.k_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text,
        "Attention",
        "init_weights",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)",
        "nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)\n"
        "self.q_norm.reset_parameters()\nself.k_norm.reset_parameters()\n",
    )
    return replace_in_function(
        text,
        "Attention",
        "forward",
        "xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)",
        "xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)\n"
        "xq = maybe_to_local(self.q_norm(xq))\n"
        "xk = maybe_to_local(self.k_norm(xk))\n",
    )


def _full_width_qk_norm(text: Document, ctx: EditContext) -> Document:
    """RMSNorm over the whole q (and k) projection output, before the heads split and RoPE.

    On a copy that carries per-head QK norms (qwen3), those go first."""
    if FULL_WIDTH_QK_NORM.search(text.code):
        return text  # already applied (the q/k lines may carry a clamp since)
    if PER_HEAD_QK_NORM.search(text.code):
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


def _post_norm(text: Document, ctx: EditContext) -> Document:
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


def _post_ln(text: Document, ctx: EditContext) -> Document:
    """Post-LN (the original Transformer's block): each sub-layer reads the residual stream
    itself and the sum is normalised, ``x = attention_norm(x + attention(x))``, then
    ``ffn_norm(x + feed_forward(x))``. The norms keep their names; only where they sit moves."""
    for branch, norm in (("attention", "attention_norm"), ("ffn", "ffn_norm")):
        if f"self.{norm}(x)" in text:
            text = replace_in_residual_branch(text, branch, f"self.{norm}(x)", "x")  # type: ignore[arg-type]
        text = normalise_residual_sum(text, branch, norm)  # type: ignore[arg-type]
    return text


NORM_INIT = "if self.norm is not None:\n    self.norm.reset_parameters()\n"
LAST_STAGE_PROJECTION = "self.project_out is not None and self.norm is not None"


def _no_final_norm(text: Document, ctx: EditContext) -> Document:
    """No norm after the last block (a post-LN stack ends normalised): ``norm`` stays
    ``None``, as on a pipeline stage without it, and the hidden states go to the head."""
    if "self.norm: nn.Module | None = None" in text:
        return text
    text = replace_statement_assigning(
        text,
        ctx.model_class,
        "__init__",
        "self.norm",
        "# The blocks end normalised (post-LN): no final norm before the LM head.\n"
        "self.norm: nn.Module | None = None\n",
    )
    text = replace_in_function(text, ctx.model_class, "init_weights", NORM_INIT, "")
    text = replace_in_function(text, ctx.model_class, "forward", NORM_LINE, "")
    if LAST_STAGE_PROJECTION in text:
        # The stage holding the head (there is no final norm to mark it) projects back out.
        text = replace_text(
            text,
            LAST_STAGE_PROJECTION,
            "self.project_out is not None and (self.output is not None or self.score is not None)",
        )
        text = replace_text(text, "(on the stage that holds the final norm)", "(on the stage that holds the head)")
    return text


ROPE_ARGS = ("rope_cache", "positions")
# init_buffers of a family without RoPE (until an edit adds a buffer).
NO_BUFFERS = '"""No buffers: positions enter through the embeddings, nothing is precomputed."""'


def _remove_rope(text: Document, ctx: EditContext) -> Document:
    """No rotary embedding: the RoPE cache, its rotation and the arguments that carry it
    (and the positions, which only RoPE read inside a block) go."""
    if "apply_rotary_emb(" not in text and "_precompute_rope_cache" not in text:
        return text  # applied (a position edit may have given init_buffers a body since)
    text = replace_in_function(
        text, "Attention", "forward", "xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)", ""
    )
    text = remove_arguments(text, "Attention", "forward", ROPE_ARGS)
    text = remove_arguments(text, "TransformerBlock", "forward", ROPE_ARGS)
    text = remove_call_arguments(text, "TransformerBlock", "forward", "self.attention", ROPE_ARGS)
    text = remove_call_arguments(text, ctx.model_class, "forward", "layer", ("self.rope_cache", "positions"))
    text = replace_in_function(
        text,
        ctx.model_class,
        "__init__",
        'self.register_buffer("rope_cache", self._precompute_rope_cache(), persistent=False)',
        "",
    )
    text = remove_method(text, ctx.model_class, "_precompute_rope_cache")
    return replace_in_function(
        text,
        ctx.model_class,
        "init_buffers",
        "with torch.device(buffer_device):\n    self.rope_cache = self._precompute_rope_cache()",
        f"{NO_BUFFERS}\n",
    )


def _learned_positions(text: Document, ctx: EditContext) -> Document:
    """A learned absolute-position table added to the token embeddings; each token reads the
    row of its position within its own document (the packed batch's ``positions``)."""
    if "self.pos_embeddings(" in text:
        return text
    offset = ctx.profile.position_offset
    rows = f"model_args.max_seq_len + {offset}" if offset else "model_args.max_seq_len"
    comment = (
        f"# Learned absolute positions; position p is row p + {offset} (the checkpoint keeps {offset} rows before 0).\n"
        if offset
        else "# Learned absolute positions: one row per position within a document.\n"
    )
    text = insert_after_statement_assigning(
        text,
        ctx.model_class,
        "__init__",
        "self.tok_embeddings",
        f"{comment}self.pos_embeddings = nn.Embedding({rows}, model_args.dim)\n",
    )
    text = replace_in_function(
        text,
        ctx.model_class,
        "init_weights",
        "nn.init.normal_(self.tok_embeddings.weight)",
        "nn.init.normal_(self.tok_embeddings.weight)\nnn.init.normal_(self.pos_embeddings.weight)\n",
    )
    index = f"positions + {offset}" if offset else "positions"
    return append_to_embedding_stage(
        text,
        ctx.model_class,
        f"# Positions restart at 0 in every packed document.\nh = h + self.pos_embeddings({index})\n",
    )


NORM_LINE = "h = self.norm(h) if self.norm is not None else h"
HEADS = """if model_args.is_critic:
    self.score = nn.Linear(model_args.dim, model_args.num_labels, bias=False)
else:
    self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
"""


# The references' embedding leaves the pad_token_id row untrained, as HF's does.
PADDING_IDX = "padding_idx=model_args.pad_id"


def _embedding_projection(text: Document, ctx: EditContext) -> Document:
    """Token embeddings (and the LM head) of the config's embedding width: where it differs
    from ``dim``, ``project_in`` maps the embeddings up before the positions are added and
    ``project_out`` maps the final norm's output back down for the head (OPT's
    ``word_embed_proj_dim``); where the widths agree neither exists, as in the checkpoint."""
    if "self.project_in" in text:
        return text
    width = f"model_args.{ctx.profile.embedding_projection_field}"
    head_bias = "True" if ctx.profile.lm_head_bias else "False"
    padding = f", {PADDING_IDX}" if ctx.profile.padding_idx_field is not None else ""
    text = replace_statement_assigning(
        text,
        ctx.model_class,
        "__init__",
        "self.tok_embeddings",
        f"self.tok_embeddings: nn.Embedding | None = nn.Embedding(model_args.vocab_size, {width}{padding})\n",
    )
    text = insert_after_statement_assigning(
        text,
        ctx.model_class,
        "__init__",
        "self.tok_embeddings",
        f"# The embeddings and the LM head are {ctx.profile.embedding_projection_field} wide; where that is not\n"
        "# dim, project_in maps the embeddings up before layer 0 and project_out maps the final\n"
        "# norm's output back down for the head.\n"
        f"projected = {width} != model_args.dim\n"
        f"self.project_in: nn.Linear | None = nn.Linear({width}, model_args.dim, bias=False) if projected else None\n"
        f"self.project_out: nn.Linear | None = nn.Linear(model_args.dim, {width}, bias=False) if projected else None\n",
    )
    text = replace_in_function(
        text,
        ctx.model_class,
        "__init__",
        HEADS,
        HEADS.replace("model_args.dim", width).replace("vocab_size, bias=False", f"vocab_size, bias={head_bias}"),
    )
    text = replace_in_function(
        text,
        ctx.model_class,
        "init_weights",
        "nn.init.normal_(self.tok_embeddings.weight)",
        "nn.init.normal_(self.tok_embeddings.weight)\n"
        "for projection in (self.project_in, self.project_out):\n"
        "    if projection is not None:\n"
        "        nn.init.trunc_normal_(projection.weight, mean=0.0, std=0.02)\n",
    )
    text = append_to_embedding_stage(
        text, ctx.model_class, "if self.project_in is not None:\n    h = self.project_in(h)\n"
    )
    return replace_in_function(
        text,
        ctx.model_class,
        "forward",
        NORM_LINE,
        f"{NORM_LINE}\n"
        "if self.project_out is not None and self.norm is not None:\n"
        "    # Back to the embedding width for the LM head (on the stage that holds the final norm).\n"
        "    h = self.project_out(h)\n",
    )


def _sinusoidal_positions(text: Document, ctx: EditContext) -> Document:
    """A fixed sinusoidal table (no checkpoint tensor) added to the (scaled) token embeddings;
    each token reads the row of its position within its own document, after the table's
    leading rows; the row the config's field names is zero, as the checkpoint's code has it."""
    if "self.pos_embeddings(" in text:
        return text
    plan = ctx.profile
    offset, zero = plan.position_offset, plan.position_zero_row_field
    text = insert_before_class(text, ctx.model_class, snippet("positions", "sinusoidal_positions"))
    text = insert_before_class(text, ctx.model_class, snippet("positions", "SinusoidalPositions"))
    text = ensure_import_line(text, "import math")
    arguments = ["model_args.max_seq_len", "model_args.dim"]
    if offset:
        arguments.append(f"offset={offset}")
    if zero is not None:
        arguments.append(f"zero_row=model_args.{zero}")
    comment = (
        f"# Fixed sinusoidal positions: position p reads row p + {offset}"
        + (f"; row {zero} is zero" if zero is not None else "")
        + ".\n"
    )
    text = insert_after_statement_assigning(
        text,
        ctx.model_class,
        "__init__",
        "self.tok_embeddings",
        f"{comment}self.pos_embeddings = SinusoidalPositions({', '.join(arguments)})\n",
    )
    text = replace_in_function(
        text,
        ctx.model_class,
        "init_buffers",
        NO_BUFFERS,
        "with torch.device(buffer_device):\n    self.pos_embeddings.table = self.pos_embeddings.build()\n",
    )
    return append_to_embedding_stage(
        text,
        ctx.model_class,
        "# Positions restart at 0 in every packed document.\nh = h + self.pos_embeddings(positions).to(h.dtype)\n",
    )


def _embedding_norm(text: Document, ctx: EditContext) -> Document:
    """A norm on the embeddings before layer 0 (Bloom's word_embeddings_layernorm), of the
    block norms' class, last in the embedding stage."""
    if "self.embedding_norm(" in text:
        return text
    norm_class = "RMSNorm" if "class RMSNorm" in text else "nn.LayerNorm"
    text = insert_after_statement_assigning(
        text,
        ctx.model_class,
        "__init__",
        "self.tok_embeddings",
        "# The embeddings are normalised before the first block.\n"
        f"self.embedding_norm = {norm_class}(model_args.dim, eps=model_args.norm_eps)\n",
    )
    text = replace_in_function(
        text,
        ctx.model_class,
        "init_weights",
        "nn.init.normal_(self.tok_embeddings.weight)",
        "nn.init.normal_(self.tok_embeddings.weight)\nself.embedding_norm.reset_parameters()\n",
    )
    return append_to_embedding_stage(text, ctx.model_class, "h = self.embedding_norm(h)\n")


def _parallel_block(text: Document, ctx: EditContext) -> Document:
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


def _rope_cache(text: Document, ctx: EditContext) -> Document:
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


# The cache holds [cos | sin] (every rope.py variant writes it so): negating sin turns each
# pair the other way, whatever the frequencies, the rotary width or the pairing.
REVERSED_ROTATION = (
    "# The checkpoint turns each pair the other way, (x1, x2) -> (x2, -x1) where transformers'\n"
    "# rotate_half gives (-x2, x1): that is the rotation by minus the angle, so the cache holds -sin.\n"
    "cos, sin = cache.chunk(2, dim=-1)\n"
    "return torch.cat([cos, -sin], dim=-1)\n"
)


def _reversed_rotation(text: Document, ctx: EditContext) -> Document:
    """RoPE turning each pair the other way (nanochat's ``rotate_half`` is ``(x2, -x1)``):
    the cache's sine negated, after whatever frequencies and width the cache has."""
    if "torch.cat([cos, -sin], dim=-1)" in text:
        return text
    return replace_return(text, ctx.model_class, "_precompute_rope_cache", "cache", REVERSED_ROTATION)


ROPE_CALL = "xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)"


def _qk_norm_after_rope(text: Document, ctx: EditContext) -> Document:
    """The per-head QK norm moved after RoPE: queries and keys are rotated, then normalised.

    Under TP ``wq``/``wk`` keep DTensor outputs for the norms; this rank's heads are taken
    local before the rotation, and the norms (sequence-parallel over the heads) follow it."""
    if "xq = maybe_to_local(self.q_norm(xq))" not in text or "xq, xk = maybe_to_local(xq), maybe_to_local(xk)" in text:
        return text  # no per-head QK norm to move, or moved already
    for statement in QK_NORM_STATEMENTS:
        text = replace_in_function(text, "Attention", "forward", statement, "")
    return replace_in_function(
        text,
        "Attention",
        "forward",
        ROPE_CALL,
        "xq, xk = maybe_to_local(xq), maybe_to_local(xk)\n"
        f"{ROPE_CALL}\n"
        "# The per-head QK norm comes after RoPE.\n"
        "xq = maybe_to_local(self.q_norm(xq))\n"
        "xk = maybe_to_local(self.k_norm(xk))\n",
    )


QK_NORM_ON_ROPE_LAYERS = "# The layers without RoPE normalise neither queries nor keys."


def _qk_norm_on_rope_layers(text: Document, ctx: EditContext) -> Document:
    """The per-head QK norm applied on the layers that apply RoPE only (Llama 4; the norm is
    weightless, so every layer may hold it). A NoPE layer's q and k are taken local as the norm
    would have left them under tensor parallelism."""
    if QK_NORM_ON_ROPE_LAYERS in text:
        return text
    guarded = f"{QK_NORM_ON_ROPE_LAYERS}\nif self.use_rope:\n    " + "\n    ".join(QK_NORM_STATEMENTS) + "\n"
    if not ctx.profile.qk_norm_after_rope:  # before RoPE, nothing has taken them local yet
        guarded += "else:\n    xq, xk = maybe_to_local(xq), maybe_to_local(xk)\n"
    text = replace_in_function(text, "Attention", "forward", QK_NORM_STATEMENTS[1], "")
    return replace_in_function(text, "Attention", "forward", QK_NORM_STATEMENTS[0], guarded)


def _query_position_scale(text: Document, ctx: EditContext) -> Document:
    """Queries scaled by their position after RoPE (``query_position_scale``), with the
    constants the config sets (``query_scale_beta``, ``query_scale_period``)."""
    if "self.query_scale_beta =" in text:
        return text
    text = insert_before_class(text, "Attention", snippet("attention", "query_position_scale"))
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.wo",
        "# Queries past query_scale_period positions are sharpened (long-context temperature).\n"
        "self.query_scale_beta = model_args.query_scale_beta\n"
        "self.query_scale_period = model_args.query_scale_period\n",
    )
    scale = ctx.profile.query_position_scale
    assert scale is not None
    where = f"positions + {scale.offset}" if scale.offset else "positions"
    scaled = f"xq = xq * query_position_scale({where}, self.query_scale_beta, self.query_scale_period).to(xq.dtype)\n"
    if scale.nope_layers_only:
        # Llama 4's attention temperature: the layers without RoPE sharpen their queries.
        scaled = "if not self.use_rope:\n    " + scaled
    return replace_in_function(text, "Attention", "forward", ROPE_CALL, f"{ROPE_CALL}\n{scaled}")


# What the first statement of every reference's Attention.forward assigns (``bs, seqlen, _ =
# x.shape``): the chunks are cut right after it.
FORWARD_SHAPES = "bs, seqlen, _"


def _chunked_attention(text: Document, ctx: EditContext) -> Document:
    """Chunked local attention: each document cut into chunks of ``attention_chunk_size`` (the
    config's field) tokens before the kernel runs, so that every chunk is a document to it; on
    every layer, or on those whose ``layer_types`` entry is the measured kind."""
    chunked = ctx.profile.chunked_attention
    assert chunked is not None
    if "self.attention_chunk_size =" in text:
        return text
    text = insert_before_class(text, "Attention", snippet("attention", "chunk_documents"))
    size = f"model_args.{chunked.size_field}"
    if chunked.chunked_kind is None:
        chunk, comment = size, "Every layer attends inside chunks of its document (chunked local attention)."
    else:
        text = add_parameter(text, "Attention", "__init__", "attention_chunk_size: int | None = None")
        text = set_call_kwarg(
            text,
            "Attention",
            "attention_chunk_size",
            f'{size} if model_args.layer_types[layer_id] == "{chunked.chunked_kind}" else None',
            target="self.attention",
        )
        chunk, comment = "attention_chunk_size", "Attention inside chunks of each document on this layer, if set."
    text = insert_after_statement_assigning(
        text, "Attention", "__init__", "self.scaling", f"# {comment}\nself.attention_chunk_size = {chunk}\n"
    )
    cut = "cu_seqlens, max_seqlen = chunk_documents(cu_seqlens, max_seqlen, self.attention_chunk_size)\n"
    if chunked.chunked_kind is not None:
        cut = "if self.attention_chunk_size is not None:\n    " + cut
    return insert_after_statement_assigning(
        text, "Attention", "forward", FORWARD_SHAPES, "# Each chunk is a document to the kernel.\n" + cut
    )


def _nope_layers(text: Document, ctx: EditContext) -> Document:
    """RoPE left out on the layers ``model_args.nope_layers`` names (read from the config)."""
    if "self.use_rope = use_rope" in text:
        return text
    text = add_parameter(text, "Attention", "__init__", "use_rope: bool = True")
    text = insert_after_statement_assigning(
        text,
        "Attention",
        "__init__",
        "self.scaling",
        "# A NoPE layer (use_rope=False) rotates neither queries nor keys.\nself.use_rope = use_rope\n",
    )
    text = replace_in_function(text, "Attention", "forward", ROPE_CALL, f"if self.use_rope:\n    {ROPE_CALL}\n")
    return set_call_kwarg(
        text, "Attention", "use_rope", "layer_id not in model_args.nope_layers", target="self.attention"
    )


REGISTER_ROPE = 'self.register_buffer("rope_cache", self._precompute_rope_cache(), persistent=False)'
LAYER_LOOP = """for layer in self.layers.values():
    h = layer(h, self.rope_cache, positions, cu_seqlens, max_seqlen)
"""


def _per_layer_rope(text: Document, ctx: EditContext) -> Document:
    """Two RoPE caches, one per layer type: full-attention layers rotate with ``rope_theta``
    (and ``rope_freq_scaling``, over ``rotary_dim``), sliding-window layers with their own
    ``sliding_*`` ones; each layer gets the cache of its ``layer_types`` entry. A cache is as
    wide as the features it rotates (the partial-rotary ``apply_rotary_emb`` reads it)."""
    if "sliding_rope_cache" in text:
        return text
    plan = ctx.profile
    width = "args.rotary_dim" if plan.partial_rotary else "args.head_dim"
    sliding_width = "args.sliding_rotary_dim" if plan.layer_rotary_dims else width
    full, sliding = ("", "")
    if plan.rope_type != "default":
        full, sliding = ", args.rope_freq_scaling", ", args.sliding_rope_freq_scaling"
    text = replace_function(
        text,
        ctx.model_class,
        "_precompute_rope_cache",
        f'''def _precompute_rope_cache(self, layer_type: str = "full_attention") -> torch.Tensor:
    """The RoPE cache of one layer type: sliding-window layers have their own parameters."""
    args = self.model_args
    if layer_type == "sliding_attention":
        return precompute_rope_cache({sliding_width}, args.max_seq_len, args.sliding_rope_theta{sliding})
    return precompute_rope_cache({width}, args.max_seq_len, args.rope_theta{full})
''',
    )
    text = replace_in_function(
        text,
        ctx.model_class,
        "__init__",
        REGISTER_ROPE,
        f"{REGISTER_ROPE}\n"
        'self.register_buffer("sliding_rope_cache", self._precompute_rope_cache("sliding_attention"), '
        "persistent=False)\n",
    )
    text = replace_in_function(
        text,
        ctx.model_class,
        "init_buffers",
        "self.rope_cache = self._precompute_rope_cache()",
        "self.rope_cache = self._precompute_rope_cache()\n"
        'self.sliding_rope_cache = self._precompute_rope_cache("sliding_attention")\n',
    )
    return replace_in_function(
        text,
        ctx.model_class,
        "forward",
        LAYER_LOOP,
        """for layer_id, layer in self.layers.items():
    # Each layer rotates with the RoPE parameters of its layer type.
    sliding = self.model_args.layer_types[int(layer_id)] == "sliding_attention"
    rope_cache = self.sliding_rope_cache if sliding else self.rope_cache
    h = layer(h, rope_cache, positions, cu_seqlens, max_seqlen)
""",
    )


# --- norms ------------------------------------------------------------------------------


def _norm_offset(text: Document, ctx: EditContext) -> Document:
    """Norms scaled by ``1 + weight``: the RMS kind keeps the name ``RMSNorm``; the centred
    kind (LayerNorm1P) becomes ``LayerNorm``, with a bias."""
    if ctx.profile.norm == "layernorm_offset":
        if "class RMSNorm" not in text:
            return text
        text = replace_class(text, "RMSNorm", snippet("norms", "OffsetLayerNorm", rename="LayerNorm"))
        text = remove_from_all(text, ["RMSNorm"])
        return replace_name(text, "RMSNorm", "LayerNorm")
    return replace_class(text, "RMSNorm", snippet("norms", "OffsetRMSNorm", rename="RMSNorm"))


def _weightless_norm(text: Document, ctx: EditContext) -> Document:
    """RMS norms with no learned weight (a weightless LayerNorm is the layer_norm edit's)."""
    return replace_class(text, "RMSNorm", snippet("norms", "WeightlessRMSNorm", rename="RMSNorm"))


# nn.LayerNorm's keywords for each LayerNorm variant the layer_norm edit writes.
LAYER_NORM_KWARGS = {
    "layernorm": {},
    "layernorm_no_bias": {"bias": "False"},
    "layernorm_weightless": {"elementwise_affine": "False"},
}


def _layer_norm(text: Document, ctx: EditContext) -> Document:
    """torch's ``nn.LayerNorm`` in place of every RMSNorm: with bias, without (``bias=False``),
    or with neither weight nor bias (``elementwise_affine=False``)."""
    if "class RMSNorm" in text:
        text = remove_class(text, "RMSNorm")
        text = remove_from_all(text, ["RMSNorm"])
        text = replace_name(text, "RMSNorm", "nn.LayerNorm")
    for kwarg, value in LAYER_NORM_KWARGS[ctx.profile.norm].items():
        text = set_call_kwarg(text, "nn.LayerNorm", kwarg, value)
    return text


# The QK norm's own class for each kind it computes (snippets/norms.py), where the block
# norms' class will not do: written in means so that a full-width norm reduces over the
# features tensor parallelism shards. Two RMS kinds reuse the block norms' snippets, renamed.
QK_NORM_CLASSES: dict[str, tuple[str, str]] = {
    # variant -> (class in the package, snippet it is copied from)
    "rms": ("QKRMSNorm", "QKRMSNorm"),
    "rms_weightless": ("QKWeightlessRMSNorm", "WeightlessRMSNorm"),
    "rms_offset": ("QKOffsetRMSNorm", "OffsetRMSNorm"),
    "layernorm": ("QKLayerNorm", "QKLayerNorm"),
    "layernorm_no_bias": ("QKLayerNormNoBias", "QKLayerNormNoBias"),
    "layernorm_weightless": ("QKWeightlessLayerNorm", "QKWeightlessLayerNorm"),
    "layernorm_offset": ("QKOffsetLayerNorm", "QKOffsetLayerNorm"),
}
QK_NORM_WIDTHS = {
    "per_head": ("self.head_dim", "self.head_dim"),
    "full": ("self.n_heads * self.head_dim", "self.n_kv_heads * self.head_dim"),
}


def _qk_norm_kind(text: Document, ctx: EditContext) -> Document:
    """``q_norm``/``k_norm`` built with a class of their own kind (``qk_norm_variant``), where
    the block norms compute another one or cannot reduce over a sharded full width. Runs
    after the block norms' edits, which rename their class (the QK norms' with it)."""
    variant, width = ctx.profile.qk_norm_variant, ctx.profile.qk_norm
    assert variant is not None and width != "none"
    name, source = QK_NORM_CLASSES[variant]
    if f"class {name}(" not in text:
        if "LayerNorm" in name and "def centred(" not in text:
            text = insert_before_class(text, "Attention", snippet("norms", "centred"))
        text = insert_before_class(text, "Attention", snippet("norms", source, rename=name))
    for target, size in zip(("self.q_norm", "self.k_norm"), QK_NORM_WIDTHS[width], strict=True):
        text = replace_statement_assigning(
            text, "Attention", "__init__", target, f"{target} = {name}({size}, eps=model_args.norm_eps)\n"
        )
    return text


# --- MLP --------------------------------------------------------------------------------


def _activation_name(plan: PortPlan) -> str:
    return ACTIVATIONS[plan.activation].title


def _activation(text: Document, ctx: EditContext) -> Document:
    """The feed-forward's activation (an entry of the one table, ``skill.activations``),
    whatever MLP shape the other edits chose; a helper the call needs is copied in
    before ``FeedForward``."""
    entry = ACTIVATIONS[ctx.profile.activation]
    helper = entry.snippet
    if helper is not None and f"def {helper}(" not in text and f"class {helper}(" not in text:
        text = insert_before_class(text, "FeedForward", snippet("activations", helper))
    if entry.module and "self.act_fn =" not in text:
        # A learned activation: a module of the feed-forward, its parameters checkpoint keys.
        text = insert_after_statement_assigning(
            text, "FeedForward", "__init__", "self.w2", f"self.act_fn = {helper}()\n"
        )
        text = replace_in_function(
            text,
            "FeedForward",
            "init_weights",
            "nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)",
            "nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)\nself.act_fn.reset_parameters()\n",
        )
    text = replace_call(text, "FeedForward", "forward", "F.silu", entry.call)
    gated = "self.w3" in class_code(text, "FeedForward")
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


def _plain_mlp(text: Document, ctx: EditContext) -> Document:
    return replace_class(text, "FeedForward", snippet("mlp", "PlainFeedForward", rename="FeedForward"))


def _mlp_bias(text: Document, ctx: EditContext) -> Document:
    for target in ("self.w1", "self.w2", "self.w3"):
        if f"{target} = nn.Linear(" in class_code(text, "FeedForward"):
            text = set_call_kwarg(text, "nn.Linear", "bias", "True", target=target)
    return text


FEED_FORWARD = "self.feed_forward = FeedForward(model_args.dim, model_args.hidden_dim)"
# The block's pre-attention norm as the norm edits left it: its class and keywords.
BLOCK_NORM = re.compile(r"self\.attention_norm = (?P<cls>[\w.]+)\(model_args\.dim, (?P<kwargs>[^)]*)\)")


def _block_norm_call(text: Document, width: str, eps: str) -> str:
    """A norm built as the block's ``attention_norm`` is (what the norm-kind edits made of it),
    over ``width`` with epsilon ``eps``."""
    found = BLOCK_NORM.search(class_code(text, "TransformerBlock"))
    if found is None:
        raise CodemodError("TransformerBlock.__init__ builds no attention_norm over model_args.dim")
    return f"{found['cls']}({width}, {found['kwargs'].replace('model_args.norm_eps', eps)})"


def _ffn_sub_norm(text: Document, ctx: EditContext) -> Document:
    """A norm of the block norms' class over the hidden width on the input of ``w2``,
    innermost: ``w2`` reads the norm's output (BitNet's ffn_sub_norm). The feed-forward takes
    the norm's epsilon from the block. It runs after the norm-kind edits and the MLP's own
    (plain_mlp rewrites the class), so it builds the norm as the block's norms are built."""
    if "self.sub_norm" in class_code(text, "FeedForward"):
        return text
    text = add_parameter(text, "FeedForward", "__init__", "norm_eps: float")
    text = insert_after_statement_assigning(
        text,
        "FeedForward",
        "__init__",
        "self.w2",
        "# The hidden state is normalised over its full width before w2.\n"
        f"self.sub_norm = {_block_norm_call(text, 'hidden_dim', 'norm_eps')}\n",
    )
    text = replace_in_function(
        text,
        "FeedForward",
        "init_weights",
        "nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)",
        "nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)\nself.sub_norm.reset_parameters()\n",
    )
    text = replace_in_function(
        text,
        "TransformerBlock",
        "__init__",
        FEED_FORWARD,
        FEED_FORWARD.replace("model_args.hidden_dim)", "model_args.hidden_dim, model_args.norm_eps)"),
    )
    return replace_call(text, "FeedForward", "forward", "self.w2", "self.w2(self.sub_norm({}))")


# --- block and model scalars ------------------------------------------------------------

EMBED = "h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens"


def _trained_pad_row(text: Document, ctx: EditContext) -> Document:
    """The token embedding without ``padding_idx``: the family's HF embedding trains every
    row it looks up (the references freeze the ``pad_token_id`` row, as HF's Qwen and
    DeepSeek embeddings do)."""
    return remove_call_kwarg(text, "nn.Embedding", "padding_idx", target="self.tok_embeddings")


def _embedding_sqrt_dim(text: Document, ctx: EditContext) -> Document:
    if "h * torch.tensor(self.model_args.dim**0.5" in text:
        return text  # applied (later embedding edits may have added to the stage since)
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


# Line length of the generated code (pyproject's [tool.ruff]) and the forward's body indent.
LINE_LENGTH, FORWARD_INDENT = 120, 8


def _embedding_multiplier(text: Document, ctx: EditContext) -> Document:
    field = ctx.profile.embedding_scale_field
    scaled = f"self.tok_embeddings(tokens) * self.model_args.{field}"
    if scaled in text or f"h = h * self.model_args.{field}" in text:
        return text  # applied (later embedding edits may have added to the stage since)
    ternary = f"h = {scaled} if self.tok_embeddings is not None else tokens"
    if FORWARD_INDENT + len(ternary) <= LINE_LENGTH:
        # An if/else of one assignment each that fits on one line is a lint finding
        # (SIM108); the stage stays a block that later embedding edits extend.
        body = f"    h = self.tok_embeddings(tokens)\n    h = h * self.model_args.{field}\n"
    else:
        body = f"    h = {scaled}\n"
    return replace_in_function(
        text, ctx.model_class, "forward", EMBED, f"if self.tok_embeddings is not None:\n{body}else:\n    h = tokens\n"
    )


def _residual_multiplier(text: Document, ctx: EditContext) -> Document:
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


def _logits_scaling(text: Document, ctx: EditContext) -> Document:
    field = ctx.profile.logit_divisor_field
    return _transform_logits(
        text, ctx, f"# The LM head's logits are divided by {field}.\nlogits = logits / self.model_args.{field}\n"
    )


def _logits_multiplier(text: Document, ctx: EditContext) -> Document:
    field = ctx.profile.logit_multiplier_field
    return _transform_logits(
        text, ctx, f"# The LM head's logits are multiplied by {field}.\nlogits = logits * self.model_args.{field}\n"
    )


def _all_layers_moe(text: Document, ctx: EditContext) -> Document:
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
    if ctx.profile.has_shared_experts and ctx.profile.activation != "silu":
        return text  # FeedForward stays: the shared experts' MLP with the family's activation
    text = remove_class(text, "FeedForward")
    text = remove_from_all(text, ["FeedForward"])
    return text


MLP_SWITCH = "mlp = self.moe if self.moe_enabled else self.feed_forward"


def _dense_layers(text: Document, ctx: EditContext) -> Document:
    """Every layer a dense feed-forward: no MoE, no per-layer switch, no MoE buffers."""
    for statement in (
        "self.moe_enabled = model_args.is_moe_layer(layer_id)",
        "self.moe: MoE | None = None",
        "self.feed_forward: FeedForward | None = None",
    ):
        text = replace_in_function(text, "TransformerBlock", "__init__", statement, "")
    text = _replace_moe_switch(text)
    for func in ("forward", "init_weights"):
        text = replace_in_function(text, "TransformerBlock", func, MLP_SWITCH, "")
    text = replace_call(text, "TransformerBlock", "forward", "mlp", "self.feed_forward({})")
    text = replace_in_function(
        text,
        "TransformerBlock",
        "init_weights",
        "mlp.init_weights(self.weight_init_std)",
        "self.feed_forward.init_weights(self.weight_init_std)",
    )
    text = _remove_correction_bias_moe(text)
    if has_method(text, "TransformerBlock", "init_buffers"):
        text = remove_method(text, "TransformerBlock", "init_buffers")
        text = replace_in_function(
            text,
            ctx.model_class,
            "init_buffers",
            "for layer in self.layers.values():\n    layer.init_buffers(buffer_device)",
            "",
        )
    return text


def _replace_moe_switch(text: Document) -> Document:
    """The block's ``if self.moe_enabled: <MoE> else: <dense>`` becomes its dense branch."""
    return keep_else_branch(text, "TransformerBlock", "__init__", "self.moe_enabled")


def _sparse_mixer_router(text: Document, ctx: EditContext) -> Document:
    """The MoE's router picks two experts one after the other (sparse mixer) instead of a top-k."""
    field = ctx.profile.router_jitter_field
    text = insert_before_class(text, "TransformerBlock", snippet("router", "SparseMixerRouter"))
    text = ensure_import_line(text, "from archon_models.moe import TokenChoiceTopKRouter")
    return insert_after_statement_assigning(
        text,
        "TransformerBlock",
        "__init__",
        "self.moe",
        "# Sparse-mixer routing: the best expert, then the best of the others.\n"
        "self.moe.router = SparseMixerRouter(\n"
        "    model_args.dim,\n"
        "    model_args.moe_args.num_experts,\n"
        "    model_args.moe_args.top_k,\n"
        f"    jitter_eps=model_args.{field},\n"
        "    router_dtype=model_args.moe_args.router_dtype,\n"
        ")\n",
    )


# The statement of the block's __init__ that builds the MoE, on both references.
_BUILD_MOE = "self.moe = MoE(model_args.moe_args, dim=model_args.dim, hidden_dim=model_args.moe_inter_dim)"


def _max_group_router(text: Document, ctx: EditContext) -> Document:
    """The MoE's router scores an expert group by its best expert, not AReaL's sum of its two best."""
    if "class MaxGroupTopKRouter(" not in text:
        text = insert_before_class(text, "TransformerBlock", snippet("router", "MaxGroupTopKRouter"))
    text = ensure_import_line(text, "from archon_models.moe import TokenChoiceTopKRouter")
    text = ensure_import_line(text, "import torch.nn.functional as F")
    if "self.moe.router = " in text:
        return text
    # After the block builds its MoE, wherever that is (under the reference's MoE-layer switch).
    return replace_in_function(
        text,
        "TransformerBlock",
        "__init__",
        _BUILD_MOE,
        f"{_BUILD_MOE}\n"
        "# Grouped top-k keeps the groups whose best expert scores highest.\n"
        "moe_args = model_args.moe_args\n"
        "self.moe.router = MaxGroupTopKRouter(\n"
        "    model_args.dim,\n"
        "    moe_args.num_experts,\n"
        "    moe_args.top_k,\n"
        "    score_func=moe_args.score_func,\n"
        "    route_norm=moe_args.route_norm,\n"
        "    route_scale=moe_args.route_scale,\n"
        "    router_dtype=moe_args.router_dtype,\n"
        "    num_expert_groups=moe_args.num_expert_groups,\n"
        "    num_limited_groups=moe_args.num_limited_groups,\n"
        ")\n",
    )


# The statement building an MoE whose router is shifted by the checkpoint's score-correction
# bias (the deepseek_v3 reference's, and what the correction_bias edit makes of _BUILD_MOE).
_BUILD_MOE_WITH_BIAS = _BUILD_MOE.replace("= MoE(", "= CorrectionBiasMoE(", 1)
CORRECTION_BIAS_MOE = "CorrectionBiasMoE"


def _remove_correction_bias_moe(text: Document) -> Document:
    text = remove_class(text, CORRECTION_BIAS_MOE)
    return remove_from_all(text, [CORRECTION_BIAS_MOE])


def _no_correction_bias(text: Document, ctx: EditContext) -> Document:
    """No score-correction bias: the block builds AReaL's MoE, whose only bias buffer is the
    one it makes in ``init_buffers`` when balancing."""
    text = replace_in_function(text, "TransformerBlock", "__init__", _BUILD_MOE_WITH_BIAS, _BUILD_MOE)
    return _remove_correction_bias_moe(text)


def _correction_bias(text: Document, ctx: EditContext) -> Document:
    """The router adds the checkpoint's score-correction bias to what chooses experts: the
    package's ``CorrectionBiasMoE`` holds it as a saved fp32 ``expert_bias`` from construction
    on and keeps it through ``init_buffers`` (AReaL's MoE makes that buffer only in
    ``init_buffers``, as zeros, and only when ``load_balance_coeff`` switches on balancing)."""
    if f"class {CORRECTION_BIAS_MOE}(" not in text:
        text = insert_before_class(text, "TransformerBlock", snippet("moe", CORRECTION_BIAS_MOE))
    for line in ("from collections.abc import Callable", "from archon_models.moe import MoEArgs"):
        text = ensure_import_line(text, line)
    return replace_in_function(text, "TransformerBlock", "__init__", _BUILD_MOE, _BUILD_MOE_WITH_BIAS)


def _logit_selection_bias(text: Document, ctx: EditContext) -> Document:
    """The MoE's selection bias joins the gate logits before the score function (the package's
    ``LogitBiasRouter``), not the scores as AReaL's ``expert_bias`` does."""
    if "self.moe.router = SparseMixerRouter(" in text:
        raise ValueError("a selection bias on the logits and sparse-mixer routing are two routers: apply one")
    if "class LogitBiasRouter(" not in text:
        text = insert_before_class(text, "TransformerBlock", snippet("router", "LogitBiasRouter"))
    text = ensure_import_line(text, "import torch.nn.functional as F")
    text = ensure_import_line(text, "from archon_models.moe import TokenChoiceTopKRouter")
    if "self.moe.router = LogitBiasRouter(" in text:
        return text
    return insert_after_statement_assigning(
        text,
        "TransformerBlock",
        "__init__",
        "self.moe",
        "# The selection bias joins the logits before the score function picks experts.\n"
        "self.moe.router = LogitBiasRouter(\n"
        "    model_args.dim,\n"
        "    model_args.moe_args.num_experts,\n"
        "    model_args.moe_args.top_k,\n"
        "    score_func=model_args.moe_args.score_func,\n"
        "    route_norm=model_args.moe_args.route_norm,\n"
        "    route_scale=model_args.moe_args.route_scale,\n"
        "    router_dtype=model_args.moe_args.router_dtype,\n"
        ")\n",
    )


EXPERTS_IMPORTS = (
    "import math",
    "import torch.nn.functional as F",
    "from torch.distributed.tensor import DTensor, Partial, Shard",
    "from archon_models.moe import GroupedExperts",
    "from archon_models.moe.utils import indices_padding_wrapper",
)


def _expert_bias(text: Document, ctx: EditContext) -> Document:
    """The MoE's routed experts get gate, up and down biases (``w1_bias``, ``w3_bias``,
    ``w2_bias``): the package's own experts class, replacing AReaL's ``GroupedExperts``."""
    if "class BiasedGroupedExperts(" not in text:
        text = insert_before_class(text, "TransformerBlock", snippet("experts", "_expert_sharded"))
        text = insert_before_class(text, "TransformerBlock", snippet("experts", "BiasedGroupedExperts"))
    for line in EXPERTS_IMPORTS:
        text = ensure_import_line(text, line)
    if "self.moe.experts = " in text:
        return text
    return insert_after_statement_assigning(
        text,
        "TransformerBlock",
        "__init__",
        "self.moe",
        "# The routed experts' projections have biases.\n"
        "self.moe.experts = BiasedGroupedExperts(\n"
        "    model_args.dim,\n"
        "    model_args.moe_inter_dim,\n"
        "    model_args.moe_args.num_experts,\n"
        "    use_grouped_mm=model_args.moe_args.use_grouped_mm,\n"
        ")\n",
    )


MOE_CONSTRUCTION = "self.moe = MoE(model_args.moe_args, dim=model_args.dim, hidden_dim=model_args.moe_inter_dim)"


def _expert_activation(text: Document, ctx: EditContext) -> Document:
    """The MoE's experts activate as the analysis measured (not SwiGLU's SiLU): the routed
    experts are the package's :class:`ActivatedGroupedExperts` (or, with biases,
    ``BiasedGroupedExperts`` activating so), the shared experts the package's ``FeedForward``,
    which the activation edit writes; both replace what AReaL's ``MoE`` builds."""
    entry = ACTIVATIONS[ctx.profile.activation]
    helper = entry.snippet
    if helper is not None and f"def {helper}(" not in text:
        text = insert_before_class(text, "TransformerBlock", snippet("activations", helper))
    title = _activation_name(ctx.profile)
    if "class BiasedGroupedExperts(" in text:
        text = replace_call(text, "BiasedGroupedExperts", "_activate", "F.silu", entry.call)
        text = replace_text(text, '"""SwiGLU: ``silu(gate) * up``."""', f'"""{title}: ``act(gate) * up``."""')
        routed = ""
    else:
        if "class ActivatedGroupedExperts(" not in text:
            if "def _expert_sharded(" not in text:
                text = insert_before_class(text, "TransformerBlock", snippet("experts", "_expert_sharded"))
            text = insert_before_class(text, "TransformerBlock", snippet("experts", "ActivatedGroupedExperts"))
        text = replace_call(text, "ActivatedGroupedExperts", "_activate", "F.silu", entry.call)
        for line in EXPERTS_IMPORTS:
            if line != "import math" and not line.startswith("from torch.distributed.tensor"):
                text = ensure_import_line(text, line)
        text = ensure_import_line(text, "from torch.distributed.tensor import DTensor, Shard")
        routed = (
            f"# The routed experts activate by the {title}.\n"
            "self.moe.experts = ActivatedGroupedExperts(\n"
            "    model_args.dim,\n"
            "    model_args.moe_inter_dim,\n"
            "    model_args.moe_args.num_experts,\n"
            "    use_grouped_mm=model_args.moe_args.use_grouped_mm,\n"
            ")\n"
        )
    shared = (
        f"# The shared experts too: the package's FeedForward ({title}), as wide as MoE built them.\n"
        "self.moe.shared_experts = FeedForward(model_args.dim, self.moe.shared_experts.w1.out_features)\n"
        if ctx.profile.has_shared_experts
        else ""
    )
    if not routed and not shared:
        return text
    return replace_in_function(
        text, "TransformerBlock", "__init__", MOE_CONSTRUCTION, MOE_CONSTRUCTION + "\n" + routed + shared
    )


def _clamped_swiglu_experts(text: Document, ctx: EditContext) -> Document:
    """The routed experts activate by the clamped SwiGLU with the config's alpha and limit:
    the biased experts' subclass, or without biases the activated experts' one; shared
    experts too, as the package's ``FeedForward`` activating so, as wide as MoE built them."""
    fields = ctx.profile.expert_activation_fields
    constants = f"    alpha=model_args.{fields['alpha']},\n    limit=model_args.{fields['limit']},\n"
    if "class BiasedGroupedExperts(" in text:
        if "class ClampedSwiGLUExperts(" not in text:
            text = insert_before_class(text, "TransformerBlock", snippet("experts", "clamped_swiglu"))
            text = insert_before_class(text, "TransformerBlock", snippet("experts", "ClampedSwiGLUExperts"))
        text = replace_text(
            text,
            "# The routed experts' projections have biases.\n",
            "# The routed experts' projections have biases; they activate by the clamped SwiGLU.\n",
        )
        text = replace_statement_assigning(
            text,
            "TransformerBlock",
            "__init__",
            "self.moe.experts",
            "self.moe.experts = ClampedSwiGLUExperts(\n"
            "    model_args.dim,\n"
            "    model_args.moe_inter_dim,\n"
            "    model_args.moe_args.num_experts,\n"
            f"{constants}"
            "    use_grouped_mm=model_args.moe_args.use_grouped_mm,\n"
            ")\n",
        )
        routed = ""
    else:
        if "class ActivatedGroupedExperts(" not in text:
            if "def _expert_sharded(" not in text:
                text = insert_before_class(text, "TransformerBlock", snippet("experts", "_expert_sharded"))
            text = insert_before_class(text, "TransformerBlock", snippet("experts", "ActivatedGroupedExperts"))
        if "def clamped_swiglu(" not in text:
            text = insert_before_class(text, "TransformerBlock", snippet("experts", "clamped_swiglu"))
        if "class ClampedSwiGLUGroupedExperts(" not in text:
            text = insert_before_class(text, "TransformerBlock", snippet("experts", "ClampedSwiGLUGroupedExperts"))
        for line in EXPERTS_IMPORTS:
            if line != "import math" and not line.startswith("from torch.distributed.tensor"):
                text = ensure_import_line(text, line)
        text = ensure_import_line(text, "from torch.distributed.tensor import DTensor, Shard")
        routed = (
            "# The routed experts activate by the clamped SwiGLU.\n"
            "self.moe.experts = ClampedSwiGLUGroupedExperts(\n"
            "    model_args.dim,\n"
            "    model_args.moe_inter_dim,\n"
            "    model_args.moe_args.num_experts,\n"
            f"{constants}"
            "    use_grouped_mm=model_args.moe_args.use_grouped_mm,\n"
            ")\n"
        )
    shared = ""
    if ctx.profile.has_shared_experts:
        if "class ClampedSwiGLUFeedForward(" not in text:
            text = insert_before_class(text, "TransformerBlock", snippet("experts", "ClampedSwiGLUFeedForward"))
        shared = (
            "# The shared experts too: the package's FeedForward activating by the clamped SwiGLU.\n"
            "self.moe.shared_experts = ClampedSwiGLUFeedForward(\n"
            "    model_args.dim,\n"
            "    self.moe.shared_experts.w1.out_features,\n"
            f"{constants}"
            ")\n"
        )
    if not routed and not shared:
        return text
    if "self.moe.shared_experts = ClampedSwiGLUFeedForward(" in text or "= ClampedSwiGLUGroupedExperts(\n" in text:
        return text
    return replace_in_function(
        text, "TransformerBlock", "__init__", MOE_CONSTRUCTION, MOE_CONSTRUCTION + "\n" + routed + shared
    )


def _router_bias(text: Document, ctx: EditContext) -> Document:
    """The router's gate has a bias: it joins the logits before scoring and top-k, whatever
    router picks the experts. Zero at init, as the other biases."""
    if "class BiasedRouterGate(" not in text:
        text = insert_before_class(text, "TransformerBlock", snippet("router", "BiasedRouterGate"))
    text = ensure_import_line(text, "import torch.nn.functional as F")
    if "self.moe.router.gate = " not in text:
        # On the router the block ends up with: after one an earlier edit put in (sparse mixer).
        anchor = "self.moe.router" if "self.moe.router = " in text else "self.moe"
        text = insert_after_construction(
            text,
            "TransformerBlock",
            "__init__",
            anchor,
            "# The router's logits have a bias.\n"
            "self.moe.router.gate = BiasedRouterGate(\n"
            "    model_args.dim, model_args.moe_args.num_experts, router_dtype=model_args.moe_args.router_dtype\n"
            ")\n",
        )
    if "nn.init.zeros_(self.moe.router.gate.bias)" in text:
        return text
    init = (
        "self.moe.init_weights(self.weight_init_std)"
        if "self.moe.init_weights(self.weight_init_std)" in text
        else "mlp.init_weights(self.weight_init_std)"
    )
    zero = (
        "nn.init.zeros_(self.moe.router.gate.bias)"
        if init.startswith("self.moe")
        else "if self.moe is not None:\n    nn.init.zeros_(self.moe.router.gate.bias)"
    )
    return replace_in_function(text, "TransformerBlock", "init_weights", init, f"{init}\n{zero}\n")


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
        "per_head_qk_norm",
        "per-head RMSNorm of q and k (the qwen2 reference has none)",
        lambda p: p.qk_norm == "per_head",
        _per_head_qk_norm,
        needed=lambda text: "self.q_norm" not in text,
    ),
    ModelEdit(
        "remove_rope",
        "no rotary embedding: no RoPE cache, no rotation",
        lambda p: p.positions != "rope",
        _remove_rope,
        needed=lambda text: "apply_rotary_emb(" in text,
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
        "latent_norm_eps",
        "MLA latent norms at the config's norm epsilon",
        lambda p: p.latent_norm_eps_from_config,
        _latent_norm_eps,
        needed=lambda text: "LATENT_NORM_EPS" in text,
    ),
    ModelEdit(
        "sparse_indexer",
        "DeepSeek Sparse Attention: an indexer's top-k keys per query mask the MLA scores",
        lambda p: p.indexer is not None,
        _sparse_indexer,
    ),
    ModelEdit(
        "clip_qkv",
        "q/k/v projections clamped to [-clip_qkv, clip_qkv]",
        lambda p: p.clip_qkv_field is not None,
        _clip_qkv,
    ),
    ModelEdit(
        "sliding_window",
        "sliding-window attention inside each document",
        lambda p: (
            p.sliding_window
            and not p.sliding_layer_types
            and not p.attn_softcap
            and not p.attn_sinks
            and p.positions != "alibi"
        ),
        _sliding_window,
    ),
    ModelEdit(
        "eager_attention",
        "explicit attention for soft-capped scores and/or a per-layer sliding window",
        lambda p: (p.attn_softcap or p.sliding_layer_types) and not p.attn_sinks and p.positions != "alibi",
        _eager_attention,
    ),
    ModelEdit(
        "attention_sinks",
        "a learned sink logit per head in every softmax (with the family's window and score soft-cap, if any)",
        lambda p: p.attn_sinks,
        _attention_sinks,
    ),
    ModelEdit(
        "output_gate",
        "attention output gated by a projection of the block input before wo",
        lambda p: p.output_gate is not None and not p.output_gate.endswith(IN_QUERY_SUFFIX),
        _output_gate,
    ),
    ModelEdit(
        "query_gate",
        "attention output gated before wo by the second half of each head's query rows",
        lambda p: p.output_gate is not None and p.output_gate.endswith(IN_QUERY_SUFFIX),
        _query_gate,
    ),
    ModelEdit(
        "last_layer_o_bias",
        "a bias on the last layer's output projection only",
        lambda p: p.o_bias_last_layer,
        _last_layer_o_bias,
    ),
    ModelEdit(
        "attention_sub_norm",
        "a norm over all heads on the attention output before wo",
        lambda p: p.attn_sub_norm,
        _attention_sub_norm,
    ),
    ModelEdit(
        "alibi_attention",
        "ALiBi: a fixed per-head linear bias on the scores by in-document distance",
        lambda p: p.positions == "alibi",
        _alibi_attention,
    ),
    ModelEdit(
        "differential_attention",
        "differential attention: head pairs over paired values, subtracted with a learned lambda",
        lambda p: p.differential_attention,
        _differential_attention,
    ),
    ModelEdit(
        "attention_scale",
        "attention scores scaled by a config field",
        lambda p: p.attn_scale is not None,
        _attention_scale,
    ),
    ModelEdit(
        "constant_attention_scale",
        "attention scores scaled by a constant no config field sets",
        lambda p: p.attn_scale is None and p.attn_scale_constant is not None,
        _constant_attention_scale,
    ),
    ModelEdit(
        "qk_norm_after_rope",
        "per-head QK norm applied after RoPE",
        lambda p: p.qk_norm_after_rope,
        _qk_norm_after_rope,
    ),
    ModelEdit(
        "chunked_attention",
        "attention inside fixed chunks of each document (on some layers, by their kind)",
        lambda p: p.chunked_attention is not None,
        _chunked_attention,
    ),
    ModelEdit(
        "query_position_scale",
        "queries scaled by their absolute position after RoPE",
        lambda p: p.query_position_scale is not None,
        _query_position_scale,
    ),
    ModelEdit(
        "nope_layers",
        "RoPE left out on the layers the config names",
        lambda p: p.nope_field is not None or p.nope_layer_type is not None,
        _nope_layers,
    ),
    ModelEdit(
        "qk_norm_on_rope_layers",
        "the per-head QK norm on the layers that apply RoPE only",
        lambda p: p.qk_norm_rope_layers_only,
        _qk_norm_on_rope_layers,
    ),
    ModelEdit(
        "rope_cache",
        "RoPE cache over the rotary part of each head and/or with scaled frequencies",
        lambda p: (p.partial_rotary or p.rope_type != "default") and not p.per_layer_rope,
        _rope_cache,
    ),
    ModelEdit(
        "per_layer_rope",
        "one RoPE cache per layer type (full and sliding attention)",
        lambda p: p.per_layer_rope,
        _per_layer_rope,
    ),
    ModelEdit(
        "reversed_rotation",
        "RoPE turning each pair the other way: (x1, x2) -> (x2, -x1), the RoPE cache's sine negated",
        lambda p: p.rotary_reversed,
        _reversed_rotation,
    ),
    ModelEdit(
        "moe_output_norm",
        "a norm on the MoE's output before the residual add (MoE layers only)",
        lambda p: p.moe_output_norm,
        _moe_output_norm,
    ),
    ModelEdit("post_norm", "norms after each sub-layer, none before", lambda p: p.block == "post_norm", _post_norm),
    ModelEdit(
        "sandwich_norm", "norms before and after each sub-layer", lambda p: p.block == "sandwich", _sandwich_norm
    ),
    ModelEdit("post_ln", "each residual sum normalised (post-LN)", lambda p: p.block == "post_ln", _post_ln),
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
    ModelEdit(
        "dense_layers",
        "every layer a dense feed-forward: no MoE",
        lambda p: not p.moe,
        _dense_layers,
        needed=lambda text: "self.moe_enabled = model_args.is_moe_layer(layer_id)" in text,
    ),
    ModelEdit(
        "sparse_mixer_router",
        "sparse-mixer routing (two successive masked-softmax picks)",
        lambda p: p.router_scoring == "sparsemixer",
        _sparse_mixer_router,
    ),
    ModelEdit(
        "no_correction_bias",
        "no score-correction bias: AReaL's MoE, no expert_bias built with the block",
        lambda p: p.moe and p.score_correction_key is None,
        _no_correction_bias,
        needed=lambda text: f"class {CORRECTION_BIAS_MOE}(" in text,
    ),
    ModelEdit(
        "max_group_router",
        "grouped top-k whose groups are scored by their best expert",
        lambda p: p.moe and p.group_scoring == "max",
        _max_group_router,
    ),
    ModelEdit(
        "logit_selection_bias",
        "the router's selection bias added to the logits before the score function",
        lambda p: p.logit_selection_bias,
        _logit_selection_bias,
    ),
    ModelEdit(
        "expert_bias",
        "biases on the routed experts' gate, up and down projections",
        lambda p: p.expert_bias,
        _expert_bias,
    ),
    ModelEdit(
        "clamped_swiglu_experts",
        "routed experts activated by the clamped SwiGLU (alpha, limit from the config)",
        lambda p: bool(p.expert_activation_fields),
        _clamped_swiglu_experts,
    ),
    ModelEdit(
        "expert_activation",
        "routed and shared experts activated otherwise than by SiLU",
        lambda p: p.moe and p.activation not in ("silu", "clamped_swiglu"),
        _expert_activation,
    ),
    ModelEdit(
        "router_bias",
        "a bias on the router's gate logits",
        lambda p: p.router_bias,
        _router_bias,
    ),
    ModelEdit(
        "correction_bias",
        "the checkpoint's score-correction bias, saved with the MoE, shifts which experts are chosen",
        lambda p: p.moe and p.score_correction_key is not None,
        _correction_bias,
        needed=lambda text: f"class {CORRECTION_BIAS_MOE}(" not in text,
    ),
    ModelEdit(
        "norm_offset",
        "RMSNorm or LayerNorm scaled by (1 + weight)",
        lambda p: p.norm in ("rms_offset", "layernorm_offset"),
        _norm_offset,
    ),
    ModelEdit(
        "weightless_norm", "RMSNorm with no learned weight", lambda p: p.norm == "rms_weightless", _weightless_norm
    ),
    ModelEdit(
        "layer_norm",
        "LayerNorm (with bias, without, or weightless) instead of RMSNorm",
        lambda p: p.norm in LAYER_NORM_KWARGS,
        _layer_norm,
    ),
    ModelEdit(
        "qk_norm_kind",
        "QK norms of their own kind, not the block norms'",
        lambda p: p.qk_norm_variant is not None,
        _qk_norm_kind,
    ),
    ModelEdit(
        "plain_mlp", "two-layer (non-gated) MLP", lambda p: p.mlp == "plain" and not p.all_layers_moe, _plain_mlp
    ),
    ModelEdit(
        "activation",
        "feed-forward activation other than SiLU",
        # With every layer MoE, FeedForward stays only as the shared experts' MLP; the clamped
        # SwiGLU (no table entry) is the experts' edit's, which subclasses FeedForward for them.
        lambda p: p.activation not in ("silu", "clamped_swiglu") and (not p.all_layers_moe or p.has_shared_experts),
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
        "ffn_sub_norm",
        "a norm over the hidden width on the feed-forward's hidden state before w2",
        lambda p: p.ffn_sub_norm and not p.all_layers_moe,
        _ffn_sub_norm,
        needed=lambda text: "class FeedForward" in text,
    ),
    ModelEdit(
        "trained_pad_row",
        "every embedding row trains (no padding_idx)",
        lambda p: p.padding_idx_field is None,
        _trained_pad_row,
        needed=lambda text: PADDING_IDX in text,
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
        "embedding_projection",
        "embeddings and LM head at the config's width, projected in and out where it is not dim",
        lambda p: p.embedding_projection_field is not None,
        _embedding_projection,
    ),
    ModelEdit(
        "no_final_norm",
        "no norm after the last block",
        lambda p: not p.final_norm,
        _no_final_norm,
        needed=lambda text: "self.norm: nn.Module | None = None" not in text,
    ),
    ModelEdit(
        "learned_positions",
        "learned absolute-position embeddings added to the token embeddings",
        lambda p: p.positions == "learned",
        _learned_positions,
    ),
    ModelEdit(
        "sinusoidal_positions",
        "a fixed sinusoidal position table added to the token embeddings",
        lambda p: p.positions == "sinusoidal",
        _sinusoidal_positions,
    ),
    ModelEdit(
        "embedding_norm",
        "a norm on the embeddings before the first block",
        lambda p: p.embedding_norm_module is not None,
        _embedding_norm,
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
    ModelEdit(
        "lm_head_bias",
        "a bias on the LM head (output projection)",
        lambda p: p.lm_head_bias,
        _lm_head_bias,
    ),
    ModelEdit("final_softcap", "logits soft-capped by tanh", lambda p: p.final_softcap, _final_softcap),
)

EDITS_BY_NAME = {edit.name: edit for edit in MODEL_EDITS}
# The edits written against the block, embedding and logits contract that the deepseek_v3
# reference shares, and those of its MoE's router (no_correction_bias, max_group_router); its MLA attention
# and RoPE take none (skill.features.MLA_SUPPORTED_EDITS).
MLA_MODEL_EDITS = (
    "latent_norm_eps",
    "sparse_indexer",
    "moe_output_norm",
    "residual_multiplier",
    "dense_layers",
    "no_correction_bias",
    "max_group_router",
    "embedding_multiplier",
    "logits_scaling",
    "logits_multiplier",
)


def edit_catalogue() -> str:
    """Every edit ``edit_model`` takes, ``name: what it writes``, in the canonical order (the
    feature modules' last): the one list the tool's ``edits`` field, hence
    ``archon-port edit-model --help``, shows."""
    return "; ".join(
        [f"{edit.name}: {edit.description}" for edit in MODEL_EDITS]
        + [f"{module.name}: {module.description}" for module in FEATURE_MODULES]
    )


def select_edits(profile: PortPlan, text: str) -> list[str]:
    """The edits the family's features call for, given the copied reference's ``model.py``.

    On deepseek_v3 only the edits of :data:`MLA_MODEL_EDITS` apply (the analysis refuses a
    feature no other edit produces there); on qwen3_5 none does (a hybrid's package differs from
    the reference in its args and adapter only: skill.porting.hybrid_package).
    """
    allowed: Collection[str]
    if profile.reference in EDITABLE_REFERENCES:
        allowed = list(EDITS_BY_NAME)
    else:
        allowed = MLA_MODEL_EDITS if profile.reference != HYBRID_REFERENCE else []
    built_in = [
        edit.name for edit in MODEL_EDITS if edit.name in allowed and edit.applies(profile) and edit.needed(text)
    ]
    # The feature modules that port the family, where their edit applies (else it was refused).
    return built_in + [
        module.name
        for module in FEATURE_MODULES
        if module.name in profile.feature_modules and profile.reference in module.references
    ]


NORM_TITLES = {
    "rms": "RMSNorm",
    "rms_offset": "(1 + w) RMSNorm",
    "rms_weightless": "weightless RMSNorm",
    "layernorm": "LayerNorm",
    "layernorm_no_bias": "LayerNorm without bias",
    "layernorm_weightless": "weightless LayerNorm",
    "layernorm_offset": "(1 + w) LayerNorm",
}
BLOCK_NAMES = {
    "pre_norm": "pre-norm",
    "sandwich": "sandwich-norm",
    "post_norm": "post-norm",
    "parallel": "parallel attention/MLP",
    "post_ln": "post-LN",
}
POSITION_NAMES = {
    "rope": "RoPE",
    "learned": "learned absolute positions",
    "alibi": "ALiBi position biases",
    "sinusoidal": "sinusoidal absolute positions",
}


def describe(profile: PortPlan, camel: str, edits: Collection[str] = ()) -> str:
    """A one-line module docstring naming the family's architecture, as the applied ``edits`` wrote
    it where a caller named one the analysis did not select (``remove_rope``, ``embedding_sqrt_dim``)."""
    positions = (
        "no RoPE" if profile.positions == "rope" and "remove_rope" in edits else POSITION_NAMES[profile.positions]
    )
    attention = ["multi-head latent attention"] if profile.reference == "deepseek_v3" else ["GQA"]
    if profile.output_gate is not None:
        function, _, per = profile.output_gate.partition("_")
        function = function if function in ("sigmoid", "softplus") else "learned"
        attention.append(f"a {function} gate on the attention output" + (" per head" if "per_head" in per else ""))
    if profile.indexer is not None:
        attention.append("a sparse-attention indexer choosing each query's top-k keys")
    if profile.qkv_bias:
        attention.append("q/k/v bias" + (" and output bias" if profile.o_bias else ""))
    qk_title = NORM_TITLES[profile.qk_norm_variant] if profile.qk_norm_variant else "RMSNorm"
    if profile.qk_norm == "full":
        attention.append(f"full-width QK {qk_title}")
    elif profile.qk_norm == "per_head":
        attention.append(f"per-head QK {qk_title}")
    if profile.sliding_window:
        attention.append("sliding-window attention" + (" on some layers" if profile.sliding_layer_types else ""))
    if profile.attn_softcap:
        attention.append("soft-capped attention scores")
    if profile.attn_sinks:
        attention.append("attention sinks")
    if profile.differential_attention:
        attention.append("differential attention (head pairs subtracted with a learned lambda)")
    if profile.chunked_attention is not None:
        kind = profile.chunked_attention.chunked_kind
        attention.append("chunked local attention" + (" on some layers" if kind else ""))
    norm = NORM_TITLES[profile.norm]
    mlp = (
        (
            "SwiGLU"
            if profile.activation == "silu"
            else "clamped-SwiGLU"
            if profile.expert_activation_fields
            else f"gated {_activation_name(profile)}"
        )
        if profile.mlp == "gated"
        else f"two-layer {_activation_name(profile)}"
    )
    extras = []
    if profile.rope_type != "default":
        extras.append(f"{profile.rope_type}-scaled RoPE")
    if profile.layer_rotary_dims:
        extras.append("partial rotary embeddings of a width per layer type")
    elif profile.partial_rotary:
        extras.append("partial rotary embeddings")
    if profile.rotary_interleaved:
        extras.append("RoPE over adjacent feature pairs (interleaved)")
    if profile.rotary_reversed:
        extras.append("RoPE turning each pair the other way")
    if profile.per_layer_rope:
        extras.append("RoPE parameters per layer type")
    if profile.nope_field or profile.nope_layer_type:
        extras.append("no RoPE on the ``nope_layers``")
    if profile.query_position_scale is not None:
        extras.append("queries scaled by their position in long contexts")
    if profile.moe:
        extras.append(
            "mixture-of-experts MLPs"
            + (" routed by per-expert sigmoid scores" if profile.router_scoring == "sigmoid" else "")
            + (" routed by a sparse mixer" if profile.router_scoring == "sparsemixer" else "")
            + (" with a gated shared expert" if profile.shared_expert else "")
            + (" whose experts have biases" if profile.expert_bias else "")
            + (" and a biased router" if profile.router_bias else "")
        )
    if profile.embedding_scale == "sqrt_dim" or "embedding_sqrt_dim" in edits:
        extras.append("sqrt(dim)-scaled embeddings")
    if profile.embedding_norm_module is not None:
        extras.append("normalised embeddings")
    if profile.multipliers:
        extras.append("scalar multipliers (" + ", ".join(profile.multipliers) + ")")
    if profile.final_softcap:
        extras.append("soft-capped logits")
    if profile.embedding_projection_field is not None:
        extras.append(f"embeddings projected to and from {profile.embedding_projection_field}")
    if profile.lm_head_bias:
        extras.append("an LM head with a bias")
    extras.extend(MODULES_BY_NAME[name].describe(value) for name, value in profile.feature_modules.items())
    if not profile.final_norm:
        extras.append("no final norm")
    if profile.tied:
        extras.append("tied embeddings")
    tail = ", ".join(extras)
    if profile.reference == HYBRID_REFERENCE:
        # A hybrid: its other layers' mixer is the reference's Gated DeltaNet.
        block = (
            f"hybrid {BLOCK_NAMES[profile.block]} decoder whose layers mix tokens by a Gated DeltaNet or by attention"
        )
    else:
        block = f"{BLOCK_NAMES[profile.block]} decoder"
    sentence = (
        f"{camel}: a {block} with {', '.join(attention)}, "
        f"{positions}, {norm} and a {mlp} MLP" + (f"; {tail}" if tail else "") + ", over packed documents."
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
            f"On layers marked ``{profile.windowed_kind}`` each token attends to the last ``sliding_window`` "
            "tokens of its own document."
        )
    elif profile.sliding_window:
        sentences.append("Each token attends to the last ``sliding_window`` tokens of its own document.")
    if profile.chunked_attention is not None:
        chunked = profile.chunked_attention
        where = f"On layers marked ``{chunked.chunked_kind}`` each" if chunked.chunked_kind else "Each"
        sentences.append(
            f"{where} token attends only to the earlier tokens of its ``{chunked.size_field}``-token chunk of "
            "its document."
        )
    if profile.attn_softcap:
        sentences.append("Scores are soft-capped before the softmax.")
    if profile.attn_sinks:
        sentences.append("A learned sink logit per head joins every softmax row and attends to nothing.")
    if profile.output_gate and profile.output_gate.endswith(IN_QUERY_SUFFIX):
        function = profile.output_gate.removesuffix(IN_QUERY_SUFFIX)
        sentences.append(
            f"Each head's rows of ``wq`` hold its query, then a gate: the {function} of the gate scales "
            "the output before ``wo``."
        )
    elif profile.output_gate:
        function, granularity = profile.output_gate.split("_per_")
        sentences.append(
            f"``wg``, a projection of the block input, gates the output before ``wo``: {function} of one "
            f"value per {granularity}."
        )
    if profile.positions == "alibi":
        sentences.append(
            "No RoPE: each head adds ``slope * (key - query)`` (ALiBi, positions within the document) to its scores."
        )
    if profile.qk_norm == "full":
        sentences.append(
            "``q_norm``/``k_norm`` normalise the whole q and k projections (all heads at once) before RoPE."
        )
    elif profile.qk_norm == "per_head":
        sentences.append(
            "``q_norm``/``k_norm`` normalise each head's ``head_dim`` vector "
            + ("after RoPE." if profile.qk_norm_after_rope else "before RoPE.")
        )
    if profile.nope_field or profile.nope_layer_type:
        sentences.append("``use_rope=False`` makes a NoPE layer: queries and keys are not rotated.")
    if not sentences:
        return ""
    wrapped = textwrap.wrap(" ".join(sentences), width=88, break_on_hyphens=False)
    return "\n" + "".join(f"    {line}\n" for line in wrapped)


def apply_model_edits(text: str, ctx: EditContext, names: list[str]) -> str:
    """Apply the named edits in the canonical order of :data:`MODEL_EDITS` (whatever order
    they are named in), so two edits on one place always nest the same way."""
    return edit_document(Document(text), ctx, names).code


def edit_document(text: Document, ctx: EditContext, names: list[str]) -> Document:
    """:func:`apply_model_edits` on a parsed ``model.py``: its one tree edited, not printed."""
    profile = ctx.profile
    unknown = [name for name in names if name not in EDITS_BY_NAME and name not in MODULES_BY_NAME]
    if unknown:
        raise ValueError(f"unknown model edit(s) {unknown}; known: {sorted([*EDITS_BY_NAME, *MODULES_BY_NAME])}")
    unmeasured = [name for name in names if name in MODULES_BY_NAME and name not in profile.feature_modules]
    if unmeasured:
        raise ValueError(
            f"the feature module(s) {unmeasured} port a fact the analysis did not measure for {profile.model_type}; "
            "leave them out (edit_model selects the modules the analysis names)"
        )
    order = list(EDITS_BY_NAME)
    for name in sorted(dict.fromkeys(n for n in names if n in EDITS_BY_NAME), key=order.index):
        text = EDITS_BY_NAME[name].apply(text, ctx)
    for module in FEATURE_MODULES:
        if module.name in names:
            text = module.edit_model(text, profile.feature_modules[module.name], ctx)
    if profile.block != "pre_norm" or _block_wiring(profile)[1] or "dense_layers" in names:
        # The block's wiring as the edits composed it (the reference's own otherwise).
        text = _set_block_doc(text, profile)
    if profile.reference in EDITABLE_REFERENCES:
        # Latent attention keeps the reference's own docstring: no edit changes it.
        text = set_docstring(text, "Attention", ATTENTION_DOC.format(features=_attention_features(profile)))
    text = set_docstring(text, None, describe(profile, ctx.camel, names))
    return prune_unused_imports(text)
