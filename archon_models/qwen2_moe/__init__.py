"""Qwen2Moe (dense and MoE, per-head QK RMSNorm): the hand-written reference for QK-norm and MoE decoders."""

from archon_models.qwen2_moe.model.args import Qwen2MoeModelArgs
from archon_models.qwen2_moe.model.model import Qwen2MoeModel
from archon_models.qwen2_moe.model.state_dict_adapter import Qwen2MoeStateDictAdapter

__all__ = ["Qwen2MoeModel", "Qwen2MoeModelArgs", "Qwen2MoeStateDictAdapter"]
