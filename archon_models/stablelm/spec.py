"""Registers Stablelm with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.stablelm.infra.parallelize import parallelize_stablelm
from archon_models.stablelm.model.args import StablelmModelArgs
from archon_models.stablelm.model.model import StablelmModel
from archon_models.stablelm.model.state_dict_adapter import StablelmStateDictAdapter

STABLELM_SPEC = ModelSpec(
    name="stablelm",
    model_class=StablelmModel,
    model_args_class=StablelmModelArgs,
    state_dict_adapter_class=StablelmStateDictAdapter,
    parallelize_fn=parallelize_stablelm,
    supported_model_types=frozenset({"stablelm"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(STABLELM_SPEC)

__all__ = ["STABLELM_SPEC"]
