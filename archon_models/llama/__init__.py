"""Llama (dense, q/k/v bias): the hand-written reference for dense decoders without QK norm."""

from archon_models.llama.model.args import LlamaModelArgs
from archon_models.llama.model.model import LlamaModel
from archon_models.llama.model.state_dict_adapter import LlamaStateDictAdapter

__all__ = ["LlamaModel", "LlamaModelArgs", "LlamaStateDictAdapter"]
