"""Archon: torchtitan-style decoder-only models over packed sequences.

Each model package registers its ModelSpec when its ``spec`` module is imported.
The spec modules are imported directly, so no model package's ``__init__`` runs first.
"""

from archon_models.afmoe import spec as afmoe_spec  # noqa: F401
from archon_models.apertus import spec as apertus_spec  # noqa: F401
from archon_models.arcee import spec as arcee_spec  # noqa: F401
from archon_models.aria_text import spec as aria_text_spec  # noqa: F401
from archon_models.axk1 import spec as axk1_spec  # noqa: F401
from archon_models.biogpt import spec as biogpt_spec  # noqa: F401
from archon_models.bitnet import spec as bitnet_spec  # noqa: F401
from archon_models.bloom import spec as bloom_spec  # noqa: F401
from archon_models.codegen import spec as codegen_spec  # noqa: F401
from archon_models.cohere import spec as cohere_spec  # noqa: F401
from archon_models.cohere2 import spec as cohere2_spec  # noqa: F401
from archon_models.cohere2_moe import spec as cohere2_moe_spec  # noqa: F401
from archon_models.ctrl import spec as ctrl_spec  # noqa: F401
from archon_models.cwm import spec as cwm_spec  # noqa: F401
from archon_models.deepseek_v2 import spec as deepseek_v2_spec  # noqa: F401
from archon_models.deepseek_v3 import spec as deepseek_v3_spec  # noqa: F401
from archon_models.deepseek_v32 import spec as deepseek_v32_spec  # noqa: F401
from archon_models.diffllama import spec as diffllama_spec  # noqa: F401
from archon_models.dots1 import spec as dots1_spec  # noqa: F401
from archon_models.ernie4_5 import spec as ernie4_5_spec  # noqa: F401
from archon_models.ernie4_5_moe import spec as ernie4_5_moe_spec  # noqa: F401
from archon_models.exaone4 import spec as exaone4_spec  # noqa: F401
from archon_models.exaone_moe import spec as exaone_moe_spec  # noqa: F401
from archon_models.falcon import spec as falcon_spec  # noqa: F401
from archon_models.flex_olmo import spec as flex_olmo_spec  # noqa: F401
from archon_models.flint import spec as flint_spec  # noqa: F401
from archon_models.gemma import spec as gemma_spec  # noqa: F401
from archon_models.gemma2 import spec as gemma2_spec  # noqa: F401
from archon_models.gemma3_text import spec as gemma3_text_spec  # noqa: F401
from archon_models.glm import spec as glm_spec  # noqa: F401
from archon_models.glm4 import spec as glm4_spec  # noqa: F401
from archon_models.glm4_moe import spec as glm4_moe_spec  # noqa: F401
from archon_models.glm4_moe_lite import spec as glm4_moe_lite_spec  # noqa: F401
from archon_models.glm_moe_dsa import spec as glm_moe_dsa_spec  # noqa: F401
from archon_models.gpt2 import spec as gpt2_spec  # noqa: F401
from archon_models.gpt_bigcode import spec as gpt_bigcode_spec  # noqa: F401
from archon_models.gpt_neo import spec as gpt_neo_spec  # noqa: F401
from archon_models.gpt_neox import spec as gpt_neox_spec  # noqa: F401
from archon_models.gpt_neox_japanese import spec as gpt_neox_japanese_spec  # noqa: F401
from archon_models.gpt_oss import spec as gpt_oss_spec  # noqa: F401
from archon_models.gptj import spec as gptj_spec  # noqa: F401
from archon_models.granite import spec as granite_spec  # noqa: F401
from archon_models.granite_swa import spec as granite_swa_spec  # noqa: F401
from archon_models.granitemoe import spec as granitemoe_spec  # noqa: F401
from archon_models.granitemoe_swa import spec as granitemoe_swa_spec  # noqa: F401
from archon_models.granitemoeshared import spec as granitemoeshared_spec  # noqa: F401
from archon_models.helium import spec as helium_spec  # noqa: F401
from archon_models.hunyuan_v1_dense import spec as hunyuan_v1_dense_spec  # noqa: F401
from archon_models.hunyuan_v1_moe import spec as hunyuan_v1_moe_spec  # noqa: F401
from archon_models.hy_v3 import spec as hy_v3_spec  # noqa: F401
from archon_models.hyperclovax import spec as hyperclovax_spec  # noqa: F401
from archon_models.internlm3 import spec as internlm3_spec  # noqa: F401
from archon_models.iquestcoder import spec as iquestcoder_spec  # noqa: F401
from archon_models.jais2 import spec as jais2_spec  # noqa: F401
from archon_models.kolibri1 import spec as kolibri1_spec  # noqa: F401
from archon_models.laguna import spec as laguna_spec  # noqa: F401
from archon_models.llama import spec as llama_spec  # noqa: F401
from archon_models.llama4_text import spec as llama4_text_spec  # noqa: F401
from archon_models.mellum import spec as mellum_spec  # noqa: F401
from archon_models.minicpm3 import spec as minicpm3_spec  # noqa: F401
from archon_models.minimax_m2 import spec as minimax_m2_spec  # noqa: F401
from archon_models.minimax_m3_vl_text import spec as minimax_m3_vl_text_spec  # noqa: F401
from archon_models.ministral import spec as ministral_spec  # noqa: F401
from archon_models.ministral3 import spec as ministral3_spec  # noqa: F401
from archon_models.mistral import spec as mistral_spec  # noqa: F401
from archon_models.mixtral import spec as mixtral_spec  # noqa: F401
from archon_models.model_spec import (  # noqa: F401
    ModelSpec,
    get_model_spec,
    get_supported_model_types,
    is_supported_model,
    register_model_spec,
)
from archon_models.mpt import spec as mpt_spec  # noqa: F401
from archon_models.nanochat import spec as nanochat_spec  # noqa: F401
from archon_models.nemotron import spec as nemotron_spec  # noqa: F401
from archon_models.olmo import spec as olmo_spec  # noqa: F401
from archon_models.olmo2 import spec as olmo2_spec  # noqa: F401
from archon_models.olmo3 import spec as olmo3_spec  # noqa: F401
from archon_models.olmoe import spec as olmoe_spec  # noqa: F401
from archon_models.openai_gpt import spec as openai_gpt_spec  # noqa: F401
from archon_models.opt import spec as opt_spec  # noqa: F401
from archon_models.persimmon import spec as persimmon_spec  # noqa: F401
from archon_models.phi import spec as phi_spec  # noqa: F401
from archon_models.phi3 import spec as phi3_spec  # noqa: F401
from archon_models.phimoe import spec as phimoe_spec  # noqa: F401
from archon_models.qwen2 import spec as qwen2_spec  # noqa: F401
from archon_models.qwen2_moe import spec as qwen2_moe_spec  # noqa: F401
from archon_models.qwen3 import spec as qwen3_spec  # noqa: F401
from archon_models.qwen3_5 import spec as qwen3_5_spec  # noqa: F401
from archon_models.qwen3_next import spec as qwen3_next_spec  # noqa: F401
from archon_models.seed_oss import spec as seed_oss_spec  # noqa: F401
from archon_models.smollm3 import spec as smollm3_spec  # noqa: F401
from archon_models.solar_open import spec as solar_open_spec  # noqa: F401
from archon_models.stablelm import spec as stablelm_spec  # noqa: F401
from archon_models.starcoder2 import spec as starcoder2_spec  # noqa: F401
from archon_models.vaultgemma import spec as vaultgemma_spec  # noqa: F401
from archon_models.xglm import spec as xglm_spec  # noqa: F401
from archon_models.youtu import spec as youtu_spec  # noqa: F401
