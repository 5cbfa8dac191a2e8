"""Gemma2 (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.gemma2.model.args import Gemma2ModelArgs
from archon_models.gemma2.model.model import Gemma2Model
from archon_models.gemma2.model.state_dict_adapter import Gemma2StateDictAdapter

__all__ = ["Gemma2Model", "Gemma2ModelArgs", "Gemma2StateDictAdapter"]
