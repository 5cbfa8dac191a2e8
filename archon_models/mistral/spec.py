"""Registers Mistral with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.mistral.infra.parallelize import parallelize_mistral
from archon_models.mistral.model.args import MistralModelArgs
from archon_models.mistral.model.model import MistralModel
from archon_models.mistral.model.state_dict_adapter import MistralStateDictAdapter

MISTRAL_SPEC = ModelSpec(
    name="mistral",
    model_class=MistralModel,
    model_args_class=MistralModelArgs,
    state_dict_adapter_class=MistralStateDictAdapter,
    parallelize_fn=parallelize_mistral,
    supported_model_types=frozenset({"mistral"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(MISTRAL_SPEC)

__all__ = ["MISTRAL_SPEC"]
