"""Llama 4 (text): what the analysis measures of it, and its port through the real HF class.

Each Llama 4 feature is an edit of its own, proven on generated families too: chunked local
attention (test_chunked_attention), a QK norm on the RoPE layers only (test_rope_layer_qk_norm),
the MoE block named feed_forward (test_moe_fuzz_layouts). Here: the attention temperature of the
NoPE layers and the routing weights on the experts' input, measured on the HF model, and the
whole family ported with its one refusal lifted, so the edits are proven together on the model
users load. That refusal is real: stage 5's gradients under tensor-parallel experts are off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from skill.analysis import reference
from skill.features import QueryPositionScale
from skill.porting.port_model import PortModelRequest, port_model
from tests.skill.test_port_rope import _workspace

STAGE5_LIMIT = (
    "routing weights on the experts' input (MoEArgs.score_before_experts): the gradients under tensor-parallel "
    "experts are wrong (stage 5)"
)


def test_llama4_measurements_and_its_one_refusal():
    from skill.porting.plan import plan_for, report_for

    report = report_for("llama4_text")
    attention, moe = report.checklist.attention, report.checklist.moe
    # Llama4TextAttention: q *= log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 on the NoPE layers,
    # if attn_temperature_tuning; the tiny model's positions never reach floor_scale=8192.
    assert attention.query_position_scale == QueryPositionScale(
        beta_field="attn_scale",
        period_field="floor_scale",
        offset=1,
        nope_layers_only=True,
        switch_field="attn_temperature_tuning",
    )
    assert report.checklist.forward_switches["attn_temperature_tuning"] is True
    # Llama4TextMoe: routed_in = hidden_states * router_scores, then the experts.
    assert moe is not None and moe.score_before_experts is True
    assert plan_for("llama4_text").score_before_experts
    assert report.unsupported == [f"unsupported: {STAGE5_LIMIT}"]
    # The references' form reads as before: no such fact.
    assert report_for("qwen3_moe").checklist.moe.score_before_experts is None
    assert "offset" not in report_for("ministral3").checklist.attention.model_dump()["query_position_scale"]


@pytest.mark.every_family  # a full port of the real class (about 40 s); .ci/run runs it
@pytest.mark.slow
def test_llama4_ports_through_stages_1_to_4_and_6_with_the_stage5_limit_lifted(tmp_path: Path, monkeypatch):
    limits = reference.engine_limits
    monkeypatch.setattr(
        reference, "engine_limits", lambda checklist: [x for x in limits(checklist) if x != STAGE5_LIMIT]
    )
    # A folder of its own, so no report analysed with the limit in place is reused.
    folder = tmp_path / "llama4_text"
    AutoConfig.for_model("llama4_text").save_pretrained(folder)
    root = _workspace(tmp_path)
    result = port_model(
        PortModelRequest(source=str(folder), model_name="llama4_text", stages=[1, 2, 3, 4, 6], workspace=root)
    )
    failing = "; ".join(f"{s.step}: {s.detail[:300]}" for s in result.steps if not s.ok)
    assert result.passed, f"{result.failed_step}: {result.error} {result.unsupported}\n{failing}"
    model_py = (root / "archon_models" / "llama4_text" / "model" / "model.py").read_text()
    for edit in ("chunked_attention", "query_position_scale", "qk_norm_on_rope_layers", "nope_layers"):
        assert edit in model_py.split('"""', 1)[0], edit
    assert (
        "moe_args.score_before_experts = True"
        in (root / "archon_models" / "llama4_text" / "model" / "args.py").read_text()
    )
