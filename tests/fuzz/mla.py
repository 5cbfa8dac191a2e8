"""Multi-head latent attention, as DeepSeek-V3's remote code and transformers write it.

Queries through a low-rank latent (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``) or
one projection (``q_lora_rank`` None, DeepSeek-V2-Lite); keys and values through a shared
latent plus one RoPE key for all heads (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` ->
``kv_b_proj``). The config carries ``head_dim`` (transformers' DeepSeek-V3 config sets it
to ``qk_rope_head_dim``) or not (DeepSeek-V3's own ``config.json``). YaRN scales the
softmax by ``mscale ** 2``.
"""

from __future__ import annotations

from tests.fuzz.source import ConfigField, Piece, block
from tests.fuzz.spec import FamilySpec

_MLA = """
    def yarn_get_mscale(scale=1, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0


    class PREFIXAttention(nn.Module):
        def __init__(self, config: PREFIXConfig, layer_idx: int):
            super().__init__()
            self.config = config
            self.layer_idx = layer_idx
            self.num_heads = config.num_attention_heads
            self.num_key_value_groups = 1
            self.q_lora_rank = config.q_lora_rank
            self.kv_lora_rank = config.kv_lora_rank
            self.qk_rope_head_dim = config.qk_rope_head_dim
            self.qk_nope_head_dim = config.qk_nope_head_dim
            self.v_head_dim = config.v_head_dim
            self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            if self.q_lora_rank is None:
                self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.qk_head_dim, bias=False)
            else:
                self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
                self.q_a_layernorm = PREFIXRMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
                self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(
                config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.attention_bias
            )
            self.kv_a_layernorm = PREFIXRMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
            self.kv_b_proj = nn.Linear(
                self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
            )
            self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=config.attention_bias)
            self.scaling = self.qk_head_dim**-0.5
            rope_parameters = config.rope_parameters
            if rope_parameters.get("rope_type", "default") != "default":
                mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
                if mscale_all_dim:
                    mscale = yarn_get_mscale(rope_parameters["factor"], mscale_all_dim)
                    self.scaling = self.scaling * mscale * mscale

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            bsz, q_len, _ = hidden_states.shape
            query_shape = (bsz, q_len, -1, self.qk_head_dim)
            key_shape = (bsz, q_len, -1, self.qk_nope_head_dim + self.v_head_dim)
            if self.q_lora_rank is None:
                q_states = self.q_proj(hidden_states)
            else:
                q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
            q_states = q_states.view(query_shape).transpose(1, 2)
            q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

            compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
            k_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).view(key_shape).transpose(1, 2)
            k_pass, value_states = torch.split(k_pass, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k_rot = k_rot.view(bsz, 1, q_len, self.qk_rope_head_dim)

            cos, sin = position_embeddings
            if self.config.rope_interleave:
                q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
            else:
                q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
            k_rot = k_rot.expand(*k_pass.shape[:-1], -1)

            query_states = torch.cat((q_pass, q_rot), dim=-1)
            key_states = torch.cat((k_pass, k_rot), dim=-1)
            attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
            attn_output = torch.matmul(attn_weights, value_states)
            attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
            return self.o_proj(attn_output)
"""


def mla_piece(spec: FamilySpec) -> Piece:
    mla = spec.mla
    assert mla is not None
    fields = [
        ConfigField("q_lora_rank", mla.q_lora_rank),
        ConfigField("kv_lora_rank", mla.kv_lora_rank),
        ConfigField("qk_nope_head_dim", mla.qk_nope_head_dim),
        ConfigField("qk_rope_head_dim", mla.qk_rope_head_dim),
        ConfigField("v_head_dim", mla.v_head_dim),
        ConfigField("attention_bias", mla.attention_bias),
    ]
    if mla.head_dim_in_config:
        fields.append(ConfigField("head_dim", mla.qk_rope_head_dim))
    code = block(_MLA)
    return Piece(code=code, imports={"import math", "import torch.nn.functional as F"}, fields=fields)
