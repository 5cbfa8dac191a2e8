"""Qwen3.5 (text): a hybrid pre-norm decoder whose layers mix tokens either by gated full
attention or by a Gated DeltaNet (linear attention), over packed documents."""

from __future__ import annotations

from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

from archon_models.attention import SDPAWrapper, VarlenAttentionWrapper
from archon_models.base import BaseArchonModel
from archon_models.moe import MoE
from archon_models.qwen3.model.model import FeedForward
from archon_models.qwen3_5.model.args import Qwen3_5ModelArgs
from archon_models.qwen3_5.model.gated_delta import causal_conv_silu, gated_delta_rule
from archon_models.qwen3_5.model.rope import apply_rotary_emb, precompute_rope_cache, repeat_kv

__all__ = [
    "FeedForward",
    "GatedAttention",
    "GatedDeltaNet",
    "Qwen3_5Model",
    "Qwen3_5RMSNorm",
    "Qwen3_5RMSNormGated",
    "TransformerBlock",
]


class Qwen3_5RMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight`` (the weight starts at zero), computed in fp32 and cast
    back, as HF's ``Qwen3_5RMSNorm``: the layer norms, the final norm and ``q_norm``/``k_norm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(input_dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class Qwen3_5RMSNormGated(nn.Module):
    """``weight * rmsnorm(x) * silu(gate)`` over each value head (the Gated DeltaNet's output
    norm; the weight starts at one). The norm is cast back before the weight, the gate is
    applied in fp32, as HF's ``Qwen3_5RMSNormGated``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(input_dtype)
        return (h * F.silu(gate.float())).to(input_dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer (HF's ``Qwen3_5GatedDeltaNet``), over packed documents.

    ``in_proj_qkv`` feeds a causal depthwise convolution (``conv1d``, no bias) with silu,
    whose output splits into queries, keys (``linear_num_key_heads`` each) and values
    (``linear_num_value_heads``); each key head serves ``n_v / n_k`` consecutive value
    heads. Per token and value head, ``beta = sigmoid(in_proj_b(x))`` and the log decay
    ``g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)`` drive the gated delta rule
    (:mod:`archon_models.qwen3_5.model.gated_delta`); its output is normalised per value
    head and gated by ``silu(in_proj_z(x))``, then projected back by ``out_proj``.
    """

    def __init__(self, model_args: Qwen3_5ModelArgs):
        super().__init__()
        self.num_k_heads = model_args.linear_num_key_heads
        self.num_v_heads = model_args.linear_num_value_heads
        self.head_k_dim = model_args.linear_key_head_dim
        self.head_v_dim = model_args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        dim = model_args.dim

        self.in_proj_qkv = nn.Linear(dim, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, self.num_v_heads, bias=False)
        kernel = model_args.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, padding=kernel - 1, bias=False)
        # Bare parameters: their checkpoint keys have no ".weight".
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = Qwen3_5RMSNormGated(self.head_v_dim, eps=model_args.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)
        self._init_decay()

    def _init_decay(self) -> None:
        with torch.no_grad():
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())

    def init_weights(self, init_std: float) -> None:
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std)
        self.conv1d.reset_parameters()
        self.norm.reset_parameters()
        self._init_decay()

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        mixed = causal_conv_silu(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight.squeeze(1), cu_seqlens)
        q, k, v = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(bs, seqlen, self.num_k_heads, self.head_k_dim)
        k = k.reshape(bs, seqlen, self.num_k_heads, self.head_k_dim)
        v = v.reshape(bs, seqlen, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if self.num_v_heads > self.num_k_heads:
            group = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        out = gated_delta_rule(q, k, v, g, beta, cu_seqlens)
        z = self.in_proj_z(x).reshape(bs, seqlen, self.num_v_heads, self.head_v_dim)
        out = self.norm(out, z).reshape(bs, seqlen, self.value_dim)
        return self.out_proj(out)


class GatedAttention(nn.Module):
    """Grouped-query attention with an output gate (HF's ``Qwen3_5Attention``).

    ``wq`` gives each head ``2 * head_dim`` features: the query, then a gate; the attention
    output is multiplied by ``sigmoid(gate)`` before ``wo``. Queries and keys get the
    ``(1 + w)`` RMSNorm per head, then RoPE on their first ``rotary_dim`` features.
    """

    def __init__(self, model_args: Qwen3_5ModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.head_dim
        self.scaling = self.head_dim**-0.5

        bias = model_args.attention_bias
        self.wq = nn.Linear(model_args.dim, self.n_heads * self.head_dim * 2, bias=bias)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, model_args.dim, bias=bias)
        self.q_norm = Qwen3_5RMSNorm(self.head_dim, eps=model_args.norm_eps)
        self.k_norm = Qwen3_5RMSNorm(self.head_dim, eps=model_args.norm_eps)

        if model_args.attn_type == "varlen":
            self.packed_attn: nn.Module = VarlenAttentionWrapper()
        elif model_args.attn_type == "sdpa":
            self.packed_attn = SDPAWrapper()
        else:
            raise ValueError(f"attn_type must be 'varlen' or 'sdpa', got {model_args.attn_type!r}.")

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, gate = torch.chunk(self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim), 2, dim=-1)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(self.q_norm(xq), self.k_norm(xk), rope_cache, positions)
        if self.n_rep > 1:
            xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        out = self.packed_attn(
            xq.transpose(1, 2),
            xk.transpose(1, 2),
            xv.transpose(1, 2),
            scale=self.scaling,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        out = out.transpose(1, 2).reshape(bs, seqlen, -1) * torch.sigmoid(gate.reshape(bs, seqlen, -1))
        return self.wo(out)


class TransformerBlock(nn.Module):
    """``x + mixer(norm(x))``, then ``x + mlp(norm(x))``; the mixer is ``attention`` on a
    ``"full_attention"`` layer and ``linear_attn`` on a ``"linear_attention"`` one (the
    other is ``None``), as in AReaL's hybrid model. The MLP is ``moe`` on a layer the args' ``is_moe_layer``
    names (``moe_enabled``), else ``feed_forward`` (the other is ``None``)."""

    def __init__(self, layer_id: int, model_args: Qwen3_5ModelArgs):
        super().__init__()
        self.layer_type = model_args.layer_types[layer_id]
        self.attention: GatedAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if self.layer_type == "full_attention":
            self.attention = GatedAttention(model_args)
        else:
            self.linear_attn = GatedDeltaNet(model_args)
        self.attention_norm = Qwen3_5RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = Qwen3_5RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.moe_enabled = model_args.is_moe_layer(layer_id)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if self.moe_enabled:
            assert model_args.moe_args is not None
            self.moe = MoE(model_args.moe_args, dim=model_args.dim, hidden_dim=model_args.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(model_args.dim, model_args.hidden_dim)
        # Depth-scaled init keeps the residual stream's variance bounded in deep stacks.
        depth = layer_id + 1 if model_args.depth_init else model_args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        h = self.attention_norm(x)
        if self.attention is not None:
            x = x + self.attention(h, rope_cache, positions, cu_seqlens, max_seqlen)
        else:
            assert self.linear_attn is not None
            x = x + self.linear_attn(h, cu_seqlens)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return x + mlp(self.ffn_norm(x))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        mixer = self.attention if self.attention is not None else self.linear_attn
        assert mixer is not None
        mixer.init_weights(self.weight_init_std)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        mlp.init_weights(self.weight_init_std)

    def init_buffers(self, buffer_device: torch.device | str) -> None:
        if self.moe is not None:
            self.moe.init_buffers(buffer_device)


class Qwen3_5Model(BaseArchonModel):
    """Qwen3.5 hybrid decoder over packed documents: ``[1, T]`` tokens to ``[1, T, vocab]`` logits.

    A critic (``is_critic``) replaces ``output`` by ``score`` (``[1, T, num_labels]``).
    With ``enable_weight_tying`` the LM head shares the embedding's parameter.
    Pipeline stages set ``tok_embeddings``/``norm``/``output`` to ``None`` and drop
    layers; the forward then passes hidden states through.
    """

    # Parallelisms this package's parallelize_qwen3_5 does not apply, and why (AReaL's hybrid
    # model applies neither).
    unsupported_parallelisms: ClassVar[dict[str, str]] = {
        "tp": "the Gated DeltaNet layers have no tensor-parallel plan (nor does AReaL's hybrid model)",
        "cp": "the Gated DeltaNet layers have no context-parallel plan (nor does AReaL's hybrid model)",
        "ep": "parallelize_qwen3_5 applies no expert parallelism (nor does AReaL's hybrid model)",
        "ep_tp": "parallelize_qwen3_5 applies no expert or tensor parallelism (nor does AReaL's hybrid model)",
    }

    def __init__(self, model_args: Qwen3_5ModelArgs):
        super().__init__()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.eos_id = model_args.eos_id
        self.head_dim = model_args.head_dim
        self.is_critic = model_args.is_critic

        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            model_args.vocab_size, model_args.dim, padding_idx=model_args.pad_id
        )
        self.register_buffer("rope_cache", self._precompute_rope_cache(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(layer_id): TransformerBlock(layer_id, model_args) for layer_id in range(model_args.n_layers)}
        )
        self.norm: Qwen3_5RMSNorm | None = Qwen3_5RMSNorm(model_args.dim, eps=model_args.norm_eps)

        self.output: nn.Linear | None = None
        self.score: nn.Linear | None = None
        if model_args.is_critic:
            self.score = nn.Linear(model_args.dim, model_args.num_labels, bias=False)
        else:
            self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self._tie_weights()

    def _tie_weights(self) -> None:
        """Share the embedding's parameter with the LM head when the checkpoint ties them."""
        if self.model_args.enable_weight_tying and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Self:
        """Materialise every tensor on ``device``, uninitialised, with the LM head still tied."""
        super().to_empty(device=device, recurse=recurse)
        self._tie_weights()
        return self

    def _precompute_rope_cache(self) -> torch.Tensor:
        args = self.model_args
        return precompute_rope_cache(args.head_dim, args.max_seq_len, args.partial_rotary_factor, args.rope_theta)

    def init_weights(self) -> None:
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        std = self.model_args.dim**-0.5
        tied = self.output is not None and self.model_args.enable_weight_tying
        for head in (None if tied else self.output, self.score):
            if head is not None:
                nn.init.trunc_normal_(head.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def init_buffers(self, buffer_device: torch.device | str) -> None:
        with torch.device(buffer_device):
            self.rope_cache = self._precompute_rope_cache()
        for layer in self.layers.values():
            layer.init_buffers(buffer_device)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | torch.Tensor,
        tree_attn_meta: Any | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[1, T]`` (hidden states ``[1, T, dim]`` on a later pipeline stage)."""
        if tree_attn_meta is not None:
            raise ValueError("Tree attention is not implemented in archon_models; pass tree_attn_meta=None.")
        # Pipeline schedules hand micro-batch metadata over as tensors with a batch dim.
        if cu_seqlens.ndim == 2:
            cu_seqlens = cu_seqlens.squeeze(0)
        if isinstance(max_seqlen, torch.Tensor):
            max_seqlen = int(max_seqlen.item())

        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, cu_seqlens, max_seqlen)
        h = self.norm(h) if self.norm is not None else h
        head = self.score if self.is_critic else self.output
        return head(h) if head is not None else h
