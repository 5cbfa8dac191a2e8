"""What HF does is measured, not read off a config name (issue 19, item 3).

Weight tying: a remote-code family whose class defines no tying keeps its own LM head even
with ``tie_word_embeddings=True``; the analysis probes the head with the field True and
False, the port keeps a head of its own, and stage 2 proves that instead of asserting HF ties.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig
from transformers.utils import logging as hf_logging

from skill.analysis import AnalyzeInput, analyze_hf_model
from skill.harness.case import ModelCase
from skill.harness.models import build_hf_model
from skill.porting.port_model import PortModelRequest, port_model
from tests.skill.test_port_rope import _workspace

hf_logging.set_verbosity_error()

UNTIED_CONFIGURATION = """
from transformers import LlamaConfig


class UntiedConfig(LlamaConfig):
    model_type = "untied"
"""
# Llama whose class declares no tied weights: transformers never ties its head, whatever
# the config says.
UNTIED_MODELING = """
from transformers import LlamaForCausalLM

from .configuration_untied import UntiedConfig


class UntiedForCausalLM(LlamaForCausalLM):
    config_class = UntiedConfig
    _tied_weights_keys = None
"""


def untied_checkpoint(folder: Path) -> Path:
    """A checkpoint folder of the family, its config saying tie_word_embeddings=True."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "configuration_untied.py").write_text(UNTIED_CONFIGURATION)
    (folder / "modeling_untied.py").write_text(UNTIED_MODELING)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ).to_dict()
    config.update(
        model_type="untied",
        architectures=["UntiedForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_untied.UntiedConfig",
            "AutoModelForCausalLM": "modeling_untied.UntiedForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    case = ModelCase(model_type="untied", source=str(folder), trust_remote_code=True, seed=3)
    build_hf_model(case).save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_a_family_that_defines_no_tying_is_reported_untied(tmp_path: Path) -> None:
    report = analyze_hf_model(AnalyzeInput(source=str(untied_checkpoint(tmp_path / "untied")), trust_remote_code=True))
    scalars = report.checklist.scalars
    assert scalars.tie_word_embeddings is False and scalars.tying_field is None
    assert any("weight tying probe" in line for line in report.evidence)


def test_builtin_families_tie_as_their_config_says() -> None:
    for family in ("gemma", "llama"):
        scalars = analyze_hf_model(AnalyzeInput(source=family)).checklist.scalars
        assert scalars.tying_field == "tie_word_embeddings"


@pytest.mark.slow
def test_a_family_that_defines_no_tying_ports_with_its_own_head(tmp_path: Path) -> None:
    folder = untied_checkpoint(tmp_path / "untied")
    root = _workspace(tmp_path)
    result = port_model(PortModelRequest(source=str(folder), trust_remote_code=True, stages=[1, 2, 4], workspace=root))
    failing = [f"{s.step}: {s.detail}" for s in result.steps if not s.ok]
    assert result.passed, f"{result.failed_step}: {result.error}\n" + "\n".join(failing)
    args = (root / "archon_models" / "untied" / "model" / "args.py").read_text()
    assert "enable_weight_tying=False," in args
    adapter_stage = next(r for r in result.stage_results if r.stage == 2)
    names = [c.name for t in adapter_stage.tests for c in t.checks]
    assert "tie_word_embeddings=True: HF keeps its own LM head, and so does the port" in names
    assert not any(name.startswith("tied: ") for name in names)


# ------------------------------------------------------------------ padding_idx


def test_the_row_hf_never_trains_is_probed() -> None:
    # LlamaModel: nn.Embedding(vocab_size, hidden_size, self.padding_idx = config.pad_token_id);
    # BloomModel: nn.Embedding(vocab_size, embed_dim), every row trains.
    assert analyze_hf_model(AnalyzeInput(source="llama")).checklist.scalars.padding_idx_field == "pad_token_id"
    assert analyze_hf_model(AnalyzeInput(source="bloom")).checklist.scalars.padding_idx_field is None


def test_the_port_freezes_the_pad_row_where_hf_does() -> None:
    from skill.porting.plan import plan_for
    from skill.porting.test_file import TEST_PAD_ID, test_file_source

    plan = plan_for("llama")
    assert plan.padding_idx_field == "pad_token_id"
    # Llama's config leaves pad_token_id unset: the generated case sets one, so it is in the documents.
    text = test_file_source("Llama", "llama", plan, "a decoder", unset_pad=True)
    assert f'"pad_token_id": {TEST_PAD_ID}' in text
    assert plan_for("bloom").padding_idx_field is None


# ------------------------------------------------------------------ nullable config fields


def test_nullable_fields_that_change_the_forward_are_found() -> None:
    # Gemma2Config: final_logit_softcapping / attn_logit_softcapping: float | None; the forward
    # caps only `if ... is not None`. MistralConfig.sliding_window: int | None (None: no window).
    gemma2 = analyze_hf_model(AnalyzeInput(source="gemma2")).checklist.nullable_fields
    assert {"final_logit_softcapping", "attn_logit_softcapping"} <= set(gemma2)
    assert analyze_hf_model(AnalyzeInput(source="mistral")).checklist.nullable_fields == ["sliding_window"]
    assert analyze_hf_model(AnalyzeInput(source="llama")).checklist.nullable_fields == []


def test_each_nullable_field_gets_a_case_or_a_refusal() -> None:
    from transformers import AutoConfig

    from skill.porting.edit_args import arg_fields, check_supported_source, nullable_split
    from skill.porting.plan import plan_for
    from skill.porting.test_file import test_file_source

    plan = plan_for("gemma2")
    config = AutoConfig.for_model("gemma2")
    mapped, refused = nullable_split(plan, arg_fields(plan, config))
    assert set(mapped) == {"final_logit_softcapping", "attn_logit_softcapping"} and refused == []
    text = test_file_source("Gemma2", "gemma2", plan, "a decoder", nullable=mapped)
    assert 'name="gemma2-final_logit_softcapping-None"' in text

    # A field the port does not map: from_hf_config refuses its None, naming it.
    unmapped = plan.model_copy(update={"nullable_fields": [*plan.nullable_fields, "query_pre_attn_scalar"]})
    _, refused = nullable_split(unmapped, arg_fields(unmapped, config))
    assert refused == ["query_pre_attn_scalar"]
    namespace: dict = {}
    source = check_supported_source(unmapped, config, "Gemma2", refused_none=refused)
    exec("from typing import Any\n" + source, namespace)
    with pytest.raises(ValueError, match="query_pre_attn_scalar=None is not supported"):
        namespace["_check_supported"](SimpleNamespace(**{**config.to_dict(), "query_pre_attn_scalar": None}))
