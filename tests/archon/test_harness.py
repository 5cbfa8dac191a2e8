"""The harness itself: each stage catches the mistake it exists for, and never passes
vacuously. Every test breaks the qwen2 reference in one known way (by wrapping a
method, nothing on disk changes) and asserts the right check fails."""

from __future__ import annotations

import pydantic
import pytest
import torch

import archon_models
from skill.harness import (
    ModelCase,
    StageFailure,
    run_adapter_stage,
    run_args_stage,
    run_completeness_stage,
    run_parity_stage,
)
from skill.harness.completeness import check_completeness
from skill.harness.inputs import make_packed_inputs, special_token_ids
from skill.harness.models import build_archon_model, build_hf_config
from skill.harness.results import StageRecorder, run_stage

CASE = ModelCase(model_type="qwen2", config_overrides={"num_key_value_heads": 2})


@pytest.fixture
def spec():
    return archon_models.get_model_spec("qwen2")


def _failed(result) -> list[str]:
    assert not result.passed
    return [c.name for c in result.failures()]


def test_parity_catches_swapped_norms(spec, monkeypatch):
    original = spec.state_dict_adapter_class.from_hf

    def swapped(self, hf_state_dict):
        state = original(self, hf_state_dict)
        a, b = "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"
        state[a], state[b] = state[b], state[a]
        return state

    monkeypatch.setattr(spec.state_dict_adapter_class, "from_hf", swapped)
    failed = _failed(run_parity_stage(CASE, raise_on_failure=False))
    assert any(name.startswith("logits, one sequence") for name in failed)


def test_parity_catches_documents_attending_to_each_other(spec, monkeypatch):
    original = spec.model_class.forward

    def leaky(self, tokens, positions, cu_seqlens, max_seqlen, *args, **kwargs):
        whole = torch.tensor([0, tokens.shape[1]], dtype=torch.int32)
        return original(self, tokens, positions, whole, tokens.shape[1], *args, **kwargs)

    monkeypatch.setattr(spec.model_class, "forward", leaky)
    failed = _failed(run_parity_stage(CASE, raise_on_failure=False))
    assert any("packed documents" in name for name in failed)
    assert not any(name.startswith("logits, one sequence") for name in failed)


def test_args_catches_a_field_that_ignores_its_attribute(spec, monkeypatch):
    original = spec.model_args_class.from_hf_config.__func__

    def constant_eps(cls, hf_config, is_critic=False, **kwargs):
        args = original(cls, hf_config, is_critic, **kwargs)
        args.norm_eps = 1e-6  # equals the tiny config's value, but is not read from it
        return args

    monkeypatch.setattr(spec.model_args_class, "from_hf_config", classmethod(constant_eps))
    failed = _failed(run_args_stage(CASE, raise_on_failure=False))
    assert "tiny: norm_eps" in failed


def test_adapter_catches_a_lossy_roundtrip(spec, monkeypatch):
    original = spec.state_dict_adapter_class.to_hf

    def lossy(self, state_dict):
        hf = original(self, state_dict)
        key = "model.norm.weight"
        hf[key] = hf[key].to(torch.bfloat16).to(hf[key].dtype)
        return hf

    monkeypatch.setattr(spec.state_dict_adapter_class, "to_hf", lossy)
    failed = _failed(run_adapter_stage(CASE, raise_on_failure=False))
    assert "archon -> hf -> archon keeps every key and tensor" in failed


def test_adapter_catches_experts_written_in_the_wrong_order(monkeypatch):
    adapter_class = archon_models.get_model_spec("qwen3_moe").state_dict_adapter_class
    original = adapter_class.convert_single_to_hf

    def reversed_experts(self, name, tensor):
        pairs = original(self, name, tensor)
        if tensor.ndim == 3:
            keys = [key for key, _ in pairs]
            pairs = list(zip(keys, [t for _, t in pairs][::-1], strict=True))
        return pairs

    monkeypatch.setattr(adapter_class, "convert_single_to_hf", reversed_experts)
    failed = _failed(run_adapter_stage(ModelCase(model_type="qwen3_moe"), raise_on_failure=False))
    assert "MoE 3D <-> 2D: one 2D tensor per expert, in order" in failed


def test_completeness_never_passes_without_keys():
    archon = build_archon_model(build_hf_config(CASE), device="meta")
    rec = StageRecorder(CASE, 3)
    check_completeness(rec, archon, disk={})
    assert "checkpoint keys found" in [c.name for c in rec.finish().failures()]


def test_completeness_catches_an_unmapped_checkpoint_key(spec, monkeypatch):
    original = spec.state_dict_adapter_class.convert_single_to_hf

    def forgetful(self, name, tensor):
        return [] if name.endswith("attention.wq.bias") else original(self, name, tensor)

    monkeypatch.setattr(spec.state_dict_adapter_class, "convert_single_to_hf", forgetful)
    failed = _failed(run_completeness_stage(CASE, raise_on_failure=False))
    assert "every Archon parameter maps to a checkpoint key" in failed
    assert "every checkpoint key comes from a parameter or an explicit None drop" in failed


def test_a_stage_without_checks_fails_and_an_exception_becomes_a_check():
    assert not run_stage(CASE, 1, lambda rec: None, raise_on_failure=False).passed

    def boom(rec):
        raise KeyError("model.layers.0.foo")

    with pytest.raises(StageFailure) as excinfo:
        run_stage(CASE, 2, boom)
    assert "model.layers.0.foo" in str(excinfo.value)
    assert excinfo.value.result.checks[0].name == "stage raised"
    assert isinstance(excinfo.value.__cause__, KeyError)


def test_case_needs_three_documents_of_different_lengths():
    with pytest.raises(pydantic.ValidationError, match="different lengths"):
        ModelCase(model_type="qwen2", doc_lens=(5, 5, 3))
    with pytest.raises(pydantic.ValidationError, match="different lengths"):
        ModelCase(model_type="qwen2", doc_lens=(5, 3))


def test_packed_inputs_follow_the_forward_contract():
    inputs = make_packed_inputs((3, 5, 2), vocab_size=16, seed=1)
    assert inputs.tokens.shape == inputs.positions.shape == (1, 10)
    assert inputs.tokens.dtype == inputs.positions.dtype == torch.int64
    assert inputs.cu_seqlens.dtype == torch.int32
    assert inputs.cu_seqlens.tolist() == [0, 3, 8, 10]
    assert inputs.positions[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert inputs.max_seqlen == 5
    assert [d.shape[1] for d in inputs.documents()] == [3, 5, 2]


def test_packed_inputs_hold_the_pad_bos_and_eos_ids():
    """Real documents hold the special ids: bos first, eos last, and a pad id inside (the
    row HF's padding_idx never trains); every other token stays the seed's."""
    special = special_token_ids(build_hf_config(ModelCase(model_type="smollm3")))
    assert special["pad_token_id"] == (251,)
    plain = make_packed_inputs((7, 13, 4), vocab_size=256, seed=0)
    inputs = make_packed_inputs((7, 13, 4), vocab_size=256, seed=0, special=special)
    bos, eos, pad = (special.get(f, (None,))[0] for f in ("bos_token_id", "eos_token_id", "pad_token_id"))
    for document, original in zip(inputs.documents(), plain.documents(), strict=True):
        ids = document[0].tolist()
        if bos is not None:
            assert ids[0] == bos
        assert ids[-1] == eos and ids[len(ids) // 2] == pad
        kept = [i for i in range(len(ids)) if i not in (0, len(ids) // 2, len(ids) - 1)]
        assert [ids[i] for i in kept] == [original[0, i].item() for i in kept]
    assert special_token_ids(build_hf_config(ModelCase(model_type="qwen2"))).get("pad_token_id") is None


def test_parity_catches_a_port_that_trains_the_pad_row(spec, monkeypatch):
    """HF's Qwen2 embedding has padding_idx=pad_token_id: with the pad id in the documents, a
    port whose embedding trains that row has a wrong embedding gradient."""
    original = spec.model_class.__init__

    def without_padding_idx(self, model_args):
        original(self, model_args)
        self.tok_embeddings.padding_idx = None

    monkeypatch.setattr(spec.model_class, "__init__", without_padding_idx)
    case = ModelCase(model_type="qwen2", config_overrides={"num_key_value_heads": 2, "pad_token_id": 7})
    failed = _failed(run_parity_stage(case, raise_on_failure=False))
    assert any(name.startswith("gradients of every parameter") for name in failed)
    assert not any(name.startswith("logits") for name in failed)
