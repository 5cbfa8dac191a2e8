"""Registers Qwen2Moe (dense ``qwen2_moe`` and MoE ``qwen2_moe_moe``) with the Archon model registry."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.qwen2_moe.infra.parallelize import parallelize_qwen2_moe
from archon_models.qwen2_moe.model.args import Qwen2MoeModelArgs
from archon_models.qwen2_moe.model.model import Qwen2MoeModel
from archon_models.qwen2_moe.model.state_dict_adapter import Qwen2MoeStateDictAdapter

QWEN2_MOE_SPEC = ModelSpec(
    name="qwen2_moe",
    model_class=Qwen2MoeModel,
    model_args_class=Qwen2MoeModelArgs,
    state_dict_adapter_class=Qwen2MoeStateDictAdapter,
    parallelize_fn=parallelize_qwen2_moe,
    supported_model_types=frozenset({"qwen2_moe"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(QWEN2_MOE_SPEC)

__all__ = ["QWEN2_MOE_SPEC"]
