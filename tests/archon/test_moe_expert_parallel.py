"""Expert parallel styles on two gloo processes against one process.

Gradients are compared, not only outputs: a missing reduction in a parallel style
leaves the forward exact and the gradients wrong.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from archon_models.expert_parallel import (
    ExpertTensorParallel,
    ReordererSequenceParallel,
    TensorParallel,
    apply_expert_parallel,
)
from archon_models.moe import GroupedExperts, MoE, MoEArgs
from archon_models.moe_weight_converter import MoEWeightConverter
from skill.harness.distributed import launch

pytestmark = pytest.mark.stage5

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 8, 4, 2, 12
RANKS = 2


def _moe(shared: bool) -> MoE:
    args = MoEArgs(
        num_experts=EXPERTS,
        top_k=TOP_K,
        score_func="softmax",
        route_norm=True,
        shared_expert_intermediate_size=HIDDEN if shared else 0,
        use_shared_expert_gate=shared,
        use_grouped_mm=False,
    )
    torch.manual_seed(0)
    moe = MoE(args, DIM, HIDDEN)
    moe.init_weights(0.3)
    return moe


def _experts() -> GroupedExperts:
    torch.manual_seed(1)
    experts = GroupedExperts(DIM, HIDDEN, EXPERTS, use_grouped_mm=False)
    experts.init_weights(0.3)
    return experts


def _local_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in module.named_parameters()
    }


def _numpy_tree(tree: Any) -> Any:
    """Tensors as numpy arrays: torch tensors sent through a pipe travel as shared file
    descriptors, which die with the worker; numpy arrays pickle by value."""
    if isinstance(tree, dict):
        return {k: _numpy_tree(v) for k, v in tree.items()}
    return tree.numpy()


def _torch_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _torch_tree(v) for k, v in tree.items()}
    return torch.from_numpy(tree)


def _run(module: nn.Module, *inputs: torch.Tensor, grad: torch.Tensor, extra: tuple = ()) -> dict[str, Any]:
    leaf = inputs[0].clone().requires_grad_()
    out = module(leaf, *extra)
    out.backward(grad)
    return {"out": out.detach().clone(), "x_grad": leaf.grad.clone(), "grads": _local_grads(module)}


def _convert_sharded_experts(moe: MoE) -> dict[str, torch.Tensor]:
    """Split this rank's EP-sharded experts into per-expert HF keys and stack them back."""
    converter = MoEWeightConverter(
        {
            "layers.{}.moe.experts.w1": "model.layers.{}.mlp.experts.{}.gate_proj.weight",
            "layers.{}.moe.experts.w2": "model.layers.{}.mlp.experts.{}.down_proj.weight",
            "layers.{}.moe.experts.w3": "model.layers.{}.mlp.experts.{}.up_proj.weight",
        },
        num_experts=EXPERTS,
    )
    pieces: dict[str, torch.Tensor] = {}
    for name in ("w1", "w2", "w3"):
        pieces |= converter.split_to_hf(f"layers.0.moe.experts.{name}", getattr(moe.experts, name))
    merged, rest = converter.merge_from_hf(pieces)
    assert not rest
    for name in ("w1", "w2", "w3"):
        original = getattr(moe.experts, name)
        assert merged[f"layers.0.moe.experts.{name}"].placements == original.placements
        assert torch.equal(merged[f"layers.0.moe.experts.{name}"].to_local(), original.to_local())
    some_key = next(k for k in pieces if k.endswith("gate_proj.weight"))
    with pytest.raises(KeyError, match=some_key.replace(".", r"\.")):
        converter.merge_from_hf({k: v for k, v in pieces.items() if k != some_key})
    gate_keys = sorted(k for k in pieces if k.endswith("gate_proj.weight"))
    return {"expert_ids": torch.tensor([int(k.split(".")[5]) for k in gate_keys])}


def _worker(rank: int, world_size: int, data: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))

    # EP: each rank routes its own tokens; experts 0-1 live on rank 0, 2-3 on rank 1.
    moe = _moe(shared=True)
    apply_expert_parallel(moe.experts, mesh)
    results["ep"] = _run(moe, data["x_per_rank"][rank], grad=data["g_per_rank"][rank])
    results["convert"] = _convert_sharded_experts(moe)

    # EP borrowing the TP ranks: same tokens everywhere, each rank reorders half of them.
    moe = _moe(shared=False)
    ReordererSequenceParallel()._apply(moe.reorderer, mesh)
    apply_expert_parallel(moe.experts, mesh)
    results["ep_sp"] = _run(moe, data["x_shared"], grad=data["g_shared"])

    # Experts under TP: replicated rows, partial output.
    experts = _experts()
    TensorParallel()._apply(experts, mesh)
    results["tp"] = _run(experts, data["rows"], grad=data["g_rows"], extra=(data["counts"],))

    # ETP on [ep=1, tp=2] and on [ep=2, tp=1].
    for shape in ((1, world_size), (world_size, 1)):
        experts = _experts()
        mesh_2d = init_device_mesh("cpu", shape, mesh_dim_names=("ep", "tp"))
        ExpertTensorParallel()._apply(experts, mesh_2d)
        ep_rank = mesh_2d["ep"].get_local_rank()
        rows, counts, g = (
            data["rows_per_rank"][ep_rank],
            data["counts_per_rank"][ep_rank],
            data["g_rows_per_rank"][ep_rank],
        )
        results[f"etp{shape}"] = _run(experts, rows, grad=g, extra=(counts,))
    return _numpy_tree(results)


def _sorted_rows(n_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(0, EXPERTS, (n_rows,), generator=generator), minlength=EXPERTS)
    return torch.randn(n_rows, DIM, generator=generator), counts


@pytest.fixture(scope="module")
def distributed() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    torch.manual_seed(2)
    rows_per_rank, counts_per_rank = zip(*(_sorted_rows(10 + 3 * r, seed=r) for r in range(RANKS)), strict=True)
    rows, counts = _sorted_rows(14, seed=7)
    data = {
        "x_per_rank": [torch.randn(1, TOKENS, DIM) for _ in range(RANKS)],
        "g_per_rank": [torch.randn(1, TOKENS, DIM) for _ in range(RANKS)],
        "x_shared": torch.randn(1, TOKENS, DIM),
        "g_shared": torch.randn(1, TOKENS, DIM),
        "rows": rows,
        "counts": counts,
        "g_rows": torch.randn(rows.shape[0], DIM),
        "rows_per_rank": list(rows_per_rank),
        "counts_per_rank": list(counts_per_rank),
        "g_rows_per_rank": [torch.randn(r.shape[0], DIM) for r in rows_per_rank],
    }
    return data, [_torch_tree(r) for r in launch(_worker, world_size=RANKS, args=(data,))]


def _expert_shard(grad: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    return grad.chunk(RANKS, dim=dim)[rank]


def test_expert_parallel_matches_one_process(distributed) -> None:
    data, results = distributed
    moe = _moe(shared=True)
    ref = _run(moe, torch.cat(data["x_per_rank"]), grad=torch.cat(data["g_per_rank"]))
    assert int(moe.tokens_per_expert.min()) > 0, "every expert should receive tokens"
    for rank, result in enumerate(r["ep"] for r in results):
        torch.testing.assert_close(result["out"], ref["out"][rank : rank + 1])
        torch.testing.assert_close(result["x_grad"], ref["x_grad"][rank : rank + 1])
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            torch.testing.assert_close(result["grads"][name], _expert_shard(ref["grads"][name], rank, 0))
    # Replicated weights see each rank's tokens: their gradients sum to one process's.
    for name, grad in ref["grads"].items():
        if not name.startswith("experts."):
            torch.testing.assert_close(sum(r["ep"]["grads"][name] for r in results), grad)


def test_converter_splits_and_stacks_ep_sharded_experts(distributed) -> None:
    _, results = distributed
    per_rank = EXPERTS // RANKS
    for rank, result in enumerate(results):
        assert result["convert"]["expert_ids"].tolist() == list(range(rank * per_rank, (rank + 1) * per_rank))


def test_reorderer_sequence_parallel_with_ep_gives_partial_sums(distributed) -> None:
    data, results = distributed
    ref = _run(_moe(shared=False), data["x_shared"], grad=data["g_shared"])
    torch.testing.assert_close(sum(r["ep_sp"]["out"] for r in results), ref["out"])
    torch.testing.assert_close(sum(r["ep_sp"]["x_grad"] for r in results), ref["x_grad"])
    torch.testing.assert_close(
        sum(r["ep_sp"]["grads"]["router.gate.weight"] for r in results), ref["grads"]["router.gate.weight"]
    )
    for rank, result in enumerate(r["ep_sp"] for r in results):
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            torch.testing.assert_close(result["grads"][name], _expert_shard(ref["grads"][name], rank, 0))


def test_tensor_parallel_experts_partial_output_reduced_input_grad(distributed) -> None:
    data, results = distributed
    ref = _run(_experts(), data["rows"], grad=data["g_rows"], extra=(data["counts"],))
    torch.testing.assert_close(sum(r["tp"]["out"] for r in results), ref["out"])
    for rank, result in enumerate(r["tp"] for r in results):
        torch.testing.assert_close(result["x_grad"], ref["x_grad"])
        torch.testing.assert_close(result["grads"]["w1"], _expert_shard(ref["grads"]["w1"], rank, 1))
        torch.testing.assert_close(result["grads"]["w3"], _expert_shard(ref["grads"]["w3"], rank, 1))
        torch.testing.assert_close(result["grads"]["w2"], _expert_shard(ref["grads"]["w2"], rank, 2))


@pytest.mark.parametrize("shape", [(1, RANKS), (RANKS, 1)], ids=["ep1_tp2", "ep2_tp1"])
def test_expert_tensor_parallel_matches_one_process(distributed, shape: tuple[int, int]) -> None:
    data, results = distributed
    ep, tp = shape
    refs = [
        _run(_experts(), data["rows_per_rank"][r], grad=data["g_rows_per_rank"][r], extra=(data["counts_per_rank"][r],))
        for r in range(ep)
    ]
    # Ranks are laid out ep-major: rank = ep_rank * tp + tp_rank.
    outs = [[results[e * tp + t][f"etp{shape}"] for t in range(tp)] for e in range(ep)]
    for e in range(ep):
        torch.testing.assert_close(sum(o["out"] for o in outs[e]), refs[e]["out"])
        for o in outs[e]:
            torch.testing.assert_close(o["x_grad"], refs[e]["x_grad"])
    full = {name: sum(ref["grads"][name] for ref in refs) for name in ("w1", "w2", "w3")}
    for e in range(ep):
        for t in range(tp):
            grads = outs[e][t]["grads"]
            for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
                expected = full[name].chunk(ep, dim=0)[e].chunk(tp, dim=dim)[t]
                torch.testing.assert_close(grads[name], expected)
