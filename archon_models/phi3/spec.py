"""Registers Phi3 with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.phi3.infra.parallelize import parallelize_phi3
from archon_models.phi3.model.args import Phi3ModelArgs
from archon_models.phi3.model.model import Phi3Model
from archon_models.phi3.model.state_dict_adapter import Phi3StateDictAdapter

PHI3_SPEC = ModelSpec(
    name="phi3",
    model_class=Phi3Model,
    model_args_class=Phi3ModelArgs,
    state_dict_adapter_class=Phi3StateDictAdapter,
    parallelize_fn=parallelize_phi3,
    supported_model_types=frozenset({"phi3"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(PHI3_SPEC)

__all__ = ["PHI3_SPEC"]
