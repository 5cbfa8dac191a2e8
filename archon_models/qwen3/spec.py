"""Registers Qwen3 (dense ``qwen3`` and MoE ``qwen3_moe``) with the Archon model registry."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.qwen3.infra.parallelize import parallelize_qwen3
from archon_models.qwen3.model.args import Qwen3ModelArgs
from archon_models.qwen3.model.model import Qwen3Model
from archon_models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

QWEN3_SPEC = ModelSpec(
    name="qwen3",
    model_class=Qwen3Model,
    model_args_class=Qwen3ModelArgs,
    state_dict_adapter_class=Qwen3StateDictAdapter,
    parallelize_fn=parallelize_qwen3,
    supported_model_types=frozenset({"qwen3", "qwen3_moe"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(QWEN3_SPEC)

__all__ = ["QWEN3_SPEC"]
