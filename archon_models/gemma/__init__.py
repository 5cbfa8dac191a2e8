"""Gemma (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.gemma.model.args import GemmaModelArgs
from archon_models.gemma.model.model import GemmaModel
from archon_models.gemma.model.state_dict_adapter import GemmaStateDictAdapter

__all__ = ["GemmaModel", "GemmaModelArgs", "GemmaStateDictAdapter"]
