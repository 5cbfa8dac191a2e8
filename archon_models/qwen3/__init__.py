"""Qwen3 (dense and MoE, per-head QK RMSNorm): the hand-written reference for QK-norm and MoE decoders."""

from archon_models.qwen3.model.args import Qwen3ModelArgs
from archon_models.qwen3.model.model import Qwen3Model
from archon_models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "Qwen3StateDictAdapter"]
