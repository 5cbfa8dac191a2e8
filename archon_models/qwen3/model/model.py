"""Qwen3: a pre-norm decoder with GQA, per-head QK RMSNorm, RoPE and SwiGLU or MoE MLPs, over packed documents."""

from __future__ import annotations

from typing import Any, Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from archon_models.attention import SDPAWrapper, VarlenAttentionWrapper
from archon_models.base import BaseArchonModel
from archon_models.moe import MoE
from archon_models.qwen3.model.args import Qwen3ModelArgs
from archon_models.qwen3.model.rope import apply_rotary_emb, precompute_rope_cache, repeat_kv
from archon_models.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

__all__ = ["Attention", "FeedForward", "Qwen3Model", "RMSNorm", "TransformerBlock"]


def maybe_to_local(x: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, else ``x``.

    Under tensor parallelism ``wq``/``wk`` keep DTensor outputs so that ``q_norm`` and
    ``k_norm`` run as sequence-parallel modules over the sharded heads; everything after
    them works on this rank's heads as plain tensors.
    """
    return x.to_local() if isinstance(x, DTensor) else x


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
    """Grouped-query self-attention with per-head QK RMSNorm and Ulysses sequence parallelism.

    ``q_norm``/``k_norm`` normalise each head's ``head_dim`` vector before RoPE. Under
    Ulysses (``set_cp_group`` with a group of size > 1) every rank holds a slice of the
    sequence; an all-to-all trades it for a slice of the heads over the whole sequence
    before attention, and back afterwards.
    """

    def __init__(self, model_args: Qwen3ModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.head_dim
        self.scaling = self.head_dim**-0.5

        bias = model_args.attention_bias
        self.wq = nn.Linear(model_args.dim, self.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, model_args.dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)

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
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq = maybe_to_local(self.q_norm(xq))
        xk = maybe_to_local(self.k_norm(xk))
        xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)

        if self._sp_enabled:
            # Every rank needs at least one kv head after the heads are scattered.
            if xk.shape[2] < self._cp_size:
                repeats = self._cp_size // xk.shape[2]
                xk, xv = repeat_kv(xk, repeats), repeat_kv(xv, repeats)
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
        out = out.transpose(1, 2).contiguous()

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


class TransformerBlock(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))`` where the MLP is dense or MoE.

    Exactly one of ``feed_forward`` and ``moe`` is set; ``moe_enabled`` says which.
    """

    def __init__(self, layer_id: int, model_args: Qwen3ModelArgs):
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


class Qwen3Model(BaseArchonModel):
    """Qwen3 decoder (dense or MoE) over packed documents: ``[1, T]`` tokens to ``[1, T, vocab]`` logits.

    A critic (``is_critic``) replaces ``output`` by ``score`` (``[1, T, num_labels]``).
    With ``enable_weight_tying`` the LM head shares the embedding's parameter.
    Pipeline stages set ``tok_embeddings``/``norm``/``output`` to ``None`` and drop
    layers; the forward then passes hidden states through.
    """

    def __init__(self, model_args: Qwen3ModelArgs):
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
        return precompute_rope_cache(self.model_args.head_dim, self.model_args.max_seq_len, self.model_args.rope_theta)

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
