"""Where a MoE block applies its routing weights: to what the experts return (the references'
``sum_e w_e * E_e(x)``) or to what they read (Llama 4's ``sum_e E_e(w_e * x)``, AReaL's
``MoEArgs.score_before_experts``). Experts are not linear, so the two differ.

Measured on the tiny model in one forward: the rows the MoE block reads and the rows its routed
experts read (the experts module's input, or each expert's when they are separate modules).
Every non-zero row an expert reads is compared with the block's rows: the same row means the
weights come after the experts; the same row times a factor other than one (Llama 4 multiplies
each token's copy by its sigmoid score, zero for the experts it does not route to) means they
come before. Rows that are neither (a norm or a projection in between) leave it unmeasured.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from skill.analysis import modules as mt
from skill.analysis import probes

logger = logging.getLogger(__name__)

_TOKENS = 9


def _read_rows(model: nn.Module, config: Any, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the block's input rows, the rows its routed experts read), both ``[n, hidden]``."""
    found = mt.experts_module(block)
    if found is None:
        return None
    experts = found[1]
    readers = list(experts.children()) if isinstance(experts, nn.ModuleList) else [experts]
    block_rows: list[torch.Tensor] = []
    expert_rows: list[torch.Tensor] = []

    def on_block(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = probes.input_tensor(args, kwargs)
        if x is not None and not block_rows:
            block_rows.append(x.detach().reshape(-1, x.shape[-1]))

    def on_expert(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = probes.input_tensor(args, kwargs)
        if x is not None and x.dim() >= 2:
            expert_rows.append(x.detach().reshape(-1, x.shape[-1]))

    handles = [block.register_forward_pre_hook(on_block, with_kwargs=True)]
    handles += [reader.register_forward_pre_hook(on_expert, with_kwargs=True) for reader in readers]
    try:
        with torch.no_grad():
            probes.logits(model, probes.tokens_for(config, _TOKENS))
    except Exception as exc:  # a remote-code forward raises several exception types
        logger.debug("the expert-input probe's forward failed: %s", exc)
        return None
    finally:
        for handle in handles:
            handle.remove()
    if not block_rows or not expert_rows or block_rows[0].shape[-1] != expert_rows[0].shape[-1]:
        return None
    return block_rows[0], torch.cat(expert_rows)


def scores_before_experts(model: nn.Module, config: Any, block: nn.Module | None) -> bool | None:
    """Whether ``block`` (the first MoE block of ``model``) scales its experts' input by the
    routing weights (True), their output (False), or ``None`` when the rows say neither."""
    if block is None:
        return None
    read = _read_rows(model, config, block)
    if read is None:
        return None
    inputs, rows = (t.double() for t in read)
    rows = rows[rows.abs().amax(dim=-1) > 0]
    if not len(rows):
        return None
    # Each row's best match among the block's rows: its cosine, and the factor along it.
    unit = inputs / inputs.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    cosine = (rows / rows.norm(dim=-1, keepdim=True)) @ unit.T
    best = cosine.argmax(dim=-1)
    if not bool((cosine.gather(1, best[:, None]) > 1 - 1e-9).all()):
        return None  # the experts read something else than scaled copies of the block's rows
    factors = (rows * inputs[best]).sum(-1) / (inputs[best] * inputs[best]).sum(-1)
    # Copies of the block's rows read unscaled: the weights come after the experts.
    return not bool(torch.allclose(factors, torch.ones_like(factors), rtol=0, atol=1e-9))
