"""Starcoder2 (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.starcoder2.model.args import Starcoder2ModelArgs
from archon_models.starcoder2.model.model import Starcoder2Model
from archon_models.starcoder2.model.state_dict_adapter import Starcoder2StateDictAdapter

__all__ = ["Starcoder2Model", "Starcoder2ModelArgs", "Starcoder2StateDictAdapter"]
