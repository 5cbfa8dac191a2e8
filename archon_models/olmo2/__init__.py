"""Olmo2 (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.olmo2.model.args import Olmo2ModelArgs
from archon_models.olmo2.model.model import Olmo2Model
from archon_models.olmo2.model.state_dict_adapter import Olmo2StateDictAdapter

__all__ = ["Olmo2Model", "Olmo2ModelArgs", "Olmo2StateDictAdapter"]
