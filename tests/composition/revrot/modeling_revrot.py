"""Revrot modeling (remote code, HF conventions): see ``configuration_revrot.py``.

A dense pre-norm decoder with q/k/v biases whose RoPE turns each pair the other way
(``rotate_half`` is ``(x2, -x1)``) over only the first ``partial_rotary_factor`` of each
head, with YaRN-scaled frequencies.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .configuration_revrot import RevrotConfig


class RevrotRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RevrotRotaryEmbedding(nn.Module):
    """cos/sin for the first ``rotary_dim`` features of each head, with the config's
    frequency scaling (``rope_parameters['rope_type']``, e.g. yarn) when it has one."""

    def __init__(self, config: RevrotConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        rope_init_fn = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs):
        base = config.rope_parameters["rope_theta"]
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    """Turns each pair the other way from transformers' rotate_half: (x1, x2) -> (x2, -x1)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Rotate the first ``cos.shape[-1]`` features of each head; the rest pass through."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_rot = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_rot = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def causal_mask(attention_mask, batch, seq_len, dtype, device):
    """Additive ``[batch, 1, q, k]`` mask: causal, plus padding from a 2D ``attention_mask``."""
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    allowed = allowed[None, None].expand(batch, 1, seq_len, seq_len)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].bool()
    mask = torch.zeros(batch, 1, seq_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class RevrotAttention(nn.Module):
    def __init__(self, config: RevrotConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        # q/k/v projections with biases, the output projection without (as in Qwen2).
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        bsz, q_len, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        key = repeat_kv(key, self.num_key_value_groups)
        value = repeat_kv(value, self.num_key_value_groups)
        if self.config._attn_implementation == "eager":
            weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
            if attention_mask is not None:
                weights = weights + attention_mask
            weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
            out = torch.matmul(weights, value)
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=self.scaling)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out)


class RevrotMLP(nn.Module):
    def __init__(self, config: RevrotConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RevrotDecoderLayer(nn.Module):
    def __init__(self, config: RevrotConfig, layer_idx: int):
        super().__init__()
        self.self_attn = RevrotAttention(config, layer_idx)
        self.mlp = RevrotMLP(config, config.intermediate_size)
        self.input_layernorm = RevrotRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RevrotRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, position_embeddings, attention_mask)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class RevrotPreTrainedModel(PreTrainedModel):
    config_class = RevrotConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["RevrotDecoderLayer"]
    _supports_sdpa = True


class RevrotModel(RevrotPreTrainedModel):
    def __init__(self, config: RevrotConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([RevrotDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RevrotRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RevrotRotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        **kwargs,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        bsz, seq_len, _ = inputs_embeds.shape
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0).expand(bsz, -1)
        mask = causal_mask(attention_mask, bsz, seq_len, inputs_embeds.dtype, inputs_embeds.device)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))


class RevrotForCausalLM(RevrotPreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RevrotConfig):
        super().__init__(config)
        self.model = RevrotModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        **kwargs,
    ):
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


__all__ = ["RevrotForCausalLM", "RevrotModel", "RevrotPreTrainedModel"]
