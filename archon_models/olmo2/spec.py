"""Registers Olmo2 with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.olmo2.infra.parallelize import parallelize_olmo2
from archon_models.olmo2.model.args import Olmo2ModelArgs
from archon_models.olmo2.model.model import Olmo2Model
from archon_models.olmo2.model.state_dict_adapter import Olmo2StateDictAdapter

OLMO2_SPEC = ModelSpec(
    name="olmo2",
    model_class=Olmo2Model,
    model_args_class=Olmo2ModelArgs,
    state_dict_adapter_class=Olmo2StateDictAdapter,
    parallelize_fn=parallelize_olmo2,
    supported_model_types=frozenset({"olmo2"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(OLMO2_SPEC)

__all__ = ["OLMO2_SPEC"]
