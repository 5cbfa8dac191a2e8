"""DeepSeek-V3 (multi-head latent attention, sigmoid-routed MoE): the hand-written reference for MLA decoders."""

from archon_models.deepseek_v3.model.args import DeepseekV3ModelArgs
from archon_models.deepseek_v3.model.model import DeepseekV3Model
from archon_models.deepseek_v3.model.state_dict_adapter import DeepseekV3StateDictAdapter

__all__ = ["DeepseekV3Model", "DeepseekV3ModelArgs", "DeepseekV3StateDictAdapter"]
