"""The feed-forward activations the porting engine writes: the one table.

The analyser maps a family's activation onto an entry here (by the config's value when
it names an entry, else by probing the function numerically against each entry's
reference computation, so ``gelu_new``, ``gelu_fast`` and a family's own tanh-GELU class
all land on ``gelu_pytorch_tanh``), and the engine writes the entry's call. An entry's
name is the value ``FFNFeatures.activation`` reports and ``SUPPORTED_EDITS`` lists.

``call`` is the expression the generated ``FeedForward.forward`` computes, ``{}`` standing
for the pre-activation. An activation the call needs a helper for (one that reads its
input twice, or holds learned parameters) names a class or function of
``skill/snippets/activations.py`` in ``snippet``; a ``module`` entry is an
``nn.Module`` the feed-forward holds as ``self.act_fn`` (its parameters are checkpoint
keys ``<mlp>.act_fn.<name>``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Activation:
    name: str
    title: str
    call: str
    reference: Callable[[torch.Tensor], torch.Tensor] | None = None
    snippet: str | None = None
    module: bool = False


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("silu", "SiLU", "F.silu({})", F.silu),
        Activation("gelu", "GELU", "F.gelu({})", lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))),
        Activation("gelu_pytorch_tanh", "tanh-approximated GELU", 'F.gelu({}, approximate="tanh")', _gelu_tanh),
        Activation("quick_gelu", "quick GELU", "quick_gelu({})", lambda x: x * torch.sigmoid(1.702 * x), "quick_gelu"),
        Activation("relu", "ReLU", "F.relu({})", F.relu),
        Activation("relu2", "squared ReLU", "torch.square(F.relu({}))", lambda x: torch.square(F.relu(x))),
        # Learned: no parameter-free reference; matched by the config's value only.
        Activation("xielu", "xIELU", "self.act_fn({})", None, "XIELU", module=True),
    )
}


def probe_input() -> torch.Tensor:
    """Points where every pair of entries differs by far more than rounding, wide enough
    (-12..12) that a clipped variant (relu6, gelu_10) shows its clip."""
    return torch.linspace(-12.0, 12.0, 481, dtype=torch.float64).float()


def match_activation(fn: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """The table entry whose reference computes what ``fn`` computes, or ``None``.

    Tolerance 1e-5: the tanh approximations of GELU (NewGELU, FastGELU, BloomGelu, torch's
    own) agree to ~1e-7, erf GELU differs from them by up to ~5e-4, quick GELU by ~2e-2.
    """
    x = probe_input()
    try:
        with torch.no_grad():
            out = fn(x.clone())
    except Exception:
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    for entry in ACTIVATIONS.values():
        if entry.reference is None:
            continue
        want = entry.reference(x)
        if torch.allclose(out.float(), want, atol=1e-5, rtol=1e-5):
            return entry.name
    return None
