"""Registers Gemma2 with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.gemma2.infra.parallelize import parallelize_gemma2
from archon_models.gemma2.model.args import Gemma2ModelArgs
from archon_models.gemma2.model.model import Gemma2Model
from archon_models.gemma2.model.state_dict_adapter import Gemma2StateDictAdapter

GEMMA2_SPEC = ModelSpec(
    name="gemma2",
    model_class=Gemma2Model,
    model_args_class=Gemma2ModelArgs,
    state_dict_adapter_class=Gemma2StateDictAdapter,
    parallelize_fn=parallelize_gemma2,
    supported_model_types=frozenset({"gemma2"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(GEMMA2_SPEC)

__all__ = ["GEMMA2_SPEC"]
