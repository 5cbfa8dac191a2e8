"""DeepSeek-V3: a pre-norm decoder with multi-head latent attention, RoPE and SwiGLU or MoE MLPs, packed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from archon_models.attention import SDPAWrapper, VarlenAttentionWrapper
from archon_models.base import BaseArchonModel
from archon_models.deepseek_v3.model.args import DeepseekV3ModelArgs
from archon_models.deepseek_v3.model.rope import (
    apply_interleaved_rotary_emb,
    apply_rotary_emb,
    precompute_rope_cache,
    yarn_mscale,
)
from archon_models.moe import MoE, MoEArgs
from archon_models.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

__all__ = ["Attention", "CorrectionBiasMoE", "DeepseekV3Model", "FeedForward", "RMSNorm", "TransformerBlock"]

# HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled by ``weight`` after casting back (as HF does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Multi-head latent attention (MLA) with Ulysses sequence parallelism.

    Queries: ``wq(x)``, or with ``q_lora_rank`` the low-rank path
    ``wq_b(q_norm(wq_a(x)))``; each head is ``[q_nope | q_pe]``
    (``qk_nope_head_dim + qk_rope_head_dim``). Keys and values: ``wkv_a(x)`` gives a
    ``kv_lora_rank`` latent and one ``qk_rope_head_dim`` RoPE key ``k_pe`` shared by
    every head; ``wkv_b(kv_norm(latent))`` expands the latent into each head's
    ``[k_nope | v]``. Keys are ``[k_nope | rope(k_pe)]``; only ``q_pe``/``k_pe`` are
    rotated. The softmax scale is ``qk_head_dim ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim) ** 2`` when the RoPE is YaRN with ``mscale_all_dim``.

    ``k_pe_broadcast`` is an identity that marks where the shared RoPE key meets the
    per-head computation: under tensor parallelism each rank holds some of the heads,
    so the gradient reaching ``k_pe`` there is a partial sum, and the TP plan turns
    this module into the all-reduce that completes it.

    Value heads narrower than query/key heads are zero-padded for the attention kernel
    (flash kernels take one head width) and cut back afterwards.
    """

    def __init__(self, model_args: DeepseekV3ModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.q_lora_rank = model_args.q_lora_rank
        self.kv_lora_rank = model_args.kv_lora_rank
        self.qk_nope_head_dim = model_args.qk_nope_head_dim
        self.qk_rope_head_dim = model_args.qk_rope_head_dim
        self.qk_head_dim = model_args.qk_head_dim
        self.v_head_dim = model_args.v_head_dim
        self.rope_interleave = model_args.rope_interleave

        self.scaling = self.qk_head_dim**-0.5
        yarn = model_args.yarn
        if yarn is not None and yarn.mscale_all_dim:
            self.scaling *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2

        bias = model_args.attention_bias
        dim = model_args.dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if self.q_lora_rank is None:
            self.wq = nn.Linear(dim, self.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, self.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, dim, bias=bias)
        self.k_pe_broadcast = nn.Identity()

        if model_args.attn_type == "varlen":
            self.packed_attn: nn.Module = VarlenAttentionWrapper()
        elif model_args.attn_type == "sdpa":
            self.packed_attn = SDPAWrapper()
        else:
            raise ValueError(f"attn_type must be 'varlen' or 'sdpa', got {model_args.attn_type!r}.")

        self._cp_group: ProcessGroup | None = None
        self._cp_size: int = 1
        self._cp_rank: int = 0

    def set_cp_group(self, cp_group: ProcessGroup | None) -> None:
        """Enable Ulysses sequence parallelism over ``cp_group`` (``None`` disables it)."""
        self._cp_group = cp_group
        self._cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        self._cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0

    @property
    def _sp_enabled(self) -> bool:
        return self._cp_group is not None and self._cp_size > 1

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for linear in (self.wq_a, self.wkv_a, self.wo):
            if linear is not None and linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = q.view(bs, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        latent, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = self.k_pe_broadcast(k_pe.unsqueeze(2))  # [bs, seq, 1, rope]: one key for all heads
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        rotary = apply_interleaved_rotary_emb if self.rope_interleave else apply_rotary_emb
        q_pe, k_pe = rotary(q_pe, k_pe, rope_cache, positions)

        n_local_heads = q_nope.shape[2]
        xq = torch.cat([q_nope, q_pe], dim=-1)
        xk = torch.cat([k_nope, k_pe.expand(-1, -1, n_local_heads, -1)], dim=-1)
        xv = v
        if self.v_head_dim != self.qk_head_dim:
            xv = F.pad(xv, (0, self.qk_head_dim - self.v_head_dim))

        if self._sp_enabled:
            full_len = seqlen * self._cp_size
            xq, xk, xv = (
                gather_seq_scatter_heads(t, seq_dim=1, head_dim=2, unpadded_dim_size=full_len, group=self._cp_group)
                for t in (xq, xk, xv)
            )
            seqlen = xq.shape[1]

        out = self.packed_attn(
            xq.transpose(1, 2),
            xk.transpose(1, 2),
            xv.transpose(1, 2),
            scale=self.scaling,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        out = out.transpose(1, 2)[..., : self.v_head_dim].contiguous()

        if self._sp_enabled:
            out = gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=self._cp_group)
            seqlen = out.shape[1]

        return self.wo(out.view(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP ``w2(silu(w1(x)) * w3(x))``; ``w1`` is HF's gate_proj, ``w3`` up_proj, ``w2`` down_proj."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class CorrectionBiasMoE(MoE):
    """The shared MoE whose router adds the checkpoint's score-correction bias (HF's
    ``e_score_correction_bias``) to the scores that choose experts, not to their weights.

    The bias is ``expert_bias``, a saved fp32 buffer registered when the layer is built (on
    the meta device too), so the checkpoint loads into it in any order: AReaL's engine loads
    the weights before it calls ``init_buffers``, which keeps the loaded bias (on the buffer
    device); ``init_weights`` zeroes it, as HF initialises it. Like HF's
    ``_keep_in_fp32_modules``, it stays fp32 when the model is cast to another dtype.

    Training leaves the bias as loaded unless ``load_balance_coeff`` is set: AReaL's switch
    for auxiliary-loss-free load balancing, for a trainer that moves ``expert_bias`` by the
    counts in ``tokens_per_expert``. (AReaL 1.0.4's engine has no such step.) The shared MoE
    would then zero the bias in ``init_buffers``; this one keeps the checkpoint's to start from.
    """

    expert_bias: torch.Tensor

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__(moe_args, dim, hidden_dim)
        device = self.router.gate.weight.device
        self._set_expert_bias(torch.zeros(moe_args.num_experts, dtype=torch.float32, device=device))

    def _set_expert_bias(self, bias: torch.Tensor) -> None:
        if hasattr(self, "expert_bias"):
            del self.expert_bias  # what the shared MoE set: None, or zeros when balancing
        self.register_buffer("expert_bias", bias, persistent=True)

    def init_weights(self, init_std: float = 0.02) -> None:
        super().init_weights(init_std)
        with torch.no_grad():
            self.expert_bias.zero_()

    def init_buffers(self, buffer_device: torch.device | str | None) -> None:
        # None while the shared MoE's own constructor builds its buffers.
        bias = getattr(self, "expert_bias", None)
        super().init_buffers(buffer_device)
        if bias is not None:
            self._set_expert_bias(bias.to(self.tokens_per_expert.device))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        bias = self._buffers.get("expert_bias")
        super()._apply(fn, recurse)
        moved = self._buffers.get("expert_bias")
        if bias is not None and moved is not None and moved.dtype != bias.dtype:
            # Moved, not cast: the scores that choose experts keep the checkpoint's fp32 bias.
            self._buffers["expert_bias"] = bias.to(moved.device)
        return self


class TransformerBlock(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))`` where the MLP is dense or MoE.

    Exactly one of ``feed_forward`` and ``moe`` is set; ``moe_enabled`` says which, by the
    args' ``is_moe_layer`` (HF's rule). Dense MLPs are ``hidden_dim`` wide, experts ``moe_inter_dim``.
    """

    def __init__(self, layer_id: int, model_args: DeepseekV3ModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.dim = model_args.dim
        self.attention = Attention(model_args)
        self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)

        self.moe_enabled = model_args.is_moe_layer(layer_id)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if self.moe_enabled:
            assert model_args.moe_args is not None
            self.moe = CorrectionBiasMoE(model_args.moe_args, dim=model_args.dim, hidden_dim=model_args.moe_inter_dim)
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
        x = x + self.attention(self.attention_norm(x), rope_cache, positions, cu_seqlens, max_seqlen)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return x + mlp(self.ffn_norm(x))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        mlp.init_weights(self.weight_init_std)

    def init_buffers(self, buffer_device: torch.device | str) -> None:
        if self.moe is not None:
            self.moe.init_buffers(buffer_device)


class DeepseekV3Model(BaseArchonModel):
    """DeepSeek-V3 decoder over packed documents: ``[1, T]`` tokens to ``[1, T, vocab]`` logits.

    A critic (``is_critic``) replaces ``output`` by ``score`` (``[1, T, num_labels]``).
    With ``enable_weight_tying`` the LM head shares the embedding's parameter.
    Pipeline stages set ``tok_embeddings``/``norm``/``output`` to ``None`` and drop
    layers; the forward then passes hidden states through.
    """

    def __init__(self, model_args: DeepseekV3ModelArgs):
        super().__init__()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.eos_id = model_args.eos_id
        self.is_critic = model_args.is_critic

        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            model_args.vocab_size, model_args.dim, padding_idx=model_args.pad_id
        )
        self.register_buffer("rope_cache", self._precompute_rope_cache(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(layer_id): TransformerBlock(layer_id, model_args) for layer_id in range(model_args.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(model_args.dim, eps=model_args.norm_eps)

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
        """Materialise every tensor on ``device``, uninitialised, with the LM head still tied.

        ``nn.Module.to_empty`` gives every module a new parameter of its own, which unties
        the head that the constructor (and AReaL's parallelize) tied; AReaL's engine then
        loads the checkpoint without :meth:`init_weights`, so the tie is restored here.
        """
        super().to_empty(device=device, recurse=recurse)
        self._tie_weights()
        return self

    def _precompute_rope_cache(self) -> torch.Tensor:
        args = self.model_args
        return precompute_rope_cache(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.yarn)

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
