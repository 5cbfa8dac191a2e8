"""Mixtral (dense and MoE, per-head QK RMSNorm): the hand-written reference for QK-norm and MoE decoders."""

from archon_models.mixtral.model.args import MixtralModelArgs
from archon_models.mixtral.model.model import MixtralModel
from archon_models.mixtral.model.state_dict_adapter import MixtralStateDictAdapter

__all__ = ["MixtralModel", "MixtralModelArgs", "MixtralStateDictAdapter"]
