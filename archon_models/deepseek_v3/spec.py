"""Registers DeepSeek-V3 (``deepseek_v3``) with the Archon model registry."""

from archon_models.deepseek_v3.infra.parallelize import parallelize_deepseek_v3
from archon_models.deepseek_v3.model.args import DeepseekV3ModelArgs
from archon_models.deepseek_v3.model.model import DeepseekV3Model
from archon_models.deepseek_v3.model.state_dict_adapter import DeepseekV3StateDictAdapter
from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm

DEEPSEEK_V3_SPEC = ModelSpec(
    name="deepseek_v3",
    model_class=DeepseekV3Model,
    model_args_class=DeepseekV3ModelArgs,
    state_dict_adapter_class=DeepseekV3StateDictAdapter,
    parallelize_fn=parallelize_deepseek_v3,
    supported_model_types=frozenset({"deepseek_v3"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(DEEPSEEK_V3_SPEC)

__all__ = ["DEEPSEEK_V3_SPEC"]
