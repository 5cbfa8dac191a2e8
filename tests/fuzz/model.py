"""The base model and the causal LM around the layer stack.

The embedding (optionally scaled by ``sqrt(hidden_size)`` as Gemma does, or by
``embedding_multiplier`` as Granite does; learned absolute positions added as GPT-2
does), the masks each attention type needs (causal; causal within ``sliding_window``; causal
inside chunks of ``attention_chunk_size``),
the rotary embedding, the layers, the final norm; then the LM head, whose logits may be
divided by ``logits_scaling`` (Granite), multiplied by ``logit_scale`` (Cohere) and
soft-capped by ``final_logit_softcapping`` (Gemma 2). The head is tied to the embedding
(``_tied_weights_keys``), untied, or untied although the config says
``tie_word_embeddings`` (a model that defines no tying: transformers ties nothing).
"""

from __future__ import annotations

from tests.fuzz.naming import NamingScheme
from tests.fuzz.norms import CLASS_NAMES, OFFSET_KINDS, eps_field, norm_ctor
from tests.fuzz.source import ConfigField, Piece, block, indent, lines
from tests.fuzz.spec import FamilySpec

CAUSAL_MASK = '''
    def causal_mask(attention_mask, batch, seq_len, dtype, device, sliding_window=None, chunk=None):
        """Additive ``[batch, 1, q, k]`` mask: causal, within ``sliding_window`` tokens when given,
        inside chunks of ``chunk`` tokens when given, plus padding from a 2D ``attention_mask``."""
        positions = torch.arange(seq_len, device=device)
        allowed = positions[None, :] <= positions[:, None]
        if sliding_window is not None:
            allowed = allowed & (positions[:, None] - positions[None, :] < sliding_window)
        if chunk is not None:
            allowed = allowed & (positions[:, None] // chunk == positions[None, :] // chunk)
        allowed = allowed[None, None].expand(batch, 1, seq_len, seq_len)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(batch, 1, seq_len, seq_len, dtype=dtype, device=device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)
'''


def _pretrained(spec: FamilySpec, naming: NamingScheme, inits: list[tuple[str, str]]) -> str:
    kinds = {spec.norm.kind}
    if spec.attention.qk_norm is not None:
        kinds.add(spec.attention.qk_norm.kind)
    offset_inits = [
        (
            CLASS_NAMES[kind],
            "init.zeros_(module.weight)" + ("\ninit.zeros_(module.bias)" if kind.startswith("layer") else ""),
        )
        for kind in sorted(kinds)
        if kind in OFFSET_KINDS
    ]
    branches = []
    for index, (cls, body) in enumerate([*offset_inits, *inits]):
        keyword = "if" if index == 0 else "elif"
        branches.append(f"{keyword} isinstance(module, {cls}):\n" + indent(body, 1))
    init_method = ""
    if branches:
        init_method = "\n\n    @torch.no_grad()\n    def _init_weights(self, module):\n" + indent(
            lines("super()._init_weights(module)", "std = self.config.initializer_range", *branches), 2
        )
    return (
        "class PREFIXPreTrainedModel(PreTrainedModel):\n"
        "    config_class = PREFIXConfig\n"
        f'    base_model_prefix = "{naming.backbone}"\n'
        '    _no_split_modules: ClassVar[list[str]] = ["PREFIXDecoderLayer"]\n'
        "    _supports_sdpa = False" + init_method
    )


def _stack(spec: FamilySpec, naming: NamingScheme, cls: str) -> tuple[str, list[ConfigField]]:
    """The module holding the embedding, the layers and the final norm."""
    fields: list[ConfigField] = []
    sc = spec.scalars
    init = [
        "super().__init__(config)",
        "self.padding_idx = config.pad_token_id",
        f"self.{naming.embed} = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)",
    ]
    if spec.positions == "learned":
        init.append(f"self.{naming.positions} = nn.Embedding(config.max_position_embeddings, config.hidden_size)")
    init.append(
        f"self.{naming.layers} = nn.ModuleList(\n"
        "    [PREFIXDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]\n"
        ")"
    )
    if spec.norm.final_norm:
        init.append(
            f"self.{naming.final_norm} = "
            + norm_ctor(spec.norm.kind, "config.hidden_size", f"config.{eps_field(spec.norm.kind)}")
        )
    if spec.positions == "rope":
        init.append("self.rotary_emb = PREFIXRotaryEmbedding(config)")
    init.append("self.post_init()")

    scale = ""
    if sc.embedding_scale == "sqrt_dim":
        scale = lines(
            "normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)",
            "hidden_states = hidden_states * normalizer",
        )
    elif sc.embedding_scale == "multiplier":
        scale = "hidden_states = hidden_states * self.config.embedding_multiplier"
        fields.append(ConfigField("embedding_multiplier", sc.embedding_multiplier))
    masks = [
        lines(
            'masks = {"full_attention": causal_mask(',
            "    attention_mask, bsz, seq_len, hidden_states.dtype, hidden_states.device",
            ")}",
        )
    ]
    if spec.attention.window != "none":
        masks.append(
            'masks["sliding_attention"] = causal_mask(\n'
            "    attention_mask, bsz, seq_len, hidden_states.dtype, hidden_states.device, self.config.sliding_window\n"
            ")"
        )
        fields.append(ConfigField("sliding_window", spec.attention.window_size))
        if spec.attention.window == "some":
            fields.append(ConfigField("layer_types", list(spec.attention.layer_types)))
    if spec.attention.chunk != "none":
        masks.append(
            'masks["chunked_attention"] = causal_mask(\n'
            "    attention_mask, bsz, seq_len, hidden_states.dtype, hidden_states.device,\n"
            "    chunk=self.config.attention_chunk_size,\n"
            ")"
        )
        fields.append(ConfigField("attention_chunk_size", spec.attention.chunk_size))
        if spec.attention.chunk == "some":
            fields.append(ConfigField("layer_types", list(spec.attention.layer_types)))
    forward = lines(
        "if (input_ids is None) == (inputs_embeds is None):",
        '    raise ValueError("pass exactly one of input_ids and inputs_embeds")',
        "if inputs_embeds is None:",
        f"    inputs_embeds = self.{naming.embed}(input_ids)",
        "bsz, seq_len, _ = inputs_embeds.shape",
        "if position_ids is None:",
        "    position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0).expand(bsz, -1)",
        "hidden_states = inputs_embeds",
        scale,
        f"hidden_states = hidden_states + self.{naming.positions}(position_ids)" if spec.positions == "learned" else "",
        *masks,
        "position_embeddings = self.rotary_emb(hidden_states, position_ids)"
        if spec.positions == "rope"
        else "position_embeddings = None",
        f"for layer in self.{naming.layers}:",
        "    hidden_states = layer(hidden_states, position_embeddings, masks[layer.attention_type])",
        f"hidden_states = self.{naming.final_norm}(hidden_states)" if spec.norm.final_norm else "",
        "return BaseModelOutputWithPast(last_hidden_state=hidden_states)",
    )
    code = (
        f"class {cls}(PREFIXPreTrainedModel):\n"
        "    def __init__(self, config: PREFIXConfig):\n"
        + indent(lines(*init), 2)
        + "\n\n    def get_input_embeddings(self):\n"
        + f"        return self.{naming.embed}\n"
        + "\n    def set_input_embeddings(self, value):\n"
        + f"        self.{naming.embed} = value\n"
        + "\n    def forward(\n"
        + "        self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs\n"
        + "    ):\n"
        + indent(forward, 2)
    )
    return code, fields


def _decoder_wrapper(naming: NamingScheme) -> str:
    """OPT's base model: a thin module around its ``decoder``."""
    assert naming.decoder is not None
    return block(
        f"""
        class PREFIXModel(PREFIXPreTrainedModel):
            def __init__(self, config: PREFIXConfig):
                super().__init__(config)
                self.{naming.decoder} = PREFIXDecoder(config)
                self.post_init()

            def get_input_embeddings(self):
                return self.{naming.decoder}.get_input_embeddings()

            def set_input_embeddings(self, value):
                self.{naming.decoder}.set_input_embeddings(value)

            def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
                return self.{naming.decoder}(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    inputs_embeds=inputs_embeds,
                )
        """
    )


def _causal_lm(spec: FamilySpec, naming: NamingScheme) -> tuple[str, list[ConfigField]]:
    sc = spec.scalars
    fields: list[ConfigField] = []
    tied = ""
    if spec.tying in ("tied", "untied"):
        source = f"{naming.stack_path}.{naming.embed}.weight"
        tied = f'    _tied_weights_keys: ClassVar[dict[str, str]] = {{"{naming.head}.weight": "{source}"}}\n\n'
    post = []
    if sc.logits == "divide":
        post.append("logits = logits / self.config.logits_scaling")
        fields.append(ConfigField("logits_scaling", sc.logits_value))
    elif sc.logits == "multiply":
        post.append("logits = logits * self.config.logit_scale")
        fields.append(ConfigField("logit_scale", sc.logits_value))
    if sc.final_softcap is not None:
        post.append(
            lines(
                "logits = logits / self.config.final_logit_softcapping",
                "logits = torch.tanh(logits) * self.config.final_logit_softcapping",
            )
        )
        fields.append(ConfigField("final_logit_softcapping", sc.final_softcap))
    forward = lines(
        f"outputs = self.{naming.backbone}(",
        "    input_ids=input_ids,",
        "    attention_mask=attention_mask,",
        "    position_ids=position_ids,",
        "    inputs_embeds=inputs_embeds,",
        ")",
        f"logits = self.{naming.head}(outputs.last_hidden_state)",
        *post,
        "loss = None",
        "if labels is not None:",
        "    loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)",
        "return CausalLMOutputWithPast(loss=loss, logits=logits)",
    )
    code = (
        "class PREFIXForCausalLM(PREFIXPreTrainedModel, GenerationMixin):\n"
        + tied
        + "    def __init__(self, config: PREFIXConfig):\n"
        + indent(
            lines(
                "super().__init__(config)",
                f"self.{naming.backbone} = PREFIXModel(config)",
                "self.vocab_size = config.vocab_size",
                f"self.{naming.head} = nn.Linear(config.hidden_size, config.vocab_size, bias=False)",
                "self.post_init()",
            ),
            2,
        )
        + "\n\n    def get_input_embeddings(self):\n"
        + f"        return self.{naming.backbone}.get_input_embeddings()\n"
        + "\n    def set_input_embeddings(self, value):\n"
        + f"        self.{naming.backbone}.set_input_embeddings(value)\n"
        + "\n    def get_output_embeddings(self):\n"
        + f"        return self.{naming.head}\n"
        + "\n    def set_output_embeddings(self, new_embeddings):\n"
        + f"        self.{naming.head} = new_embeddings\n"
        + "\n    def forward(\n"
        + "        self,\n"
        + "        input_ids=None,\n"
        + "        attention_mask=None,\n"
        + "        position_ids=None,\n"
        + "        inputs_embeds=None,\n"
        + "        labels=None,\n"
        + "        **kwargs,\n"
        + "    ):\n"
        + indent(forward, 2)
    )
    return code, fields


def model_piece(spec: FamilySpec, naming: NamingScheme, inits: list[tuple[str, str]]) -> Piece:
    stack_cls = "PREFIXDecoder" if naming.decoder else "PREFIXModel"
    stack, stack_fields = _stack(spec, naming, stack_cls)
    lm, lm_fields = _causal_lm(spec, naming)
    parts = [block(CAUSAL_MASK), _pretrained(spec, naming, inits), stack]
    if naming.decoder:
        parts.append(_decoder_wrapper(naming))
    parts.append(lm)
    parts.append('__all__ = ["PREFIXForCausalLM", "PREFIXModel", "PREFIXPreTrainedModel"]')
    imports = {
        "from typing import ClassVar",
        "from transformers import GenerationMixin, PreTrainedModel",
        "from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast",
    }
    if "init." in parts[1]:
        imports.add("from transformers import initialization as init")
    return Piece(code="\n\n\n".join(parts), imports=imports, fields=[*stack_fields, *lm_fields])
