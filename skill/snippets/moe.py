"""MoE layers a family may need instead of the shared one."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from archon_models.moe import MoE, MoEArgs


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
