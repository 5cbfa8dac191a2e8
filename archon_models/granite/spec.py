"""Registers Granite with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.granite.infra.parallelize import parallelize_granite
from archon_models.granite.model.args import GraniteModelArgs
from archon_models.granite.model.model import GraniteModel
from archon_models.granite.model.state_dict_adapter import GraniteStateDictAdapter

GRANITE_SPEC = ModelSpec(
    name="granite",
    model_class=GraniteModel,
    model_args_class=GraniteModelArgs,
    state_dict_adapter_class=GraniteStateDictAdapter,
    parallelize_fn=parallelize_granite,
    supported_model_types=frozenset({"granite"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(GRANITE_SPEC)

__all__ = ["GRANITE_SPEC"]
