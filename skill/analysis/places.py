"""Where a norm inside a layer's module sits in the Archon module contract, measured on the HF model.

A norm inside the attention or the feed-forward (BitNet's ``attn_sub_norm`` and ``ffn_sub_norm``)
is placed by what it feeds: the tiny model runs once with hooks, and the projection whose input
*is* the norm's output (equal tensors, and as wide as the norm) is the statement it goes before.
The analysis reads that place twice: a norm there of the block norms' kind and epsilon is a
sub-norm the ``attention_sub_norm`` / ``ffn_sub_norm`` edits write; any other is a feature no edit
supports, and the place is where its hand edit goes. Its width follows from that projection's input width in the
Archon contract (``wo`` reads ``n_heads * head_dim``, ``w2`` reads ``hidden_dim``), not from the
feature's name. A norm an HF MoE block applies to its own output (A.X-K1's ``post_mlp_layernorm``
on the routed plus shared experts' sum) is placed at the block's MoE residual add, over ``dim``:
Archon's MoE module cannot hold it, since under TP its output is a partial sum until the module's
output step reduce-scatters it to the sequence shard. A norm feeding nothing the contract names
gets no place: the marker then falls back to the name's keywords
(:func:`skill.porting.edit_model.marker_place`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from skill.analysis import modules as mt
from skill.analysis import probes
from skill.features import HandEditPlace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContractInput:
    """A statement of the Archon contract that reads one projection's input."""

    class_name: str
    function: str
    anchor: str
    statement: str
    width: str  # the projection's input width, as Archon args

    @property
    def place(self) -> HandEditPlace:
        return HandEditPlace(
            class_name=self.class_name,
            function=self.function,
            anchor=self.anchor,
            statement=self.statement,
            width=self.width,
        )


# HF projection role -> the Archon statement that calls it.
ATTENTION_OUTPUT = ContractInput(
    "Attention", "forward", "self.wo(", "before the output projection wo", "n_heads * head_dim"
)
FFN_DOWN = ContractInput("FeedForward", "forward", "self.w2(", "before the down projection w2", "hidden_dim")


def norm_width(norm: nn.Module) -> int | None:
    weight = getattr(norm, "weight", None)
    return int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def norm_place(
    model: nn.Module, config: Any, norms: dict[str, nn.Module], consumers: dict[nn.Module, ContractInput]
) -> HandEditPlace | None:
    """The place of the hand edit that writes ``norms`` (named children of one module): the
    contract statement whose projection reads every one of their outputs, measured in one forward
    of the tiny ``model``; ``None`` when they feed no such projection, or different ones."""
    outputs: dict[str, torch.Tensor] = {}
    inputs: dict[nn.Module, torch.Tensor] = {}

    def keep_output(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            tensor = _first_tensor(output)
            if tensor is not None:
                outputs.setdefault(name, tensor.detach())

        return hook

    def keep_input(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            inputs.setdefault(module, args[0].detach())

    handles = [norm.register_forward_hook(keep_output(name)) for name, norm in norms.items()]
    handles += [module.register_forward_pre_hook(keep_input) for module in consumers]
    try:
        probes.logits(model, probes.tokens_for(config, 5))
    except Exception as exc:  # a forward the probe cannot run: no measured place
        logger.debug("measuring where %s sit failed: %s", ", ".join(norms), exc)
        return None
    finally:
        for handle in handles:
            handle.remove()
    places = set()
    for name, norm in norms.items():
        fed = [
            contract
            for module, contract in consumers.items()
            if name in outputs
            and module in inputs
            and inputs[module].shape == outputs[name].shape
            and torch.equal(inputs[module], outputs[name])
            and norm_width(norm) == inputs[module].shape[-1]
        ]
        if len(fed) != 1:
            return None
        places.add(fed[0])
    if len(places) != 1:
        return None
    return places.pop().place


# The MoE branch's residual add in ``TransformerBlock.forward``: the one statement that calls
# the pre-FFN norm ``ffn_norm`` (``return x + mlp(self.ffn_norm(x))`` in both references).
MOE_BRANCH_ADD = HandEditPlace(
    class_name="TransformerBlock",
    function="forward",
    anchor="self.ffn_norm(",
    statement="on the MoE's output, where the block adds it to the residual (on MoE layers only; "
    "inside Archon's MoE module its output is a partial sum under TP until the module's output step)",
    width="dim",
)


class _Recorder:
    """The first input and output of each watched module in one forward."""

    def __init__(self) -> None:
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        self.outputs: dict[nn.Module, torch.Tensor] = {}

    def hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self.inputs.setdefault(module, args[0].detach())
        tensor = _first_tensor(output)
        if tensor is not None:
            self.outputs.setdefault(module, tensor.detach())

    def run(self, model: nn.Module, config: Any, modules: list[nn.Module]) -> bool:
        handles = [module.register_forward_hook(self.hook) for module in modules]
        try:
            probes.logits(model, probes.tokens_for(config, 5))
        except Exception as exc:  # a forward the probe cannot run: no measured place
            logger.debug("measuring the MoE block's output norm failed: %s", exc)
            return False
        finally:
            for handle in handles:
                handle.remove()
        return True


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.numel() == b.numel() and torch.allclose(a.reshape(b.shape), b)


def moe_output_norm_place(
    model: nn.Module,
    config: Any,
    layer: nn.Module,
    moe: nn.Module,
    norm: nn.Module,
    branches: list[nn.Module],
) -> HandEditPlace | None:
    """The place of a norm the HF MoE block ``moe`` (in decoder ``layer``) applies to its own
    output, measured in one forward of the tiny ``model``: the norm's input is the sum of the
    MoE's ``branches`` (routed experts, shared experts), its output is the MoE's output, and the
    layer's output is the residual (the pre-FFN norm's input) plus that output. In Archon that is
    the block's MoE residual add (:data:`MOE_BRANCH_ADD`); ``None`` when any of it does not hold."""
    layer_norms = [child for child in layer.children() if child is not moe and mt.is_norm(child)]
    recorder = _Recorder()
    if not recorder.run(model, config, [layer, moe, norm, *branches, *layer_norms]):
        return None
    outputs, inputs = recorder.outputs, recorder.inputs
    if not _same(outputs.get(norm), outputs.get(moe)) or norm_width(norm) != outputs[moe].shape[-1]:
        return None
    parts = [outputs.get(branch) for branch in branches]
    if not parts or any(part is None for part in parts) or norm not in inputs:
        return None
    summed = sum((part.reshape(inputs[norm].shape) for part in parts if part is not None), torch.zeros(()))
    if not _same(summed, inputs[norm]):
        return None
    pre_ffn = [n for n in layer_norms if _same(outputs.get(n), inputs.get(moe))]
    if len(pre_ffn) != 1 or pre_ffn[0] not in inputs or layer not in outputs:
        return None
    if not _same(inputs[pre_ffn[0]] + outputs[moe], outputs[layer]):
        return None
    return MOE_BRANCH_ADD


# Where a norm's epsilon is given: the constructors that build the block norms and the final norm
# (``eps=model_args.norm_eps`` in every reference). A constant epsilon of the modeling code is a
# value set there, not a statement of the forward.
BLOCK_NORMS_BUILT = HandEditPlace(
    class_name="TransformerBlock",
    function="__init__",
    anchor="self.attention_norm",
    statement="where the block norms are built (their eps)",
)
FINAL_NORM_BUILT = HandEditPlace(
    class_name=None, function="__init__", anchor="self.norm", statement="where the final norm is built (its eps)"
)
# Where a sinusoidal table's rows are computed: the table module's ``build`` calls the package's
# ``sinusoidal_positions`` (written by the sinusoidal_positions edit); a table of another formula
# changes that function's frequencies.
SINUSOIDAL_TABLE_BUILT = HandEditPlace(
    class_name="SinusoidalPositions",
    function="build",
    anchor="sinusoidal_positions(",
    statement="where the table is built (the frequencies of sinusoidal_positions)",
)
