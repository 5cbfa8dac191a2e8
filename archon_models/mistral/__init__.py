"""Mistral (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.mistral.model.args import MistralModelArgs
from archon_models.mistral.model.model import MistralModel
from archon_models.mistral.model.state_dict_adapter import MistralStateDictAdapter

__all__ = ["MistralModel", "MistralModelArgs", "MistralStateDictAdapter"]
