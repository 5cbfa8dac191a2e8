"""Llama 4 (text): what the analysis measures of it.

Each Llama 4 feature is an edit of its own, proven on generated families too: chunked local
attention (test_chunked_attention), a QK norm on the RoPE layers only (test_rope_layer_qk_norm),
the MoE block named feed_forward (test_moe_fuzz_layouts). Here: the attention temperature of the
NoPE layers and the routing weights on the experts' input, measured on the HF model. The package
itself (archon_models/llama4_text) passes stages 1-6 in tests/archon/test_llama4_text.py.
"""

from __future__ import annotations

from skill.features import QueryPositionScale


def test_llama4_measurements():
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
    assert report.unsupported == []
    # The references' form reads as before: no such fact.
    assert report_for("qwen3_moe").checklist.moe.score_before_experts is None
    assert "offset" not in report_for("ministral3").checklist.attention.model_dump()["query_position_scale"]


def test_the_router_of_a_score_before_experts_moe_keeps_whole_gradients_under_tensor_parallel_experts():
    # Declared partial (the references' plan), every gradient under tp=2 and ep=2 x tp=2 (etp=2)
    # came out off (99 of 107 tensors, the router's by 2.8e-2) while the logits matched: the
    # experts' input gradient is already summed over the TP ranks. Stage 5 proves the plan.
    from pathlib import Path

    plan = (Path(__file__).resolve().parents[2] / "archon_models/llama4_text/infra/parallelize.py").read_text()
    assert "local_output_grad_placements=(Partial() if ep_mesh is not None and etp == 1 else Replicate(),)" in plan
    assert '"moe.router.gate": partial_grad,' not in plan
