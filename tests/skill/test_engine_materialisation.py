"""What a package built on the meta device keeps through AReaL's materialisation order
(``to_empty``, the checkpoint's load, ``init_buffers``, with no ``init_weights``): the LM head's
tie (the references' ``to_empty``) and the router's score-correction bias (the package's
``CorrectionBiasMoE``, written by the ``correction_bias`` edit and held by the deepseek_v3
reference). AReaL's own engine code runs these in the AReaL tier (``tests/areal``); here the
pieces are proven on their own, against the shared ``MoE`` that AReaL's mirrors.
"""

from __future__ import annotations

import functools
from pathlib import Path

import libcst as cst
import pytest
import torch
from transformers.utils import logging as hf_logging

from archon_models.moe import MoE, MoEArgs
from skill.analysis import AnalyzeInput, ArchitectureReport, analyze_hf_model
from skill.harness.models import get_spec
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import PortPlan, plan_from_report
from skill.snippets import snippet
from skill.snippets.moe import CorrectionBiasMoE
from skill.tiny_model import tiny_config

hf_logging.set_verbosity_error()

REPO = Path(__file__).resolve().parents[2]
EXPERTS, DIM, HIDDEN = 4, 16, 8


def _args(load_balance_coeff: float | None = None) -> MoEArgs:
    return MoEArgs(num_experts=EXPERTS, top_k=1, score_func="sigmoid", load_balance_coeff=load_balance_coeff)


def _materialised(moe_class: type[MoE], checkpoint: dict[str, torch.Tensor], coeff: float | None) -> MoE:
    """AReaL's order: built on meta, cast to bf16, ``to_empty``, loaded (not strictly, as
    ``load_model_from_hf`` loads), ``init_buffers``."""
    with torch.device("meta"):
        moe = moe_class(_args(coeff), DIM, HIDDEN)
    moe = moe.to(torch.bfloat16)
    moe.to_empty(device="cpu")
    moe.load_state_dict(checkpoint, strict=False)
    moe.init_buffers(buffer_device="cpu")
    return moe


def _checkpoint() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    saved = CorrectionBiasMoE(_args(), DIM, HIDDEN)
    with torch.no_grad():
        saved.expert_bias.copy_(torch.tensor([0.1234567, -0.2, 0.05, 0.3]))
    return {k: v.detach().clone() for k, v in saved.state_dict().items()}


# --- CorrectionBiasMoE -------------------------------------------------------------------


def test_the_bias_is_saved_state_from_construction_on_the_meta_device() -> None:
    with torch.device("meta"):
        moe = CorrectionBiasMoE(_args(), DIM, HIDDEN)
    assert "expert_bias" in moe.state_dict()
    assert moe.expert_bias.dtype == torch.float32 and tuple(moe.expert_bias.shape) == (EXPERTS,)
    assert moe.load_balance_coeff is None  # not balancing: nothing is meant to move it


@pytest.mark.parametrize("coeff", [None, 1e-3])
def test_the_checkpoints_bias_survives_areals_order_in_fp32(coeff: float | None) -> None:
    checkpoint = _checkpoint()
    moe = _materialised(CorrectionBiasMoE, checkpoint, coeff)
    assert moe.expert_bias.dtype == torch.float32 and moe.experts.w1.dtype == torch.bfloat16
    assert torch.equal(moe.expert_bias, checkpoint["expert_bias"])  # bit-exact: never through bf16
    assert "expert_bias" in moe.state_dict() and "tokens_per_expert" not in moe.state_dict()
    assert moe.load_balance_coeff == coeff


def test_the_shared_moe_alone_loses_the_bias_in_that_order() -> None:
    # What the package's class is for: the shared MoE makes expert_bias only in init_buffers,
    # as zeros (and only when balancing), after the checkpoint was loaded.
    moe = _materialised(MoE, _checkpoint(), 1e-3)
    assert moe.expert_bias is not None and not moe.expert_bias.any()


def test_init_weights_starts_the_bias_at_zero() -> None:
    moe = CorrectionBiasMoE(_args(), DIM, HIDDEN)
    with torch.no_grad():
        moe.expert_bias.fill_(0.5)
    moe.init_weights(0.02)
    assert not moe.expert_bias.any()


def test_the_bias_chooses_the_experts() -> None:
    torch.manual_seed(1)
    moe = CorrectionBiasMoE(_args(), DIM, HIDDEN)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # sigmoid scores lie in (0, 1)
    moe(torch.randn(1, 6, DIM))
    assert moe.tokens_per_expert.tolist() == [0.0, 0.0, 6.0, 0.0]


def test_the_deepseek_v3_reference_holds_the_snippet() -> None:
    source = (REPO / "archon_models/deepseek_v3/model/model.py").read_text()
    module = cst.parse_module(source)
    reference = next(s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == "CorrectionBiasMoE")
    assert module.code_for_node(reference.with_changes(leading_lines=[])) == snippet("moe", "CorrectionBiasMoE")


# --- the edits ------------------------------------------------------------------------------


@functools.cache
def report_for(model_type: str) -> ArchitectureReport:
    return analyze_hf_model(AnalyzeInput(source=model_type))


@functools.cache
def plan_of(model_type: str) -> PortPlan:
    return plan_from_report(report_for(model_type), model_type)


def _edited(reference: str, plan: PortPlan, names: list[str]) -> str:
    model_class = {"qwen3": "Qwen3Model", "deepseek_v3": "DeepseekV3Model"}[reference]
    text = (REPO / f"archon_models/{reference}/model/model.py").read_text()
    ctx = EditContext(camel=model_class.removesuffix("Model"), model_class=model_class, profile=plan)
    return apply_model_edits(text, ctx, names)


def _block(text: str) -> str:
    return text.split("class TransformerBlock", 1)[1].split("\nclass ", 1)[0]


@pytest.mark.parametrize("extra", [(), ("all_layers_moe",), ("logit_selection_bias",)])
def test_correction_bias_builds_the_packages_moe_where_the_block_builds_one(extra: tuple[str, ...]) -> None:
    plan = plan_of("glm4_moe")
    names = ["remove_qk_norm", *extra, "correction_bias"]
    text = _edited("qwen3", plan, names)
    assert text.count("class CorrectionBiasMoE(MoE):") == 1
    assert "self.moe = CorrectionBiasMoE(model_args.moe_args" in _block(text)
    assert "= MoE(" not in _block(text)
    assert _edited("qwen3", plan, list(reversed(names))) == text  # any order
    compile(text, "<edited>", "exec")


def test_a_family_without_the_bias_on_the_mla_reference_builds_areals_moe() -> None:
    plan = plan_of("deepseek_v2")
    text = _edited("deepseek_v3", plan, ["no_correction_bias", "max_group_router"])
    assert "CorrectionBiasMoE" not in text
    assert "self.moe = MoE(model_args.moe_args" in _block(text)
    compile(text, "<edited>", "exec")


def test_dense_layers_on_the_mla_reference_leave_no_moe_class() -> None:
    plan = plan_of("deepseek_v2").model_copy(update={"moe": False})
    text = _edited("deepseek_v3", plan, ["dense_layers"])
    assert "CorrectionBiasMoE" not in text and "MoE(" not in text
    compile(text, "<edited>", "exec")


# --- the tie through to_empty -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "deepseek_v3"])
def test_a_tied_head_stays_tied_through_to_empty(model_type: str) -> None:
    config = tiny_config(model_type, tie_word_embeddings=True)
    spec = get_spec(model_type)
    args = spec.model_args_class.from_hf_config(config, attn_type="sdpa")
    assert args.enable_weight_tying
    with torch.device("meta"):
        model = spec.model_class(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.to_empty(device="cpu") is model
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.device.type == "cpu"
