"""The decoder layer: where its norms sit around the attention and the feed-forward.

pre: ``x + f(norm(x))`` (Llama); sandwich: ``x + norm(f(norm(x)))`` (Gemma 2); post
sub-layer: ``x + norm(f(x))`` (OLMo 2); post-LN: ``norm(x + f(x))`` (OPT-350m, the original
Transformer); parallel: ``x + attn(norm(x)) + mlp(norm'(x))`` (GPT-NeoX; one shared norm:
GPT-J). Each branch may be scaled by ``residual_multiplier`` before it joins the stream
(Granite). A layer's attention type (``full_attention`` / ``sliding_attention``) selects
the mask the base model built for it.
"""

from __future__ import annotations

from tests.fuzz.feedforward import ffn_parts
from tests.fuzz.moe import is_moe_layer_expr
from tests.fuzz.naming import NamingScheme
from tests.fuzz.norms import eps_field, norm_ctor
from tests.fuzz.source import ConfigField, Piece, indent, lines
from tests.fuzz.spec import FamilySpec


def ffn_attr(spec: FamilySpec, naming: NamingScheme) -> str | None:
    """The layer attribute holding the feed-forward or MoE block (None: OPT's inline fc1/fc2)."""
    if spec.moe is not None:
        return spec.moe.block_name if spec.moe.layers == "all" or spec.moe.block_name == "feed_forward" else "mlp"
    return naming.ffn


def _attention_type(spec: FamilySpec) -> str:
    att = spec.attention
    if att.window == "some":
        return "self.attention_type = config.layer_types[layer_idx]"
    if att.window == "all":
        return 'self.attention_type = "sliding_attention"'
    if att.chunk == "some":
        return "self.attention_type = config.layer_types[layer_idx]"
    if att.chunk == "all":
        return 'self.attention_type = "chunked_attention"'
    return 'self.attention_type = "full_attention"'


def _ffn_init(spec: FamilySpec, naming: NamingScheme) -> tuple[str, str, str]:
    """(``__init__`` lines, the call on ``hidden_states``, an extra method of the layer)."""
    attr = ffn_attr(spec, naming)
    if spec.moe is not None:
        rule = is_moe_layer_expr(spec)
        if rule is None:
            return f"self.{attr} = PREFIXSparseMoeBlock(config)", f"self.{attr}(hidden_states)", ""
        init = lines(
            f"if {rule}:",
            f"    self.{attr} = PREFIXSparseMoeBlock(config)",
            "else:",
            f"    self.{attr} = PREFIXMLP(config)",
        )
        return init, f"self.{attr}(hidden_states)", ""
    if attr is not None:
        return f"self.{attr} = PREFIXMLP(config)", f"self.{attr}(hidden_states)", ""
    # OPT: the feed-forward's projections belong to the layer itself.
    init, out = ffn_parts(spec, naming, "self", "config.intermediate_size")
    method = "def feed_forward(self, x):\n" + indent(f"return {out}", 1)
    return init, "self.feed_forward(hidden_states)", method


def _forward(spec: FamilySpec, naming: NamingScheme, ffn_call: str) -> str:
    norm = spec.norm
    name = {role: f"self.{n}" for role, n in naming.norms[norm.placement].items()}
    attn = f"self.{naming.attention}(hidden_states, position_embeddings, attention_mask)"
    scaled = " * self.residual_multiplier" if spec.scalars.residual_multiplier is not None else ""
    match norm.placement:
        case "pre" | "sandwich":
            sandwich = norm.placement == "sandwich"
            return lines(
                "residual = hidden_states",
                f"hidden_states = {name['attn_in']}(hidden_states)",
                f"hidden_states = {attn}",
                f"hidden_states = {name['attn_out']}(hidden_states)" if sandwich else "",
                f"hidden_states = residual + hidden_states{scaled}",
                "residual = hidden_states",
                f"hidden_states = {name['ffn_in']}(hidden_states)",
                f"hidden_states = {ffn_call}",
                f"hidden_states = {name['ffn_out']}(hidden_states)" if sandwich else "",
                f"hidden_states = residual + hidden_states{scaled}",
                "return hidden_states",
            )
        case "post_sublayer":
            return lines(
                "residual = hidden_states",
                f"hidden_states = {attn}",
                f"hidden_states = residual + {name['attn_out']}(hidden_states){scaled}",
                "residual = hidden_states",
                f"hidden_states = {ffn_call}",
                f"hidden_states = residual + {name['ffn_out']}(hidden_states){scaled}",
                "return hidden_states",
            )
        case "post_ln":
            return lines(
                "residual = hidden_states",
                f"hidden_states = {attn}",
                f"hidden_states = {name['attn_out']}(residual + hidden_states{scaled})",
                "residual = hidden_states",
                f"hidden_states = {ffn_call}",
                f"hidden_states = {name['ffn_out']}(residual + hidden_states{scaled})",
                "return hidden_states",
            )
        case "parallel":
            ffn_in = name["attn_in"] if norm.shared_parallel_norm else name["ffn_in"]
            return lines(
                "residual = hidden_states",
                f"attn_output = self.{naming.attention}({name['attn_in']}(hidden_states), position_embeddings, "
                "attention_mask)",
                f"hidden_states = {ffn_in}(hidden_states)",
                f"mlp_output = {ffn_call}",
                f"return residual + attn_output{scaled} + mlp_output{scaled}",
            )
    raise ValueError(f"unknown placement {norm.placement}")


def block_piece(spec: FamilySpec, naming: NamingScheme) -> Piece:
    norm = spec.norm
    eps = f"config.{eps_field(norm.kind)}"
    roles = dict(naming.norms[norm.placement])
    if norm.placement == "parallel" and norm.shared_parallel_norm:
        roles.pop("ffn_in")
    norms = [f"self.{n} = {norm_ctor(norm.kind, 'config.hidden_size', eps)}" for n in roles.values()]
    ffn_init, ffn_call, method = _ffn_init(spec, naming)
    fields: list[ConfigField] = []
    init = [
        "super().__init__()",
        "self.hidden_size = config.hidden_size",
        _attention_type(spec),
        f"self.{naming.attention} = PREFIXAttention(config, layer_idx)",
        ffn_init,
        *norms,
    ]
    if spec.scalars.residual_multiplier is not None:
        init.append("self.residual_multiplier = config.residual_multiplier")
        fields.append(ConfigField("residual_multiplier", spec.scalars.residual_multiplier))
    code = (
        "class PREFIXDecoderLayer(nn.Module):\n"
        "    def __init__(self, config: PREFIXConfig, layer_idx: int):\n"
        + indent(lines(*init), 2)
        + "\n\n    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):\n"
        + indent(_forward(spec, naming, ffn_call), 2)
    )
    if method:
        code += "\n\n" + indent(method, 1)
    return Piece(code=code, fields=fields)
