"""Registers Qwen2 with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.qwen2.infra.parallelize import parallelize_qwen2
from archon_models.qwen2.model.args import Qwen2ModelArgs
from archon_models.qwen2.model.model import Qwen2Model
from archon_models.qwen2.model.state_dict_adapter import Qwen2StateDictAdapter

QWEN2_SPEC = ModelSpec(
    name="qwen2",
    model_class=Qwen2Model,
    model_args_class=Qwen2ModelArgs,
    state_dict_adapter_class=Qwen2StateDictAdapter,
    parallelize_fn=parallelize_qwen2,
    supported_model_types=frozenset({"qwen2"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(QWEN2_SPEC)

__all__ = ["QWEN2_SPEC"]
