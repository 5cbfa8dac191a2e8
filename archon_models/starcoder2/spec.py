"""Registers Starcoder2 with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.starcoder2.infra.parallelize import parallelize_starcoder2
from archon_models.starcoder2.model.args import Starcoder2ModelArgs
from archon_models.starcoder2.model.model import Starcoder2Model
from archon_models.starcoder2.model.state_dict_adapter import Starcoder2StateDictAdapter

STARCODER2_SPEC = ModelSpec(
    name="starcoder2",
    model_class=Starcoder2Model,
    model_args_class=Starcoder2ModelArgs,
    state_dict_adapter_class=Starcoder2StateDictAdapter,
    parallelize_fn=parallelize_starcoder2,
    supported_model_types=frozenset({"starcoder2"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(STARCODER2_SPEC)

__all__ = ["STARCODER2_SPEC"]
