"""MoE building blocks: router semantics, expert compute paths, parity with HF's MoE
blocks (Qwen3-MoE, Qwen2-MoE, Mixtral) in fp32, and the 3D <-> per-expert converter
against the keys ``save_pretrained`` really writes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from archon_models.moe import FeedForward, GroupedExperts, MoE, MoEArgs, TokenChoiceTopKRouter, TokenReorderer
from archon_models.moe.grouped_experts import _run_experts_for_loop, _run_experts_grouped_mm
from archon_models.moe.utils import _permute, _unpermute, generate_permute_indices, indices_padding_wrapper
from archon_models.moe_weight_converter import MoEWeightConverter
from skill.tiny_model import build_tiny_model, tiny_config

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 12, 6, 2, 40


def _router(**kwargs) -> TokenChoiceTopKRouter:
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(dim=DIM, num_experts=EXPERTS, top_k=TOP_K, **kwargs)
    router.init_weights(0.5)
    return router


def _naive_swiglu(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor, expert: int) -> torch.Tensor:
    return (F.silu(x @ w1[expert].t()) * (x @ w3[expert].t())) @ w2[expert].t()


# ---------------------------------------------------------------------------- router


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_picks_top_k_of_scores_and_counts_them(score_func: str) -> None:
    router = _router(score_func=score_func)
    x = torch.randn(TOKENS, DIM)
    top_scores, selected, counts = router(x)

    logits = x @ router.gate.weight.t()
    probs = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    expected_selected = probs.topk(TOP_K, dim=-1).indices
    assert torch.equal(selected.sort(-1).values, expected_selected.sort(-1).values)
    torch.testing.assert_close(top_scores, probs.gather(1, selected))
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(selected.view(-1), minlength=EXPERTS))


def test_route_norm_renormalises_and_route_scale_multiplies() -> None:
    x = torch.randn(TOKENS, DIM)
    plain, selected, _ = _router(score_func="softmax")(x)
    normed, selected_normed, _ = _router(score_func="softmax", route_norm=True, route_scale=2.5)(x)
    assert torch.equal(selected, selected_normed)
    torch.testing.assert_close(normed, 2.5 * plain / plain.sum(-1, keepdim=True))
    torch.testing.assert_close(normed.sum(-1), torch.full((TOKENS,), 2.5))


def test_expert_bias_changes_choice_not_scores() -> None:
    router = _router(score_func="sigmoid")
    x = torch.randn(TOKENS, DIM)
    bias = torch.zeros(EXPERTS)
    bias[3] = 10.0  # expert 3 wins every token
    top_scores, selected, counts = router(x, bias)
    assert bool((selected == 3).any(-1).all())
    assert int(counts[3]) == TOKENS
    torch.testing.assert_close(top_scores, (x @ router.gate.weight.t()).sigmoid().gather(1, selected))


def test_node_limited_routing_stays_in_best_groups() -> None:
    router = _router(score_func="sigmoid", num_expert_groups=3, num_limited_groups=1)
    x = torch.randn(TOKENS, DIM)
    _, selected, _ = router(x)
    scores = (x @ router.gate.weight.t()).sigmoid().view(TOKENS, 3, EXPERTS // 3)
    best_group = scores.topk(2, dim=-1).values.sum(-1).argmax(-1)
    assert torch.equal(selected // (EXPERTS // 3), best_group.unsqueeze(-1).expand(-1, TOP_K))


def test_router_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="score_func"):
        TokenChoiceTopKRouter(DIM, EXPERTS, TOP_K, score_func="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_limited_groups"):
        TokenChoiceTopKRouter(DIM, EXPERTS, TOP_K, num_expert_groups=2)
    with pytest.raises(ValueError, match="top_k"):
        MoEArgs(num_experts=4, top_k=5)


def test_moe_args_from_hf_config_reads_only_what_areal_reads() -> None:
    """AReaL 1.0.4's MoEArgs.from_hf_config: experts, top-k, norm_topk_prob, softmax; no
    shared experts (a family sets those in its package) and defaults for absent fields."""
    qwen2 = MoEArgs.from_hf_config(tiny_config("qwen2_moe", norm_topk_prob=True))
    assert (qwen2.num_experts, qwen2.top_k, qwen2.route_norm, qwen2.score_func) == (4, 2, True, "softmax")
    assert (qwen2.shared_expert_intermediate_size, qwen2.use_shared_expert_gate) == (0, False)
    mixtral = MoEArgs.from_hf_config(tiny_config("mixtral"))
    assert (mixtral.num_experts, mixtral.route_norm, mixtral.shared_expert_intermediate_size) == (4, False, 0)

    class Bare:
        pass

    bare = MoEArgs.from_hf_config(Bare())
    assert (bare.num_experts, bare.top_k, bare.route_norm) == (8, 1, False)


def test_reorderer_sorts_slots_stably_by_expert() -> None:
    selected = torch.tensor([[2, 0], [0, 1], [2, 1]])
    scores = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    sorted_scores, slots, counts = TokenReorderer(num_experts=4, top_k=2)(scores, selected)
    assert slots.tolist() == [1, 2, 3, 5, 0, 4]
    torch.testing.assert_close(sorted_scores, torch.tensor([0.2, 0.3, 0.4, 0.6, 0.1, 0.5]))
    assert counts.tolist() == [2, 2, 2, 0]


# ---------------------------------------------------------------------------- experts


def _experts() -> GroupedExperts:
    torch.manual_seed(1)
    experts = GroupedExperts(DIM, HIDDEN, EXPERTS, use_grouped_mm=False)
    experts.init_weights(0.2)
    return experts


def test_grouped_experts_cpu_path_matches_naive_per_expert_compute() -> None:
    experts = _experts()
    counts = torch.tensor([3, 0, 5, 1, 0, 7])
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)
    out = experts(x, counts)

    w1, w2, w3 = (w.detach().clone().requires_grad_() for w in (experts.w1, experts.w2, experts.w3))
    owners = torch.repeat_interleave(torch.arange(EXPERTS), counts)
    x_ref = x.detach().clone().requires_grad_()
    ref = torch.stack([_naive_swiglu(w1, w2, w3, x_ref[i], int(e)) for i, e in enumerate(owners)])
    torch.testing.assert_close(out, ref)

    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for mine, theirs in zip((experts.w1, experts.w2, experts.w3), (w1, w2, w3), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_grouped_mm_path_with_padding_matches_loop() -> None:
    """``torch._grouped_mm`` has a CPU forward: enough to check the aligned, padded layout."""
    experts = _experts()
    counts = torch.tensor([3, 0, 5, 1, 0, 7])
    x = torch.randn(int(counts.sum()), DIM)
    w = (experts.w1.detach(), experts.w2.detach(), experts.w3.detach())
    grouped = indices_padding_wrapper(_run_experts_grouped_mm)(*w, x, counts)
    torch.testing.assert_close(grouped, _run_experts_for_loop(*w, x, counts))


def test_permute_regroups_rank_major_rows_expert_major_with_padding() -> None:
    # 2 source ranks x 3 local experts; rows are labelled by (rank, expert, i).
    counts = torch.tensor([2, 0, 1, 1, 3, 0])
    labels = [(r, e, i) for r in range(2) for e in range(3) for i in range(int(counts[r * 3 + e]))]
    x = torch.arange(len(labels), dtype=torch.float32).unsqueeze(-1).expand(-1, 4).contiguous()
    shape, permuted, indices, aligned = _permute(x, counts, ep_degree=2, num_local_experts=3, alignment=4)

    assert aligned.tolist() == [4, 4, 4]
    order = sorted(range(len(labels)), key=lambda j: (labels[j][1], labels[j][0], labels[j][2]))
    rows = [permuted[i, 0].item() for i in range(12) if indices[i] < len(labels)]
    assert rows == [float(j) for j in order]
    for expert, start in enumerate((0, 4, 8)):
        n_real = int(counts[expert] + counts[3 + expert])
        assert torch.all(permuted[start + n_real : start + 4] == 0)
    torch.testing.assert_close(_unpermute(permuted, shape, indices), x)

    plain_indices, plain_counts = generate_permute_indices(counts, 3, 2, alignment=1)
    assert plain_counts.tolist() == [3, 3, 1] and plain_indices.tolist() == order


# ---------------------------------------------------------------------------- parity with HF


def _copy_hf_block_into_moe(block: torch.nn.Module, moe: MoE) -> None:
    hidden = moe.hidden_dim
    with torch.no_grad():
        moe.router.gate.weight.copy_(block.gate.weight)
        moe.experts.w1.copy_(block.experts.gate_up_proj[:, :hidden])
        moe.experts.w3.copy_(block.experts.gate_up_proj[:, hidden:])
        moe.experts.w2.copy_(block.experts.down_proj)
        shared = getattr(block, "shared_expert", None)
        if shared is not None:
            moe.shared_experts.w1.weight.copy_(shared.gate_proj.weight)
            moe.shared_experts.w3.weight.copy_(shared.up_proj.weight)
            moe.shared_experts.w2.weight.copy_(shared.down_proj.weight)
            moe.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)


def _hf_grads_in_archon_layout(block: torch.nn.Module, hidden: int) -> dict[str, torch.Tensor]:
    grads = {
        "router.gate.weight": block.gate.weight.grad,
        "experts.w1": block.experts.gate_up_proj.grad[:, :hidden],
        "experts.w3": block.experts.gate_up_proj.grad[:, hidden:],
        "experts.w2": block.experts.down_proj.grad,
    }
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        grads |= {
            "shared_experts.w1.weight": shared.gate_proj.weight.grad,
            "shared_experts.w3.weight": shared.up_proj.weight.grad,
            "shared_experts.w2.weight": shared.down_proj.weight.grad,
            "shared_expert_gate.weight": block.shared_expert_gate.weight.grad,
        }
    return grads


HF_BLOCKS = {
    "qwen3_moe-norm_topk": ("qwen3_moe", Qwen3MoeSparseMoeBlock, {"norm_topk_prob": True}),
    "qwen3_moe-raw_topk": ("qwen3_moe", Qwen3MoeSparseMoeBlock, {"norm_topk_prob": False}),
    "qwen2_moe-shared_gate": ("qwen2_moe", Qwen2MoeSparseMoeBlock, {"norm_topk_prob": False}),
    "mixtral": ("mixtral", MixtralSparseMoeBlock, {}),
}


@pytest.mark.parametrize("block_case", list(HF_BLOCKS))
def test_moe_matches_hf_block_forward_and_gradients(block_case: str) -> None:
    model_type, block_class, overrides = HF_BLOCKS[block_case]
    config = tiny_config(model_type, **overrides)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = block_class(config)
    # 5x HF's initializer_range, so activations and gradients are far from zero. At
    # 15x the router-weight gradient (a sum over tokens through the softmax backward,
    # which cancels) differs from HF's by up to 3x the default tolerance from summation
    # order alone; HF's fp32 result is as far from an fp64 evaluation as ours.
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.1)

    moe_args = MoEArgs.from_hf_config(config)
    if model_type == "mixtral":  # Mixtral always renormalises its top-k
        moe_args = dataclasses.replace(moe_args, route_norm=True)
    if getattr(config, "shared_expert_intermediate_size", 0):  # Qwen2-MoE: one gated shared expert
        moe_args = dataclasses.replace(
            moe_args,
            shared_expert_intermediate_size=config.shared_expert_intermediate_size,
            use_shared_expert_gate=True,
        )
    hidden = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    moe = MoE(moe_args, dim=config.hidden_size, hidden_dim=hidden)
    _copy_hf_block_into_moe(block, moe)

    x = torch.randn(2, 24, config.hidden_size)
    x_hf, x_archon = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, out_archon = block(x_hf), moe(x_archon)
    torch.testing.assert_close(out_archon, out_hf)
    assert bool((moe.tokens_per_expert > 0).all()), "every expert should receive tokens"

    grad = torch.randn_like(out_hf)
    out_hf.backward(grad)
    out_archon.backward(grad)
    torch.testing.assert_close(x_archon.grad, x_hf.grad)
    archon_grads = dict(moe.named_parameters())
    for name, hf_grad in _hf_grads_in_archon_layout(block, hidden).items():
        torch.testing.assert_close(archon_grads[name].grad, hf_grad, msg=lambda m, n=name: f"{n}: {m}")


def test_moe_shared_experts_and_score_before_experts() -> None:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=EXPERTS, top_k=TOP_K, num_shared_experts=2, score_func="sigmoid")
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(0.2)
    assert isinstance(moe.shared_experts, FeedForward) and moe.shared_experts.w1.out_features == 2 * HIDDEN
    assert moe.shared_expert_gate is None
    x = torch.randn(1, TOKENS, DIM)

    top_scores, selected, _ = moe.router(x.view(-1, DIM))
    w = (moe.experts.w1, moe.experts.w2, moe.experts.w3)
    routed = torch.stack(
        [
            sum(top_scores[t, k] * _naive_swiglu(*w, x[0, t], int(selected[t, k])) for k in range(TOP_K))
            for t in range(TOKENS)
        ]
    )
    expected = routed + moe.shared_experts(x[0])
    torch.testing.assert_close(moe(x)[0], expected)

    before = MoE(dataclasses.replace(args, score_before_experts=True), DIM, HIDDEN)
    before.load_state_dict(moe.state_dict())
    routed_before = torch.stack(
        [
            sum(_naive_swiglu(*w, top_scores[t, k] * x[0, t], int(selected[t, k])) for k in range(TOP_K))
            for t in range(TOKENS)
        ]
    )
    torch.testing.assert_close(before(x)[0], routed_before + moe.shared_experts(x[0]))
    assert int(moe.tokens_per_expert.sum()) == TOKENS * TOP_K


def test_load_balance_buffers() -> None:
    moe = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, load_balance_coeff=1e-3), DIM, HIDDEN)
    assert "expert_bias" in moe.state_dict() and "tokens_per_expert" not in moe.state_dict()
    assert MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K), DIM, HIDDEN).expert_bias is None


# ---------------------------------------------------------------------------- converter

EXPERT_KEYS = {
    "qwen3_moe": (
        "mlp.experts.{}.gate_proj.weight",
        "mlp.experts.{}.down_proj.weight",
        "mlp.experts.{}.up_proj.weight",
    ),
    "qwen2_moe": (
        "mlp.experts.{}.gate_proj.weight",
        "mlp.experts.{}.down_proj.weight",
        "mlp.experts.{}.up_proj.weight",
    ),
    "mixtral": (
        "block_sparse_moe.experts.{}.w1.weight",
        "block_sparse_moe.experts.{}.w2.weight",
        "block_sparse_moe.experts.{}.w3.weight",
    ),
}


def _converter(model_type: str, num_experts: int) -> MoEWeightConverter:
    gate, down, up = EXPERT_KEYS[model_type]
    return MoEWeightConverter(
        {
            "layers.{}.moe.experts.w1": f"model.layers.{{}}.{gate}",
            "layers.{}.moe.experts.w2": f"model.layers.{{}}.{down}",
            "layers.{}.moe.experts.w3": f"model.layers.{{}}.{up}",
        },
        num_experts=num_experts,
    )


@pytest.mark.parametrize("model_type", list(EXPERT_KEYS))
def test_converter_roundtrips_saved_checkpoint_keys(model_type: str, tmp_path) -> None:
    config = tiny_config(model_type)
    model = build_tiny_model(config)
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    converter = _converter(model_type, MoEArgs.from_hf_config(config).num_experts)

    experts, rest = converter.merge_from_hf(on_disk)
    assert sorted(experts) == [
        f"layers.{layer}.moe.experts.w{i}" for layer in range(config.num_hidden_layers) for i in (1, 2, 3)
    ]
    assert not any(".experts." in key for key in rest)
    hidden = experts["layers.0.moe.experts.w1"].shape[1]
    for layer in range(config.num_hidden_layers):
        in_memory = model.model.layers[layer].mlp.experts
        torch.testing.assert_close(
            experts[f"layers.{layer}.moe.experts.w1"], in_memory.gate_up_proj[:, :hidden], rtol=0, atol=0
        )
        torch.testing.assert_close(
            experts[f"layers.{layer}.moe.experts.w3"], in_memory.gate_up_proj[:, hidden:], rtol=0, atol=0
        )
        torch.testing.assert_close(experts[f"layers.{layer}.moe.experts.w2"], in_memory.down_proj, rtol=0, atol=0)

    back = dict(rest)
    for key, weight in experts.items():
        back.update(converter.split_to_hf(key, weight))
    assert sorted(back) == sorted(on_disk)
    for key, tensor in on_disk.items():
        assert torch.equal(back[key], tensor), key
    assert converter.split_to_hf("layers.0.attention.wq.weight", torch.zeros(2, 2)) is None


def test_converter_names_missing_experts_and_rejects_bad_input() -> None:
    converter = _converter("mixtral", num_experts=3)
    hf = {}
    for i in (1, 2, 3):
        hf.update(converter.split_to_hf(f"layers.0.moe.experts.w{i}", torch.randn(3, 4, 5)))
    incomplete = {k: v for k, v in hf.items() if k != "model.layers.0.block_sparse_moe.experts.2.w3.weight"}
    with pytest.raises(KeyError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.2\.w3\.weight"):
        converter.merge_from_hf(incomplete)
    with pytest.raises(ValueError, match="out of range"):
        converter.merge_from_hf(hf | {"model.layers.0.block_sparse_moe.experts.7.w1.weight": torch.randn(4, 5)})
    with pytest.raises(ValueError, match="holds 2 experts"):
        converter.split_to_hf("layers.0.moe.experts.w1", torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="placeholder"):
        MoEWeightConverter({"layers.{}.moe.experts.w1": "model.layers.{}.mlp.experts.gate_proj.weight"})


def test_converter_areal_offline_methods() -> None:
    weight = torch.randn(4, 3, 2)
    # AReaL's offline split keeps the expert dimension: chunks of [1, out, in].
    chunks = MoEWeightConverter.split_expert_weights_offline(weight, 4)
    assert len(chunks) == 4 and chunks[1].shape == (1, 3, 2)
    pieces = [c.squeeze(0) for c in chunks]
    by_layer = {"0": {"layers.{}.moe.experts.w1": {e: pieces[e] for e in (3, 1, 0)}}}
    assert MoEWeightConverter.concatenate_expert_weights_offline(by_layer, "layers.{}.moe.experts.w1", "0", 4) is None
    by_layer["0"]["layers.{}.moe.experts.w1"][2] = pieces[2]
    stacked = MoEWeightConverter.concatenate_expert_weights_offline(by_layer, "layers.{}.moe.experts.w1", "0", 4)
    assert torch.equal(stacked, weight) and by_layer == {}
