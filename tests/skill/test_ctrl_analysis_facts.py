"""Facts the analysis once inferred wrong for CTRL (issue 20, a fresh agent's hand port),
each now measured on the real HF classes, and checked on another family the same rule moves.

transformers' ``modeling_ctrl.py``: ``CTRLModel`` scales the token embeddings by
``sqrt(n_embd)`` and adds a non-persistent sinusoidal table; each ``EncoderLayer`` holds
``MultiHeadAttention`` and ``ffn = nn.Sequential(Linear(d_model, dff), ReLU(), Linear(dff,
d_model))`` with two ``LayerNorm(d_model, eps=1e-6)``; the final ``layernorm`` reads
``config.layer_norm_epsilon``.
"""

from __future__ import annotations

from transformers import AutoConfig

from skill.porting.plan import plan_for
from skill.tiny_model import TINY_INTERMEDIATE, tiny_config
from tests.skill.test_analyze_families import report_for

# ------------------------------------------------- 1. the FFN width field, by probe


def test_ctrl_ffn_width_is_dff_at_released_size() -> None:
    # CTRLConfig's defaults are the released Salesforce/ctrl (n_embd 1280, dff 8192): the
    # width is dff, not a multiple of the hidden size (8192 / 64 was once taken as 128x).
    released = AutoConfig.for_model("ctrl")
    assert (released.n_embd, released.dff) == (1280, 8192)
    ffn = report_for("ctrl").checklist.ffn
    assert ffn.intermediate_size == released.dff
    assert ffn.intermediate_size_field == "dff"
    assert ffn.intermediate_multiple is None and ffn.intermediate_ratio_field is None
    assert plan_for("ctrl").ffn_width_field == "dff"


def test_tiny_config_shrinks_a_width_field_the_names_miss() -> None:
    # dff (CTRL) and dim_ff (CPM-Ant) set the FFN width: the shrinker measures that and
    # shrinks them; fields that set no projection width keep their value.
    assert tiny_config("ctrl").dff == TINY_INTERMEDIATE
    assert tiny_config("cpmant").dim_ff == TINY_INTERMEDIATE
    assert tiny_config("deepseek_v32").index_topk == AutoConfig.for_model("deepseek_v32").index_topk
    assert tiny_config("minicpm3").dim_model_base == AutoConfig.for_model("minicpm3").dim_model_base
    assert tiny_config("ctrl", dff=96).dff == 96
