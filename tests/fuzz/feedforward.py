"""The dense feed-forward: gated (``down(act(gate(x)) * up(x))``) or plain (``down(act(up(x)))``),
with or without biases, gate and up fused into one projection (Phi-3's ``gate_up_proj``,
gate half first), in its own module or, under OPT's naming, as ``fc1``/``fc2`` of the layer."""

from __future__ import annotations

from tests.fuzz.naming import NamingScheme
from tests.fuzz.source import ConfigField, Piece, indent, lines
from tests.fuzz.spec import FamilySpec


def activation_field(naming: NamingScheme) -> str:
    return "activation_function" if naming.embed == "wte" else "hidden_act"


def fused_name(naming: NamingScheme) -> str:
    """The fused gate/up projection's name: Phi-3's, or the scheme's up projection (twice as wide)."""
    return "gate_up_proj" if naming.up == "up_proj" else naming.up


def ffn_parts(spec: FamilySpec, naming: NamingScheme, owner: str, width: str) -> tuple[str, str]:
    """(``__init__`` lines, the expression of the output for input ``x``) of a feed-forward
    whose projections are attributes of ``owner`` (``self``), ``width`` wide inside."""
    ffn = spec.ffn
    bias = "config.mlp_bias"
    act = f"{owner}.act_fn = ACT2FN[config.{activation_field(naming)}]"
    if ffn.kind == "plain":
        init = lines(
            f"{owner}.{naming.plain_up} = nn.Linear(config.hidden_size, {width}, bias={bias})",
            f"{owner}.{naming.plain_down} = nn.Linear({width}, config.hidden_size, bias={bias})",
            act,
        )
        return init, f"{owner}.{naming.plain_down}({owner}.act_fn({owner}.{naming.plain_up}(x)))"
    if ffn.fused_gate_up:
        fused = fused_name(naming)
        init = lines(
            f"{owner}.{fused} = nn.Linear(config.hidden_size, 2 * {width}, bias={bias})",
            f"{owner}.{naming.down} = nn.Linear({width}, config.hidden_size, bias={bias})",
            act,
        )
        # The gate half first, then the up half.
        return init, f"{owner}.{naming.down}(gated_product({owner}.{fused}(x), {owner}.act_fn))"
    init = lines(
        f"{owner}.{naming.gate} = nn.Linear(config.hidden_size, {width}, bias={bias})",
        f"{owner}.{naming.up} = nn.Linear(config.hidden_size, {width}, bias={bias})",
        f"{owner}.{naming.down} = nn.Linear({width}, config.hidden_size, bias={bias})",
        act,
    )
    return init, f"{owner}.{naming.down}({owner}.act_fn({owner}.{naming.gate}(x)) * {owner}.{naming.up}(x))"


GATED_PRODUCT = '''def gated_product(gate_up, act_fn):
    """``act(gate) * up`` of a fused projection whose first half is the gate."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up'''


def ffn_piece(spec: FamilySpec, naming: NamingScheme) -> Piece:
    """``PREFIXMLP`` (always: MoE experts and shared experts are ones too) and its config fields."""
    ffn = spec.ffn
    init, out = ffn_parts(spec, naming, "self", "intermediate_size")
    code = (
        "class PREFIXMLP(nn.Module):\n"
        "    def __init__(self, config: PREFIXConfig, intermediate_size=None):\n"
        + indent(
            lines(
                "super().__init__()",
                "intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size",
                init,
            ),
            2,
        )
        + "\n\n    def forward(self, x):\n"
        + indent(f"return {out}", 2)
    )
    if ffn.fused_gate_up and ffn.kind == "gated":
        code = GATED_PRODUCT + "\n\n\n" + code
    fields = [
        ConfigField("intermediate_size", ffn.intermediate_size),
        ConfigField(activation_field(naming), ffn.activation),
        ConfigField("mlp_bias", ffn.bias),
    ]
    return Piece(code=code, imports={"from transformers.activations import ACT2FN"}, fields=fields)
