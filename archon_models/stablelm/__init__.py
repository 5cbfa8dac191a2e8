"""Stablelm (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.stablelm.model.args import StablelmModelArgs
from archon_models.stablelm.model.model import StablelmModel
from archon_models.stablelm.model.state_dict_adapter import StablelmStateDictAdapter

__all__ = ["StablelmModel", "StablelmModelArgs", "StablelmStateDictAdapter"]
