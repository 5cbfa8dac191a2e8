"""The module (and so checkpoint key) naming schemes of the catalogue's families.

A scheme names every module the writer emits: where the base model sits in the causal
LM (``model``, ``transformer``, ``gpt_neox``, ``model.decoder``), the embedding, the
layer list, the final norm and the head, the attention and its projections, the
feed-forward and its projections, and the block norms by the role they play under each
placement (GPT-2's ``ln_1``/``ln_2`` are the pre-norms, OPT-350m's
``self_attn_layer_norm`` normalises the residual sum after the attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tests.fuzz.spec import FamilySpec, Naming, Placement

# A block norm's role: before / after the attention, before / after the feed-forward.
NORM_ROLES = ("attn_in", "attn_out", "ffn_in", "ffn_out")


@dataclass(frozen=True)
class NamingScheme:
    backbone: str  # attribute of the causal LM holding the base model
    decoder: str | None  # attribute of the base model holding the stack (OPT: decoder)
    embed: str
    positions: str  # learned absolute-position table
    layers: str
    final_norm: str
    head: str
    attention: str
    q: str
    k: str
    v: str
    o: str
    qkv: str
    ffn: str | None  # the feed-forward's module, or None: its projections sit in the layer (OPT)
    gate: str
    up: str
    down: str
    plain_up: str
    plain_down: str
    norms: dict[str, dict[str, str]] = field(default_factory=dict)  # placement -> role -> name

    def norm_name(self, placement: Placement, role: str) -> str:
        return self.norms[placement][role]

    @property
    def stack_path(self) -> str:
        """The attribute path from the causal LM to the module holding the layer list."""
        return self.backbone + (f".{self.decoder}" if self.decoder else "")


def _roles(pre: tuple[str, str], sandwich: tuple[str, str, str, str], post: tuple[str, str]) -> dict:
    return {
        "pre": {"attn_in": pre[0], "ffn_in": pre[1]},
        "parallel": {"attn_in": pre[0], "ffn_in": pre[1]},
        "sandwich": dict(zip(NORM_ROLES, sandwich, strict=True)),
        "post_sublayer": {"attn_out": post[0], "ffn_out": post[1]},
        "post_ln": {"attn_out": post[0], "ffn_out": post[1]},
    }


SCHEMES: dict[Naming, NamingScheme] = {
    "llama": NamingScheme(
        backbone="model",
        decoder=None,
        embed="embed_tokens",
        positions="embed_positions",
        layers="layers",
        final_norm="norm",
        head="lm_head",
        attention="self_attn",
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        qkv="qkv_proj",
        ffn="mlp",
        gate="gate_proj",
        up="up_proj",
        down="down_proj",
        plain_up="up_proj",
        plain_down="down_proj",
        norms=_roles(
            ("input_layernorm", "post_attention_layernorm"),
            ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
            ("post_attention_layernorm", "post_feedforward_layernorm"),
        ),
    ),
    "gpt2": NamingScheme(
        backbone="transformer",
        decoder=None,
        embed="wte",
        positions="wpe",
        layers="h",
        final_norm="ln_f",
        head="lm_head",
        attention="attn",
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="c_proj",
        qkv="c_attn",
        ffn="mlp",
        gate="c_gate",
        up="c_fc",
        down="c_proj",
        plain_up="c_fc",
        plain_down="c_proj",
        norms=_roles(("ln_1", "ln_2"), ("ln_1", "ln_1_post", "ln_2", "ln_2_post"), ("ln_1", "ln_2")),
    ),
    "neox": NamingScheme(
        backbone="gpt_neox",
        decoder=None,
        embed="embed_in",
        positions="embed_positions",
        layers="layers",
        final_norm="final_layer_norm",
        head="embed_out",
        attention="attention",
        q="query",
        k="key",
        v="value",
        o="dense",
        qkv="query_key_value",
        ffn="mlp",
        gate="dense_h_to_4h_gate",
        up="dense_h_to_4h",
        down="dense_4h_to_h",
        plain_up="dense_h_to_4h",
        plain_down="dense_4h_to_h",
        norms=_roles(
            ("input_layernorm", "post_attention_layernorm"),
            ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"),
            ("post_attention_layernorm", "post_mlp_layernorm"),
        ),
    ),
    "opt": NamingScheme(
        backbone="model",
        decoder="decoder",
        embed="embed_tokens",
        positions="embed_positions",
        layers="layers",
        final_norm="final_layer_norm",
        head="lm_head",
        attention="self_attn",
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="out_proj",
        qkv="qkv_proj",
        ffn=None,
        gate="fc_gate",
        up="fc1",
        down="fc2",
        plain_up="fc1",
        plain_down="fc2",
        norms=_roles(
            ("self_attn_layer_norm", "final_layer_norm"),
            ("self_attn_layer_norm", "self_attn_out_layer_norm", "final_layer_norm", "fc_out_layer_norm"),
            ("self_attn_layer_norm", "final_layer_norm"),
        ),
    ),
    "falcon": NamingScheme(
        backbone="transformer",
        decoder=None,
        embed="word_embeddings",
        positions="position_embeddings",
        layers="h",
        final_norm="ln_f",
        head="lm_head",
        attention="self_attention",
        q="query",
        k="key",
        v="value",
        o="dense",
        qkv="query_key_value",
        ffn="mlp",
        gate="dense_h_to_4h_gate",
        up="dense_h_to_4h",
        down="dense_4h_to_h",
        plain_up="dense_h_to_4h",
        plain_down="dense_4h_to_h",
        norms={
            **_roles(
                ("input_layernorm", "post_attention_layernorm"),
                ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"),
                ("post_attention_layernorm", "post_mlp_layernorm"),
            ),
            # Falcon's new decoder architecture: one norm for each parallel branch.
            "parallel": {"attn_in": "ln_attn", "ffn_in": "ln_mlp"},
        },
    ),
}


# The feed-forward names of the catalogue's MoE families: routed experts, shared experts and
# the dense layers beside them are Llama-named MLPs in ``mlp`` (Qwen-MoE, DeepSeek, OLMoE),
# or Mixtral's ``w1``/``w3``/``w2`` experts in ``block_sparse_moe``, or Llama 4's in
# ``feed_forward`` (its dense layers' MLP too). No family of the
# catalogue names its experts after GPT-2's or GPT-NeoX's dense MLP.
_MOE_FFN = {
    "mlp": {"ffn": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "block_sparse_moe": {"ffn": "mlp", "gate": "w1", "up": "w3", "down": "w2"},
    # Llama 4's: the MoE block and the dense layers' MLP are both the layer's feed_forward.
    "feed_forward": {"ffn": "feed_forward", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}
# OPT keeps fc1/fc2 in the layer for its plain MLP; a gated MLP of such a family is a module
# of its own, named as Llama's.
_GATED_INLINE = {"ffn": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def scheme_for(spec: FamilySpec) -> NamingScheme:
    """The family's naming scheme, with the feed-forward names its MoE or gated MLP takes."""
    scheme = SCHEMES[spec.naming]
    if spec.moe is not None:
        return replace(scheme, **_MOE_FFN[spec.moe.block_name])
    if scheme.ffn is None and spec.ffn.kind == "gated":
        return replace(scheme, **_GATED_INLINE)
    return scheme
