"""Registers Llama with the Archon model registry (imported from ``archon_models/__init__.py``)."""

from archon_models.model_spec import ModelSpec, register_model_spec
from archon_models.pipeline_parallel import pipeline_llm
from archon_models.llama.infra.parallelize import parallelize_llama
from archon_models.llama.model.args import LlamaModelArgs
from archon_models.llama.model.model import LlamaModel
from archon_models.llama.model.state_dict_adapter import LlamaStateDictAdapter

LLAMA_SPEC = ModelSpec(
    name="llama",
    model_class=LlamaModel,
    model_args_class=LlamaModelArgs,
    state_dict_adapter_class=LlamaStateDictAdapter,
    parallelize_fn=parallelize_llama,
    supported_model_types=frozenset({"llama"}),
    pipelining_fn=pipeline_llm,
)

register_model_spec(LLAMA_SPEC)

__all__ = ["LLAMA_SPEC"]
