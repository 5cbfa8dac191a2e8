"""Registers Gemma with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.gemma.infra.parallelize import parallelize_gemma
from archon_models.gemma.model.args import GemmaModelArgs
from archon_models.gemma.model.model import GemmaModel
from archon_models.gemma.model.state_dict_adapter import GemmaStateDictAdapter

GEMMA_SPEC = ModelSpec(
    name="gemma",
    model_class=GemmaModel,
    model_args_class=GemmaModelArgs,
    state_dict_adapter_class=GemmaStateDictAdapter,
    parallelize_fn=parallelize_gemma,
    supported_model_types=frozenset({"gemma"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(GEMMA_SPEC)

__all__ = ["GEMMA_SPEC"]
