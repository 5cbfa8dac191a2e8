"""Epsmoe modeling (remote code, HF conventions): see ``configuration_epsmoe.py``.

Per layer: ``h = x + m * post_attention_layernorm(attn(input_layernorm(x)))`` and
``out = h + m * post_feedforward_layernorm(moe(pre_feedforward_layernorm(h)))`` with
``m = config.residual_multiplier``. The attention normalises q and k over all heads at
once (before the heads split and RoPE); the MoE routes each token to its top-k experts
by softmax scores, renormalised when ``norm_topk_prob``. The four block norms are built with
a constant ``eps=1e-5``; only the final norm and the QK norms read ``config.rms_norm_eps``.
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

from .configuration_epsmoe import EpsmoeConfig


class EpsmoeRMSNorm(nn.Module):
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


class EpsmoeRotaryEmbedding(nn.Module):
    def __init__(self, config: EpsmoeConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs):
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


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


class EpsmoeAttention(nn.Module):
    def __init__(self, config: EpsmoeConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(
            config.hidden_size,
            self.num_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.k_proj = nn.Linear(
            config.hidden_size,
            self.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.v_proj = nn.Linear(
            config.hidden_size,
            self.num_key_value_heads * self.head_dim,
            bias=config.attention_bias,
        )
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
        )
        # Full-width QK norm: over all heads of the projection at once.
        self.q_norm = EpsmoeRMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = EpsmoeRMSNorm(self.num_key_value_heads * self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        bsz, q_len, _ = hidden_states.shape
        query = self.q_norm(self.q_proj(hidden_states)).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states)).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
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


class EpsmoeMLP(nn.Module):
    def __init__(self, config: EpsmoeConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class EpsmoeSparseMoeBlock(nn.Module):
    def __init__(self, config: EpsmoeConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([EpsmoeMLP(config, config.moe_intermediate_size) for _ in range(self.num_experts)])

    def forward(self, hidden_states):
        bsz, seq_len, hidden = hidden_states.shape
        flat = hidden_states.view(-1, hidden)
        router_logits = self.gate(flat)
        routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        for expert_idx in range(self.num_experts):
            token_idx, slot = torch.where(selected == expert_idx)
            if token_idx.numel() == 0:
                continue
            expert_out = self.experts[expert_idx](flat[token_idx]) * routing_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, expert_out)
        return out.view(bsz, seq_len, hidden)


class EpsmoeDecoderLayer(nn.Module):
    def __init__(self, config: EpsmoeConfig, layer_idx: int):
        super().__init__()
        self.self_attn = EpsmoeAttention(config, layer_idx)
        self.mlp = EpsmoeSparseMoeBlock(config)
        self.input_layernorm = EpsmoeRMSNorm(config.hidden_size, eps=1e-5)
        self.post_attention_layernorm = EpsmoeRMSNorm(config.hidden_size, eps=1e-5)
        self.pre_feedforward_layernorm = EpsmoeRMSNorm(config.hidden_size, eps=1e-5)
        self.post_feedforward_layernorm = EpsmoeRMSNorm(config.hidden_size, eps=1e-5)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states * self.residual_multiplier

        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        return residual + hidden_states * self.residual_multiplier


class EpsmoePreTrainedModel(PreTrainedModel):
    config_class = EpsmoeConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["EpsmoeDecoderLayer"]
    _supports_sdpa = True


class EpsmoeModel(EpsmoePreTrainedModel):
    def __init__(self, config: EpsmoeConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([EpsmoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = EpsmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = EpsmoeRotaryEmbedding(config)
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


class EpsmoeForCausalLM(EpsmoePreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: EpsmoeConfig):
        super().__init__(config)
        self.model = EpsmoeModel(config)
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


__all__ = ["EpsmoeForCausalLM", "EpsmoeModel", "EpsmoePreTrainedModel"]
