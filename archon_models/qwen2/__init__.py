"""Qwen2 (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.qwen2.model.args import Qwen2ModelArgs
from archon_models.qwen2.model.model import Qwen2Model
from archon_models.qwen2.model.state_dict_adapter import Qwen2StateDictAdapter

__all__ = ["Qwen2Model", "Qwen2ModelArgs", "Qwen2StateDictAdapter"]
