"""MoE layouts the architecture fuzzer draws from the engine's vocabulary, each ported.

Families written by ``tests/fuzz`` (remote code transformers does not ship), analysed and
ported through ``port_model`` with ``trust_remote_code``, as ``archon-port add <folder>
--trust-remote-code`` does:

- fused expert tensors stored in x out (gpt-oss's orientation) whose gate/up tensor is
  square in the tiny model (``2 * moe_intermediate_size == hidden_size``): the shapes fit
  both orientations, the gate/up zeroing probe tells which one HF computes with (bench
  seeds 18, 35 were refused as "different orientations");
- a fused q/k/v projection in a MoE family: the same split as a dense family's, at the head
  of the MoE adapter's loops (bench seeds 4, 68 were refused);
- both at once, and the q/k/v rows grouped per KV head (bench seeds 6, 71).

A full port costs 15-20 worker-seconds: the default run ports the last of these (both layouts
at once, :func:`test_grouped_fused_qkv_and_fused_experts_compose`); every other port here carries
the ``every_family`` marker, which ``.ci/run`` runs as its own step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skill.analysis.detect import expert_activation_mismatches
from skill.features import ExpertLayout, GateUpOrder, WeightOrientation
from skill.porting.plan import report_for
from skill.porting.port_model import PortModelRequest, port_model
from tests.fuzz import check_family, write_family
from tests.fuzz.spec import AttentionSpec, FamilySpec, FFNSpec, MLASpec, MoESpec, RopeSpec, plain_family
from tests.skill.test_port_rope import _workspace

STAGES = [1, 2, 3, 4]


def _family(tmp_path: Path, spec: FamilySpec) -> Path:
    folder = write_family(spec, tmp_path / spec.name)
    check_family(spec, folder)
    return folder


def _fused_experts(name: str, layout: str, order: str) -> FamilySpec:
    return plain_family(
        name,
        moe=MoESpec(n_experts=4, top_k=2, moe_intermediate_size=32, layout=layout, gate_up_order=order),
    )


@pytest.mark.fuzz
@pytest.mark.parametrize(
    ("layout", "order"),
    [
        ("fused_in_out", "concatenated"),
        ("fused_in_out", "interleaved"),
        ("fused_out_in", "concatenated"),
        ("fused_out_in", "interleaved_up_first"),
        ("fused_in_out", "concatenated_up_first"),
    ],
)
def test_square_fused_expert_tensors_are_read_in_the_orientation_hf_computes_with(tmp_path, layout, order):
    """Before: the in x out families were read (out, in) for the gate/up tensor (its shape fits
    both) and (in, out) for the down one, then refused for mixed orientations and an order no
    probe explained."""
    name = f"fzsq{layout[6:9].replace('_', '')}{order[:3]}{'up' if order.endswith('up_first') else ''}"
    spec = _fused_experts(name, layout, order)
    report = report_for(str(_family(tmp_path, spec)), True)
    moe = report.checklist.moe
    assert moe is not None
    expected = WeightOrientation.IN_OUT if layout == "fused_in_out" else WeightOrientation.OUT_IN
    assert (moe.expert_layout, moe.expert_orientation, moe.expert_gate_up) == (
        ExpertLayout.FUSED_3D,
        expected,
        GateUpOrder(order),
    )
    assert report.unsupported == []


def _ported(tmp_path: Path, spec: FamilySpec, stages: list[int]) -> None:
    folder = _family(tmp_path, spec)
    root = _workspace(tmp_path)
    result = port_model(PortModelRequest(source=str(folder), trust_remote_code=True, stages=stages, workspace=root))
    failing = "; ".join(f"{s.step}: {s.detail[:300]}" for s in result.steps if not s.ok)
    assert result.passed, f"{result.failed_step}: {result.error} {result.unsupported}\n{failing}"
    assert [r.stage for r in result.stage_results] == stages


@pytest.mark.every_family  # a full port; .ci/run runs it
@pytest.mark.fuzz
@pytest.mark.slow
def test_moe_block_named_feed_forward_ports(tmp_path):
    """Llama 4's names: the router, routed and shared experts in the layer's feed_forward, and
    the dense layers' MLP there too. Before: refused, "MoE experts stored under another module
    than mlp or block_sparse_moe"; the adapter now names the block as the analysis measured it."""
    spec = plain_family(
        "fzmoeff",
        moe=MoESpec(
            n_experts=4,
            top_k=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            shared_style="qwen",
            shared_intermediate_size=64,
            layers="sparse_step",
            sparse_step=2,
            block_name="feed_forward",
        ),
    )
    report = report_for(str(_family(tmp_path, spec)), True)
    assert report.checklist.moe is not None
    assert ".{}.feed_forward.experts." in report.checklist.moe.expert_key_template
    assert report.unsupported == []
    _ported(tmp_path / "port", spec, STAGES)


@pytest.mark.every_family  # a full port; .ci/run runs it
@pytest.mark.fuzz
@pytest.mark.slow
def test_in_out_fused_experts_port(tmp_path):
    _ported(tmp_path, _fused_experts("fzinout", "fused_in_out", "interleaved"), [*STAGES, 6])


@pytest.mark.every_family  # a full port; .ci/run runs it
@pytest.mark.fuzz
@pytest.mark.slow
def test_moe_family_with_fused_qkv_ports(tmp_path):
    """Before: refused, "a fused q/k/v projection in a MoE family (the MoE adapter does not
    split it)"; before that refusal, edit_adapter_map failed with a CodemodError (bench seed 4)."""
    spec = plain_family(
        "fzmoefused",
        moe=MoESpec(n_experts=4, top_k=2, moe_intermediate_size=32),
        attention=AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16, explicit_head_dim=False, fused_qkv="stacked"),
    )
    _ported(tmp_path, spec, [*STAGES, 6])


@pytest.mark.fuzz
@pytest.mark.slow
def test_grouped_fused_qkv_and_fused_experts_compose(tmp_path):
    """Both fused layouts in one adapter: the q/k/v split (rows regrouped per KV head) and the
    experts' split and transpose share from_hf's and to_hf's loops (bench seeds 6, 71)."""
    spec = plain_family(
        "fzmoeboth",
        moe=MoESpec(n_experts=4, top_k=2, moe_intermediate_size=32, layout="fused_in_out"),
        attention=AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16, explicit_head_dim=False, fused_qkv="grouped"),
    )
    _ported(tmp_path, spec, [*STAGES, 6])


@pytest.mark.every_family  # a full port; .ci/run runs it
@pytest.mark.fuzz
@pytest.mark.slow
@pytest.mark.parametrize(
    "moe",
    [
        # Dense layers between MoE layers, gated shared expert of its own width (bench seed 36).
        MoESpec(
            n_experts=4,
            top_k=1,
            moe_intermediate_size=32,
            n_shared_experts=1,
            shared_style="qwen",
            shared_gate=True,
            shared_intermediate_size=64,
            layers="sparse_step",
            sparse_step=2,
            layout="fused_in_out",
        ),
        # Every layer MoE, DeepSeek's shared experts: FeedForward stays as their MLP.
        MoESpec(n_experts=4, top_k=2, moe_intermediate_size=32, n_shared_experts=1, shared_style="deepseek"),
    ],
    ids=["sparse_step_qwen_shared", "all_layers_deepseek_shared"],
)
def test_moe_experts_activated_by_gelu_port(tmp_path, moe):
    """Before: refused, "MoE experts with the 'gelu_pytorch_tanh' activation (shared experts run
    SiLU)" (bench seeds 36, 63, 76): routed and shared experts now run the measured activation."""
    spec = plain_family("fzmoegelu", moe=moe, ffn=FFNSpec(kind="gated", activation="gelu_pytorch_tanh"))
    _ported(tmp_path, spec, STAGES)


@pytest.mark.every_family  # a full port; .ci/run runs it
@pytest.mark.fuzz
@pytest.mark.slow
def test_mla_moe_without_shared_experts_ports(tmp_path):
    """Before: refused, "shared experts (absent)" (bench seed 59): the deepseek_v3 reference
    reads ``n_shared_experts`` (0 when the config has none) and its MoE then builds none; the
    routed experts are counted by the family's own field (``num_experts`` here, not DeepSeek's
    ``n_routed_experts``: the port read 0 experts and failed at stage 2 before)."""
    mla = MLASpec(
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=24,
        head_dim_in_config=True,
        rope_interleave=False,
    )
    spec = plain_family(
        "fzmlanoshared",
        mla=mla,
        rope=RopeSpec(pairing="half"),
        attention=AttentionSpec(n_heads=4, n_kv_heads=4, head_dim=32, explicit_head_dim=False),
        moe=MoESpec(
            n_experts=8,
            top_k=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            layers="leading_dense",
            first_k_dense=1,
        ),
    )
    _ported(tmp_path, spec, STAGES)


class _MLP(torch.nn.Module):
    def __init__(self, act: torch.nn.Module):
        super().__init__()
        self.gate_proj = torch.nn.Linear(8, 4, bias=False)
        self.up_proj = torch.nn.Linear(8, 4, bias=False)
        self.down_proj = torch.nn.Linear(4, 8, bias=False)
        self.act_fn = act


class _MoEBlock(torch.nn.Module):
    def __init__(self, routed: torch.nn.Module, shared: torch.nn.Module):
        super().__init__()
        self.gate = torch.nn.Linear(8, 2, bias=False)
        self.experts = torch.nn.ModuleList([_MLP(routed), _MLP(routed)])
        self.shared_expert = _MLP(shared)


def test_routed_and_shared_expert_activations_are_measured_each_on_its_own():
    """The port gives routed and shared experts the MLP's activation: an expert module computing
    another one is named (measured numerically on its activation module, not read from a name)."""
    same = _MoEBlock(torch.nn.GELU(approximate="tanh"), torch.nn.GELU(approximate="tanh"))
    assert expert_activation_mismatches(same, "gelu_pytorch_tanh") == []
    shared_silu = _MoEBlock(torch.nn.GELU(approximate="tanh"), torch.nn.SiLU())
    assert expert_activation_mismatches(shared_silu, "gelu_pytorch_tanh") == [
        "shared experts (shared_expert) activated by 'silu' while the MLP's activation is 'gelu_pytorch_tanh'"
    ]
    routed_relu = _MoEBlock(torch.nn.ReLU(), torch.nn.SiLU())
    assert expert_activation_mismatches(routed_relu, "silu") == [
        "routed experts activated by 'relu' while the MLP's activation is 'silu'"
    ]
