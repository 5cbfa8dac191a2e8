"""Phi3 (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.phi3.model.args import Phi3ModelArgs
from archon_models.phi3.model.model import Phi3Model
from archon_models.phi3.model.state_dict_adapter import Phi3StateDictAdapter

__all__ = ["Phi3Model", "Phi3ModelArgs", "Phi3StateDictAdapter"]
