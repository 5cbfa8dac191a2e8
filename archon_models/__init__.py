"""Archon: torchtitan-style decoder-only models over packed sequences.

Each model package registers its ModelSpec when its ``spec`` module is imported.
The spec modules are imported directly, so no model package's ``__init__`` runs first.
"""

from archon_models.falcon import spec as falcon_spec  # noqa: F401
from archon_models.gemma import spec as gemma_spec  # noqa: F401
from archon_models.gemma2 import spec as gemma2_spec  # noqa: F401
from archon_models.gpt_neox import spec as gpt_neox_spec  # noqa: F401
from archon_models.granite import spec as granite_spec  # noqa: F401
from archon_models.hyperclovax import spec as hyperclovax_spec  # noqa: F401
from archon_models.llama import spec as llama_spec  # noqa: F401
from archon_models.mistral import spec as mistral_spec  # noqa: F401
from archon_models.mixtral import spec as mixtral_spec  # noqa: F401
from archon_models.model_spec import (  # noqa: F401
    ModelSpec,
    get_model_spec,
    get_supported_model_types,
    is_supported_model,
    register_model_spec,
)
from archon_models.olmo2 import spec as olmo2_spec  # noqa: F401
from archon_models.phi3 import spec as phi3_spec  # noqa: F401
from archon_models.qwen2 import spec as qwen2_spec  # noqa: F401
from archon_models.qwen2_moe import spec as qwen2_moe_spec  # noqa: F401
from archon_models.qwen3 import spec as qwen3_spec  # noqa: F401
from archon_models.smollm3 import spec as smollm3_spec  # noqa: F401
from archon_models.stablelm import spec as stablelm_spec  # noqa: F401
from archon_models.starcoder2 import spec as starcoder2_spec  # noqa: F401
