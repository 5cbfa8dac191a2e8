"""Registers Mixtral (dense ``mixtral`` and MoE ``mixtral_moe``) with the Archon model registry."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.mixtral.infra.parallelize import parallelize_mixtral
from archon_models.mixtral.model.args import MixtralModelArgs
from archon_models.mixtral.model.model import MixtralModel
from archon_models.mixtral.model.state_dict_adapter import MixtralStateDictAdapter

MIXTRAL_SPEC = ModelSpec(
    name="mixtral",
    model_class=MixtralModel,
    model_args_class=MixtralModelArgs,
    state_dict_adapter_class=MixtralStateDictAdapter,
    parallelize_fn=parallelize_mixtral,
    supported_model_types=frozenset({"mixtral"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(MIXTRAL_SPEC)

__all__ = ["MIXTRAL_SPEC"]
