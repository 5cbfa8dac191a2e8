"""Norm classes, one per kind, and the expression that builds one.

RMSNorm (Llama), RMSNorm scaled by ``1 + w`` (Gemma), weightless RMSNorm, LayerNorm with
bias, without bias, without any learned parameter (OLMo), and LayerNorm scaled by
``1 + w`` (Nemotron's LayerNorm1P). The (1 + w) kinds store ``w``, initialised to zero.
"""

from __future__ import annotations

from tests.fuzz.source import Piece, block
from tests.fuzz.spec import NormKind

CLASS_NAMES: dict[NormKind, str] = {
    "rms": "PREFIXRMSNorm",
    "rms_one_plus_w": "PREFIXZeroCenteredRMSNorm",
    "rms_weightless": "PREFIXWeightlessRMSNorm",
    "layer_norm_one_plus_w": "PREFIXLayerNorm1P",
}
# Kinds whose stored weight is the offset from one (initialised to zero).
OFFSET_KINDS: tuple[NormKind, ...] = ("rms_one_plus_w", "layer_norm_one_plus_w")

_CLASSES: dict[NormKind, str] = {
    "rms": """
        class PREFIXRMSNorm(nn.Module):
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
    """,
    "rms_one_plus_w": '''
        class PREFIXZeroCenteredRMSNorm(nn.Module):
            """RMSNorm whose scale is ``1 + weight``: the stored weight starts at zero."""

            def __init__(self, dim, eps=1e-6):
                super().__init__()
                self.eps = eps
                self.weight = nn.Parameter(torch.zeros(dim))

            def _norm(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

            def forward(self, x):
                output = self._norm(x.float())
                output = output * (1.0 + self.weight.float())
                return output.type_as(x)
    ''',
    "rms_weightless": '''
        class PREFIXWeightlessRMSNorm(nn.Module):
            """RMS normalisation with no learned scale."""

            def __init__(self, hidden_size, eps=1e-6):
                super().__init__()
                self.hidden_size = hidden_size
                self.eps = eps

            def forward(self, hidden_states):
                input_dtype = hidden_states.dtype
                hidden_states = hidden_states.to(torch.float32)
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                return (hidden_states * torch.rsqrt(variance + self.eps)).to(input_dtype)
    ''',
    "layer_norm_one_plus_w": '''
        class PREFIXLayerNorm1P(nn.LayerNorm):
            """LayerNorm whose scale is ``1 + weight`` (the stored weight starts at zero)."""

            def forward(self, input):
                return F.layer_norm(input, self.normalized_shape, self.weight + 1, self.bias, self.eps)
    ''',
}


def norm_classes(kinds: set[NormKind]) -> Piece:
    """The classes the given kinds need (LayerNorm kinds use ``nn.LayerNorm`` itself)."""
    code = "\n\n\n".join(block(_CLASSES[kind]) for kind in sorted(kinds) if kind in _CLASSES)
    imports = {"import torch.nn.functional as F"} if "layer_norm_one_plus_w" in kinds else set()
    return Piece(code=code, imports=imports)


def norm_ctor(kind: NormKind, width: str, eps: str) -> str:
    """The expression building one norm of ``width`` features."""
    match kind:
        case "layer_norm":
            return f"nn.LayerNorm({width}, eps={eps})"
        case "layer_norm_no_bias":
            return f"nn.LayerNorm({width}, eps={eps}, bias=False)"
        case "layer_norm_weightless":
            return f"nn.LayerNorm({width}, eps={eps}, elementwise_affine=False)"
        case _:
            return f"{CLASS_NAMES[kind]}({width}, eps={eps})"


def eps_field(kind: NormKind) -> str:
    return "rms_norm_eps" if kind.startswith("rms") else "layer_norm_eps"
