"""Weights of the magnitudes real checkpoints have, for a generated family's folder.

Norm weights are drawn per module from 0.4 to 3, and for about a third of the block norms
from 10 to 120 (trained models hold both: Gemma's post-norms, OLMo's). Every projection
is scaled to the inputs it actually sees (measured with forward hooks, so a norm weight
of 100 feeding it is compensated as training would), its output a random multiple of
unit scale; the head is calibrated last so that the largest logit on random tokens is the
family's ``target_logit`` (8 to 30). Biases, sinks and the router's correction bias get
noise of their own: nothing is left at a value that would hide a swapped or dropped
tensor.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from transformers import PreTrainedModel

from tests.fuzz.naming import scheme_for
from tests.fuzz.spec import FamilySpec

logger = logging.getLogger(__name__)

SMALL_NORM = (0.4, 3.0)
LARGE_NORM = (10.0, 120.0)
LARGE_FRACTION = 0.3
CALIBRATION_TOKENS = 48


def _log_uniform(generator: torch.Generator, low: float, high: float) -> float:
    u = float(torch.rand((), generator=generator))
    return math.exp(math.log(low) + u * (math.log(high) - math.log(low)))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__


def _offset(module: nn.Module) -> bool:
    """Whether the module scales by ``1 + weight`` (its stored weight is the offset)."""
    return "ZeroCentered" in type(module).__name__ or "LayerNorm1P" in type(module).__name__


def _projection_weights(model: nn.Module) -> dict[str, tuple[nn.Module, list[str]]]:
    """Modules whose weights read an input we can measure: name -> (module, its weight params)."""
    found: dict[str, tuple[nn.Module, list[str]]] = {}
    for name, module in model.named_modules():
        if _is_norm(module) or isinstance(module, nn.Embedding):
            continue
        if isinstance(module, nn.Linear):
            found[name] = (module, ["weight"])
        elif isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
            found[name] = (module, ["gate_up_proj", "down_proj"])
        elif isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.dim() == 2:
            found[name] = (module, ["weight"])  # a router module of its own
    return found


def _measure_inputs(model: nn.Module, modules: dict, tokens: torch.Tensor) -> dict[str, float]:
    """The RMS of the first input each module sees on ``tokens``."""
    seen: dict[str, list[float]] = {}
    handles = []
    for name, (module, _) in modules.items():

        def hook(mod, args, name=name):
            if args and isinstance(args[0], torch.Tensor) and args[0].numel():
                seen.setdefault(name, []).append(float(args[0].detach().float().pow(2).mean().sqrt()))

        handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=tokens)
    finally:
        for handle in handles:
            handle.remove()
    return {name: max(values) for name, values in seen.items()}


def _fan_in(param: torch.Tensor, name: str, module: nn.Module) -> int:
    if param.dim() == 3:
        # (E, out, in) or (E, in, out): the side that is not the hidden size for down, ...
        hidden = getattr(module, "hidden_dim", None)
        inter = getattr(module, "intermediate_dim", None)
        if name == "gate_up_proj":
            return int(hidden or param.shape[-1])
        return int(inter or param.shape[-1])
    return int(param.shape[-1])


def set_realistic_weights(model: PreTrainedModel, spec: FamilySpec) -> float:
    """Overwrite every weight of ``model`` in place; returns the largest |logit| reached."""
    generator = torch.Generator().manual_seed(10_000 + spec.seed)
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head.weight is embedding.weight
    final_norm = _final_norm(model, spec)
    with torch.no_grad():
        embedding.weight.copy_(
            torch.randn(embedding.weight.shape, generator=generator) * _log_uniform(generator, 0.5, 2.0)
        )
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding) and module is not embedding:
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.5)
            if not _is_norm(module):
                continue
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                qk = "q_" in name.rsplit(".", 1)[-1] or "k_" in name.rsplit(".", 1)[-1] or "_a_" in name
                large = not qk and float(torch.rand((), generator=generator)) < LARGE_FRACTION
                scale = _log_uniform(generator, *(LARGE_NORM if large else SMALL_NORM))
                values = scale * torch.exp(0.2 * torch.randn(weight.shape, generator=generator))
                weight.copy_(values - 1.0 if _offset(module) else values)
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.copy_(0.1 * scale * torch.randn(bias.shape, generator=generator))
        for name, param in model.named_parameters():
            if name.endswith("bias") and param.dim() == 1 and not _belongs_to_norm(model, name):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.rsplit(".", 1)[-1].startswith("lambda_"):
                # Differential attention's vectors: lambda's two exponentials well apart from 1.
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Non-negative, as the router's scores are: a negative choice score would lose to
                # the 0.0 that HF's grouped routing writes over the dropped groups, and which of
                # those tied experts wins is up to topk's tie-breaking (DeepSeek-V3's quirk).
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator).abs())

        # Unit-variance draws once; then three passes scale each projection to its measured input.
        modules = {n: m for n, m in _projection_weights(model).items() if m[0] is not head}
        noise = {
            (n, p): torch.randn(getattr(m, p).shape, generator=generator)
            for n, (m, params) in modules.items()
            for p in params
        }
        gains = {key: _log_uniform(generator, 0.5, 2.0) for key in noise}
        for n, (m, params) in modules.items():
            if "gate" in n.rsplit(".", 1)[-1] and getattr(m, "weight", None) is not None and m.weight.shape[0] <= 16:
                for p in params:
                    gains[(n, p)] = _log_uniform(generator, 1.5, 4.0)  # routers decide, not hesitate
        tokens = torch.randint(0, spec.vocab_size, (2, CALIBRATION_TOKENS), generator=generator)
        if spec.pad_token_id is not None:
            tokens[tokens == spec.pad_token_id] = spec.pad_token_id + 1
        if not tied:
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) / math.sqrt(head.weight.shape[-1]))
        for _ in range(3):
            rms = _measure_inputs(model, modules, tokens)
            for n, (m, params) in modules.items():
                seen = rms.get(n, 1.0) or 1.0
                for p in params:
                    param = getattr(m, p)
                    std = (
                        gains[(n, p)] / (seen * math.sqrt(_fan_in(param, p, m)))
                        if p != "down_proj"
                        else (gains[(n, p)] / math.sqrt(_fan_in(param, p, m)))
                    )
                    param.copy_(noise[(n, p)] * std)
        return _calibrate_logits(model, spec, tokens, head, embedding, tied, final_norm)


def _belongs_to_norm(model: nn.Module, param_name: str) -> bool:
    owner = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    return _is_norm(owner)


def _final_norm(model: nn.Module, spec: FamilySpec) -> nn.Module | None:
    naming = scheme_for(spec)
    if not spec.norm.final_norm:
        return None
    return model.get_submodule(f"{naming.stack_path}.{naming.final_norm}")


def _calibrate_logits(model, spec, tokens, head, embedding, tied, final_norm) -> float:  # type: ignore[no-untyped-def]
    """Scale the tensor that sets the logits' size until the largest |logit| is the target."""
    weight = getattr(final_norm, "weight", None) if final_norm is not None else None
    reached = 0.0
    for _ in range(4):
        with torch.no_grad():
            reached = float(model(input_ids=tokens).logits.abs().max())
        if not math.isfinite(reached) or reached == 0.0:
            raise ValueError(f"seed {spec.seed}: logits are {reached} before calibration")
        factor = spec.target_logit / reached
        if abs(factor - 1.0) < 0.02:
            break
        with torch.no_grad():
            if not tied:
                head.weight.mul_(factor)
            elif isinstance(weight, torch.Tensor):
                if _offset(final_norm):
                    weight.copy_((weight + 1.0) * factor - 1.0)
                else:
                    weight.mul_(factor)
                bias = getattr(final_norm, "bias", None)
                if isinstance(bias, torch.Tensor):
                    bias.mul_(factor)
            else:
                embedding.weight.mul_(factor)
    logger.debug("seed %d: largest |logit| %.2f (target %.1f)", spec.seed, reached, spec.target_logit)
    return reached
