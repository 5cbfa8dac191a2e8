"""Softmax self-attention with every variant of the vocabulary, eager and HF-shaped.

Projections separate or fused (every query head, then every key head, then every value
head: Phi-3; or per KV head its query heads, its key and its value: GPT-NeoX / Falcon),
q/k/v and output biases, GQA / MQA, an explicit ``head_dim``, q/k/v clipping (OLMo), a QK
norm over each head or over the full projection, of any norm kind, before or after RoPE;
RoPE on every layer or only where the config says (``no_rope_layers``, or the sliding
layers of ``layer_types``), ALiBi; scores scaled by ``head_dim ** -0.5``,
``query_pre_attn_scalar ** -0.5`` (Gemma 2) or ``attention_multiplier`` (Granite), soft-capped
(Gemma 2), and a learned sink logit per head (gpt-oss). The sliding window is a mask the
base model builds per layer type.
"""

from __future__ import annotations

from tests.fuzz.naming import NamingScheme
from tests.fuzz.norms import eps_field, norm_ctor
from tests.fuzz.source import ConfigField, Piece, block, indent, lines
from tests.fuzz.spec import FamilySpec

REPEAT_KV = """
    def repeat_kv(hidden_states, n_rep):
        batch, num_key_value_heads, slen, head_dim = hidden_states.shape
        if n_rep == 1:
            return hidden_states
        hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
        return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)
"""


DIFFERENTIAL_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")

# Differential attention written with the value doubled (the paper's form; transformers' DiffLlama
# runs the attention twice instead): every head attends over its first-half head's value and
# that head's second-half twin's, side by side.
DOUBLED_VALUES = """
half = self.num_heads // 2
value_states = torch.cat([value_states[:, :half], value_states[:, half:]], dim=-1).repeat(1, 2, 1, 1)
"""

# Heads i and i + H/2 subtracted with lambda, each pair normalised over its 2 * head_dim outputs.
DIFFERENTIAL_COMBINE = """
first, second = attn_output[:, :half], attn_output[:, half:]
lambda_full = (
    torch.exp((self.lambda_q1 * self.lambda_k1).sum()) - torch.exp((self.lambda_q2 * self.lambda_k2).sum())
) + self.lambda_init
attn_output = (1 - self.lambda_init) * self.pair_norm(first - lambda_full * second)
"""


def qk_norm_names(naming: NamingScheme) -> tuple[str, str]:
    return (
        ("q_layernorm", "k_layernorm") if naming.attention in ("attention", "self_attention") else ("q_norm", "k_norm")
    )


def bias_fields(spec: FamilySpec) -> tuple[str, str, list[ConfigField]]:
    """The ``bias=`` expressions of the q/k/v and the output projections, and their config fields."""
    att = spec.attention
    if att.qkv_bias == att.o_bias:
        return "config.attention_bias", "config.attention_bias", [ConfigField("attention_bias", att.qkv_bias)]
    if att.qkv_bias:
        return "config.use_qkv_bias", "False", [ConfigField("use_qkv_bias", True)]
    return "False", "True", []


def _projections(spec: FamilySpec, naming: NamingScheme, qkv_bias: str, o_bias: str) -> tuple[str, str]:
    """(``__init__`` lines, ``forward`` lines producing flat query/key/value states)."""
    att = spec.attention
    q_width, kv_width = "self.num_heads * self.head_dim", "self.num_key_value_heads * self.head_dim"
    o = f"self.{naming.o} = nn.Linear({q_width}, config.hidden_size, bias={o_bias})"
    if att.fused_qkv == "none":
        init = lines(
            f"self.{naming.q} = nn.Linear(config.hidden_size, {q_width}, bias={qkv_bias})",
            f"self.{naming.k} = nn.Linear(config.hidden_size, {kv_width}, bias={qkv_bias})",
            f"self.{naming.v} = nn.Linear(config.hidden_size, {kv_width}, bias={qkv_bias})",
            o,
        )
        forward = lines(
            f"query_states = self.{naming.q}(hidden_states)",
            f"key_states = self.{naming.k}(hidden_states)",
            f"value_states = self.{naming.v}(hidden_states)",
        )
        return init, forward
    init = lines(
        f"self.{naming.qkv} = nn.Linear(config.hidden_size, {q_width} + 2 * {kv_width}, bias={qkv_bias})",
        o,
    )
    if att.fused_qkv == "stacked":
        forward = block(
            f"""
            qkv = self.{naming.qkv}(hidden_states)
            query_states, key_states, value_states = qkv.split(
                [{q_width}, {kv_width}, {kv_width}], dim=-1
            )
            """
        )
    else:
        forward = block(
            f"""
            # Per KV head: its group of query heads, then its key, then its value.
            qkv = self.{naming.qkv}(hidden_states)
            qkv = qkv.view(bsz, q_len, self.num_key_value_heads, self.num_key_value_groups + 2, self.head_dim)
            query_states = qkv[..., :-2, :].reshape(bsz, q_len, -1)
            key_states = qkv[..., -2, :].reshape(bsz, q_len, -1)
            value_states = qkv[..., -1, :].reshape(bsz, q_len, -1)
            """
        )
    return init, forward


def _scaling(spec: FamilySpec) -> tuple[str, list[ConfigField]]:
    att = spec.attention
    if att.scale == "query_pre_attn_scalar":
        return "config.query_pre_attn_scalar**-0.5", [ConfigField("query_pre_attn_scalar", att.scale_value)]
    if att.scale == "attention_multiplier":
        return "config.attention_multiplier", [ConfigField("attention_multiplier", att.scale_value)]
    return "self.head_dim**-0.5", []


def _use_rope(spec: FamilySpec) -> str | None:
    att = spec.attention
    if spec.positions != "rope":
        return None
    if att.nope == "per_layer_field":
        return "self.use_rope = bool(config.no_rope_layers[layer_idx])"
    if att.nope == "layer_type":
        return 'self.use_rope = config.layer_types[layer_idx] == "sliding_attention"'
    return None


def attention_piece(spec: FamilySpec, naming: NamingScheme) -> Piece:
    att = spec.attention
    qkv_bias, o_bias, fields = bias_fields(spec)
    proj_init, proj_forward = _projections(spec, naming, qkv_bias, o_bias)
    scaling, scale_fields = _scaling(spec)
    fields += scale_fields
    eps = f"config.{eps_field(spec.norm.kind)}"
    head_dim = "config.head_dim" if att.explicit_head_dim else "config.hidden_size // config.num_attention_heads"

    init_extra, qk_full, qk_before, qk_after = [], "", "", ""
    if att.qk_norm is not None:
        qk = att.qk_norm
        q_name, k_name = qk_norm_names(naming)
        if qk.width == "per_head":
            q_width = k_width = "self.head_dim"
        else:
            q_width, k_width = "self.num_heads * self.head_dim", "self.num_key_value_heads * self.head_dim"
        norms = [
            f"self.{q_name} = {norm_ctor(qk.kind, q_width, eps)}",
            f"self.{k_name} = {norm_ctor(qk.kind, k_width, eps)}",
        ]
        normed = f"query_states = self.{q_name}(query_states)\nkey_states = self.{k_name}(key_states)"
        if qk.rope_layers_only:
            # Llama 4: only the layers that rotate build and apply the QK norm.
            rope_rule = _use_rope(spec)
            assert rope_rule is not None, "a QK norm on the RoPE layers only needs NoPE layers"
            norms = [rope_rule, "if self.use_rope:", *(indent(line, 1) for line in norms)]
            normed = "if self.use_rope:\n" + indent(normed, 1)
        init_extra += norms
        if qk.width == "full_width":
            qk_full = normed
        elif qk.after_rope and spec.positions == "rope":
            qk_after = normed
        else:
            qk_before = normed
    if att.softcap is not None:
        init_extra.append("self.attn_logit_softcapping = config.attn_logit_softcapping")
        fields.append(ConfigField("attn_logit_softcapping", att.softcap))
    if att.sinks:
        init_extra.append("self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))")
    if att.differential:
        init_extra += [
            "# Differential attention: lambda = exp(q1 . k1) - exp(q2 . k2) + lambda_init(layer).",
            "self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)",
            *(f"self.{name} = nn.Parameter(torch.zeros(self.head_dim))" for name in DIFFERENTIAL_VECTORS),
            f"self.pair_norm = nn.RMSNorm(2 * self.head_dim, eps={eps}, elementwise_affine=False)",
        ]
    use_rope = _use_rope(spec)
    if use_rope and use_rope not in init_extra:
        init_extra.append(use_rope)
    if att.nope == "per_layer_field":
        fields.append(ConfigField("no_rope_layers", list(att.rope_layers)))
    if att.clip_qkv is not None:
        fields.append(ConfigField("clip_qkv", att.clip_qkv))
    if att.explicit_head_dim:
        fields.append(ConfigField("head_dim", att.head_dim))

    clip = (
        block(
            """
            if self.config.clip_qkv is not None:
                query_states = query_states.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
                key_states = key_states.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
                value_states = value_states.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
            """
        )
        if att.clip_qkv is not None
        else ""
    )
    rope = ""
    if spec.positions == "rope":
        rotate = lines(
            "cos, sin = position_embeddings",
            "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
        )
        rope = "if self.use_rope:\n" + indent(rotate, 1) if use_rope else rotate
    softcap = (
        block(
            """
            attn_weights = attn_weights / self.attn_logit_softcapping
            attn_weights = torch.tanh(attn_weights) * self.attn_logit_softcapping
            """
        )
        if att.softcap is not None
        else ""
    )
    alibi = (
        block(
            """
            # ALiBi: each head adds slope * (key position - query position) to its scores.
            slopes = build_alibi_slopes(self.num_heads).to(device=attn_weights.device, dtype=attn_weights.dtype)
            positions = torch.arange(q_len, device=attn_weights.device, dtype=attn_weights.dtype)
            distance = positions[None, :] - positions[:, None]
            attn_weights = attn_weights + slopes[:, None, None] * distance
            """
        )
        if spec.positions == "alibi"
        else ""
    )
    if att.sinks:
        softmax = block(
            """
            # A learned sink logit per head joins every row's softmax and attends to nothing.
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(bsz, -1, q_len, -1)
            combined_logits = torch.cat([attn_weights, sinks], dim=-1)
            combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
            attn_weights = probs[..., :-1].to(query_states.dtype)
            """
        )
    else:
        softmax = "attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)"

    init_body = lines(
        "super().__init__()",
        "self.config = config",
        "self.layer_idx = layer_idx",
        f"self.head_dim = {head_dim}",
        "self.num_heads = config.num_attention_heads",
        "self.num_key_value_heads = config.num_key_value_heads",
        "self.num_key_value_groups = self.num_heads // self.num_key_value_heads",
        f"self.scaling = {scaling}",
        proj_init,
        *init_extra,
    )
    forward_body = lines(
        "bsz, q_len, _ = hidden_states.shape",
        proj_forward,
        clip,
        qk_full,
        "query_states = query_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)",
        "key_states = key_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)",
        "value_states = value_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)",
        qk_before,
        rope,
        qk_after,
        "key_states = repeat_kv(key_states, self.num_key_value_groups)",
        "value_states = repeat_kv(value_states, self.num_key_value_groups)",
        block(DOUBLED_VALUES) if att.differential else "",
        "attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling",
        softcap,
        alibi,
        "if attention_mask is not None:\n    attn_weights = attn_weights + attention_mask",
        softmax,
        "attn_output = torch.matmul(attn_weights, value_states)",
        block(DIFFERENTIAL_COMBINE) if att.differential else "",
        "attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)",
        f"return self.{naming.o}(attn_output)",
    )
    code = (
        block(REPEAT_KV)
        + "\n\n\nclass PREFIXAttention(nn.Module):\n"
        + "    def __init__(self, config: PREFIXConfig, layer_idx: int):\n"
        + indent(init_body, 2)
        + "\n\n    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):\n"
        + indent(forward_body, 2)
    )
    inits = [("PREFIXAttention", "init.normal_(module.sinks, mean=0.0, std=std)")] if att.sinks else []
    if att.differential:
        inits += [
            ("PREFIXAttention", f"init.normal_(module.{name}, mean=0.0, std=0.1)") for name in DIFFERENTIAL_VECTORS
        ]
    imports = {"import torch.nn.functional as F"} | ({"import math"} if att.differential else set())
    return Piece(code=code, imports=imports, fields=fields, inits=inits)
