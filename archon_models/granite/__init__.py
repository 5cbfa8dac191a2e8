"""Granite (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.granite.model.args import GraniteModelArgs
from archon_models.granite.model.model import GraniteModel
from archon_models.granite.model.state_dict_adapter import GraniteStateDictAdapter

__all__ = ["GraniteModel", "GraniteModelArgs", "GraniteStateDictAdapter"]
