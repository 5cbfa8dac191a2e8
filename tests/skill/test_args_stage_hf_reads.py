"""Stage 1's follow check measures whether HF's model reads a config attribute before it calls
an args field that stays put wrong.

transformers 5.25's FalconConfig sets ``num_key_value_heads`` (1 under multi-query attention)
for the KV cache, while ``FalconAttention`` reads ``multi_query`` and ``num_kv_heads``: Falcon's
``n_kv_heads`` is right to stay 1 when only that attribute changes. The tests below give the
pinned transformers' Falcon config the same mirror attribute, so they run on every version.
"""

from __future__ import annotations

import dataclasses

from archon_models.falcon.model.args import FalconModelArgs
from archon_models.llama.model.args import LlamaModelArgs
from skill.harness.args import HFReads, check_args_against_config
from skill.harness.case import ModelCase
from skill.harness.models import build_hf_config
from skill.harness.results import StageRecorder


def _kv_heads_checks(case: ModelCase, config, hf_reads) -> list:
    rec = StageRecorder(case, 1)
    check_args_against_config(rec, config, "tiny", hf_reads=hf_reads)
    return [check for check in rec.checks if check.name == "tiny: n_kv_heads"]


def _falcon_with_a_kv_cache_mirror() -> tuple[ModelCase, object]:
    case = ModelCase(model_type="falcon")
    config = build_hf_config(case)
    assert config.multi_query and not config.new_decoder_architecture
    config.num_key_value_heads = 1  # what 5.25's FalconConfig.__post_init__ sets
    return case, config


def test_an_attribute_hf_never_reads_is_measured_as_unread():
    case, config = _falcon_with_a_kv_cache_mirror()
    assert HFReads(case, config)("num_key_value_heads") is False
    # The attributes the attention does read change the model.
    assert HFReads(case, config)("num_attention_heads") is True


def test_a_field_that_stays_with_an_attribute_hf_never_reads_passes():
    case, config = _falcon_with_a_kv_cache_mirror()
    [check] = _kv_heads_checks(case, config, HFReads(case, config))
    assert check.passed, check.detail
    assert "does not read either" in check.detail
    # Without the measurement the same field reads as a from_hf_config bug.
    [unmeasured] = _kv_heads_checks(case, config, None)
    assert not unmeasured.passed and "does not follow it" in unmeasured.detail


def test_a_field_that_stays_with_an_attribute_hf_reads_still_fails(monkeypatch):
    case = ModelCase(model_type="llama", config_overrides={"num_key_value_heads": 2})
    config = build_hf_config(case)
    reads = HFReads(case, config)
    assert reads("num_key_value_heads") is True
    original = LlamaModelArgs.from_hf_config.__func__

    def constant_kv_heads(cls, hf_config):
        return dataclasses.replace(original(cls, hf_config), n_kv_heads=2)

    monkeypatch.setattr(LlamaModelArgs, "from_hf_config", classmethod(constant_kv_heads))
    [check] = _kv_heads_checks(case, config, reads)
    assert not check.passed and "does not follow it" in check.detail


def test_an_attribute_the_config_lacks_counts_as_read():
    case, config = _falcon_with_a_kv_cache_mirror()
    assert HFReads(case, config)("no_such_attribute") is True
    assert FalconModelArgs.from_hf_config(config).n_kv_heads == 1
