"""Qwen3.5 (text; Gated DeltaNet layers next to gated full attention): the hand-written
reference for hybrid decoders."""

from archon_models.qwen3_5.model.args import Qwen3_5ModelArgs
from archon_models.qwen3_5.model.model import Qwen3_5Model
from archon_models.qwen3_5.model.state_dict_adapter import Qwen3_5StateDictAdapter

__all__ = ["Qwen3_5Model", "Qwen3_5ModelArgs", "Qwen3_5StateDictAdapter"]
