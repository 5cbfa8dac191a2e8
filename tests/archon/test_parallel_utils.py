"""The parallel building blocks: constraint checks, Ulysses all-to-all, pipeline split,
activation checkpointing, compile wrapping and the forked gloo launcher."""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from archon_models.activation_checkpoint import ActivationCheckpointConfig, apply_ac
from archon_models.compile import apply_compile
from archon_models.parallel_dims import ArchonParallelDims
from archon_models.pipeline_parallel import ArchonPipelineConfig, generate_llm_fqn_per_model_part, pipeline_llm
from archon_models.ulysses import (
    gather_heads_scatter_seq,
    gather_seq_scatter_heads,
    ulysses_gather_output,
    ulysses_slice_inputs,
)
from archon_models.utils import validate_cp_constraints, validate_ep_constraints, validate_tp_constraints
from skill.harness import ModelCase, distributed
from skill.harness.distributed import WorkerFailure, launch
from skill.harness.inputs import make_packed_inputs, next_token_loss
from skill.harness.models import build_archon_model, build_hf_config


def _heads(n_heads: int, n_kv_heads: int | None) -> SimpleNamespace:
    return SimpleNamespace(n_heads=n_heads, n_kv_heads=n_kv_heads)


# ------------------------------------------------------------------ constraint checks


def test_tp_constraints():
    validate_tp_constraints(_heads(8, 4), 4)
    validate_tp_constraints(_heads(8, None), 8)  # n_kv_heads None means MHA
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be divisible by tp_size \(4\)"):
        validate_tp_constraints(_heads(6, 2), 4)
    with pytest.raises(ValueError, match=r"n_kv_heads \(2\) must be divisible by tp_size \(4\)"):
        validate_tp_constraints(_heads(8, 2), 4)


def test_cp_constraints():
    validate_cp_constraints(_heads(8, 4), 2, tp_size=2)  # 4 q / 2 kv heads per TP rank over 2
    validate_cp_constraints(_heads(8, 2), 4)  # kv heads repeated 2x, and 2 divides n_rep 4
    with pytest.raises(ValueError, match=r"n_heads / tp_size = 8 / 2 = 4 query heads .* cp_size \(8\)"):
        validate_cp_constraints(_heads(8, 8), 8, tp_size=2)
    with pytest.raises(ValueError, match=r"3 key/value heads per TP rank must be divisible by cp_size \(2\)"):
        validate_cp_constraints(_heads(6, 3), 2)
    with pytest.raises(ValueError, match=r"cp_size \(4\) must be a multiple of n_kv_heads / tp_size = 3"):
        validate_cp_constraints(_heads(12, 3), 4)
    # Fewer kv heads than CP ranks: they are repeated (2 kv heads x4 for 8 ranks).
    validate_cp_constraints(_heads(8, 2), 8)


def test_ep_constraints():
    moe = SimpleNamespace(moe_args=SimpleNamespace(num_experts=8))
    validate_ep_constraints(moe, 4)
    with pytest.raises(ValueError, match=r"moe_args.num_experts \(8\) must be divisible by ep_size \(3\)"):
        validate_ep_constraints(moe, 3)
    with pytest.raises(ValueError, match=re.escape("has no moe_args.num_experts")):
        validate_ep_constraints(SimpleNamespace(n_heads=4), 2)


# ------------------------------------------------------------------------- Ulysses


def test_ulysses_slice_inputs():
    tokens = torch.arange(8).unsqueeze(0)
    inputs = {"input_ids": tokens, "position_ids": tokens + 100, "cu_seqlens": torch.tensor([0, 8])}
    sliced, labels = ulysses_slice_inputs(inputs, tokens + 1000, cp_rank=1, cp_size=2)
    assert sliced["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert sliced["position_ids"].tolist() == [[104, 105, 106, 107]]
    assert labels.tolist() == [[1004, 1005, 1006, 1007]]
    assert sliced["cu_seqlens"] is inputs["cu_seqlens"]  # boundaries stay global
    assert ulysses_slice_inputs(inputs, tokens, 0, 1) == (inputs, tokens)
    with pytest.raises(ValueError, match="not divisible by cp_size 3"):
        ulysses_slice_inputs(inputs, tokens, 0, 3)


def _ulysses_roundtrip(rank: int, world_size: int) -> dict[str, float]:
    import torch.distributed as dist

    group = dist.group.WORLD
    torch.manual_seed(0)
    full = torch.randn(1, 6, 4, 3)  # [batch, seq, heads, head_dim], seq split 3 + 3
    local = full[:, rank * 3 : (rank + 1) * 3].clone().requires_grad_()
    heads = gather_seq_scatter_heads(local, seq_dim=1, head_dim=2, unpadded_dim_size=6, group=group)
    back = gather_heads_scatter_seq(heads, head_dim=2, seq_dim=1, group=group)
    weight = torch.arange(back.numel(), dtype=back.dtype).view_as(back)
    (back * weight).sum().backward()

    # Odd total length 5: rank 0 holds 3 tokens, rank 1 holds 2 plus one of padding.
    padded = torch.cat([full[:, :5], torch.zeros(1, 1, 4, 3)], dim=1)[:, rank * 3 : (rank + 1) * 3]
    unpadded = gather_seq_scatter_heads(padded, seq_dim=1, head_dim=2, unpadded_dim_size=5, group=group)

    logits = full[:, rank * 3 : (rank + 1) * 3, 0].clone().requires_grad_()
    gathered = ulysses_gather_output(logits, group, seq_dim=1)
    gathered.sum().backward()
    return {
        "heads_match": float(torch.equal(heads, full[:, :, rank * 2 : (rank + 1) * 2])),
        "roundtrip_match": float(torch.equal(back, local)),
        "grad_match": float(torch.equal(local.grad, weight)),
        "unpadded_shape": float(unpadded.shape[1]),
        "unpadded_match": float(torch.equal(unpadded, full[:, :5, rank * 2 : (rank + 1) * 2])),
        "gather_match": float(torch.equal(gathered, full[:, :, 0])),
        # Both ranks' copies of the gathered output feed the loss: the slice's gradient is 2.
        "gather_grad": float(logits.grad.unique().item()),
    }


def test_ulysses_all_to_all_on_gloo():
    for result in launch(_ulysses_roundtrip, world_size=2, timeout_s=120):
        assert result == {
            "heads_match": 1.0,
            "roundtrip_match": 1.0,
            "grad_match": 1.0,
            "unpadded_shape": 5.0,
            "unpadded_match": 1.0,
            "gather_match": 1.0,
            "gather_grad": 2.0,
        }


# -------------------------------------------------------------------- pipeline split


def test_pipeline_split_balances_layers_with_embedding_and_head():
    assert generate_llm_fqn_per_model_part(2, 4) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    assert generate_llm_fqn_per_model_part(4, 8, is_critic=True) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4"],
        ["layers.5", "layers.6"],
        ["layers.7", "norm", "score"],
    ]
    assert generate_llm_fqn_per_model_part(1, 2) == [["tok_embeddings", "layers.0", "layers.1", "norm", "output"]]
    stages = generate_llm_fqn_per_model_part(3, 7)
    assert [n for s in stages for n in s if n.startswith("layers.")] == [f"layers.{i}" for i in range(7)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4), "num_stages must be >= 1"),
        ((7, 4), r"cannot exceed the effective layer count 6"),
        ((2, 2, 4, 1), r"must not exceed the 3 layers per stage"),
    ],
)
def test_pipeline_split_rejects_impossible_splits(args, message):
    with pytest.raises(ValueError, match=message):
        generate_llm_fqn_per_model_part(*args)


def test_pipeline_llm_refuses_what_it_cannot_split(tiny_qwen2):
    import copy

    def never_called(*args, **kwargs):
        raise AssertionError("parallelize_fn must not run")

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"set ArchonParallelDims.pp > 1"):
        pipeline_llm(tiny_qwen2, cpu, ArchonParallelDims(world_size=1), ArchonPipelineConfig(), never_called)
    tied = copy.deepcopy(tiny_qwen2)
    tied.model_args = dataclasses.replace(tied.model_args, enable_weight_tying=True)
    with pytest.raises(ValueError, match="tied embedding and LM head"):
        pipeline_llm(tied, cpu, ArchonParallelDims(pp=2, world_size=2), ArchonPipelineConfig(), never_called)


def test_pipeline_split_refuses_a_module_no_stage_lists(tiny_qwen2):
    """Issue 20: a top-level module outside the stage lists (an embedding norm) was set to
    None on every stage, and the first stage's forward failed on one rank while the other
    waited for it. The split refuses it on every rank, naming the module and the fix."""
    import copy

    from archon_models.pipeline_parallel import pipeline_module_split

    model = copy.deepcopy(tiny_qwen2)
    model.embedding_norm = nn.LayerNorm(model.model_args.dim)
    names = generate_llm_fqn_per_model_part(2, model.model_args.n_layers)
    no_mesh = None  # refused before the mesh is read
    with pytest.raises(ValueError, match=r"modules no pipeline stage lists: embedding_norm\. .*pipelining_fn"):
        pipeline_module_split(model, no_mesh, "1F1B", torch.device("cpu"), names)
    with pytest.raises(ValueError, match=r"modules no pipeline stage lists: layers\.1\b"):
        pipeline_module_split(tiny_qwen2, no_mesh, "1F1B", torch.device("cpu"), [["tok_embeddings", "layers.0"]])


# ----------------------------------------------------------- activation checkpointing


@pytest.fixture(scope="module")
def tiny_qwen2():
    config = build_hf_config(ModelCase(model_type="qwen2", config_overrides={"num_hidden_layers": 2}))
    torch.manual_seed(0)
    return build_archon_model(config, attn_type="sdpa").model


def _loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = make_packed_inputs((5, 7, 4), model.model_args.vocab_size, seed=3)
    logits = model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
    loss = next_token_loss(logits, batch.tokens, batch.doc_lens)
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("config", "wrapped"),
    [
        (ActivationCheckpointConfig(mode="full"), ["0", "1"]),
        (ActivationCheckpointConfig(mode="selective", selective_ac_option="op"), ["0", "1"]),
        (ActivationCheckpointConfig(mode="selective", selective_ac_option="2"), ["1"]),
    ],
    ids=["full", "selective-op", "selective-every-2nd"],
)
def test_activation_checkpointing_keeps_gradients(tiny_qwen2, config, wrapped):
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(tiny_qwen2))
    model = copy.deepcopy(tiny_qwen2)
    apply_ac(model, config, op_sac_save_list={torch.ops.aten.mm.default})
    assert [k for k, block in model.layers.items() if isinstance(block, CheckpointWrapper)] == wrapped
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], msg=lambda m, name=name: f"{name}: {m}")


def test_activation_checkpoint_config_errors(tiny_qwen2):
    with pytest.raises(ValueError, match="Invalid activation checkpointing mode 'partial'"):
        ActivationCheckpointConfig(mode="partial")
    with pytest.raises(ValueError, match="Invalid selective_ac_option '0'"):
        ActivationCheckpointConfig(mode="selective", selective_ac_option="0")
    with pytest.raises(ValueError, match="memory_budget' is a compiler pass"):
        apply_ac(tiny_qwen2, ActivationCheckpointConfig(mode="memory_budget"))
    with pytest.raises(ValueError, match=re.escape("must name nn.Linear modules")):
        config = ActivationCheckpointConfig(per_op_sac_force_recompute_mm_shapes_by_fqns=["attention_norm"])
        apply_ac(__import__("copy").deepcopy(tiny_qwen2), config)
    with pytest.raises(ValueError, match=re.escape("model.layers to be an nn.ModuleDict")):
        apply_ac(nn.Linear(2, 2), ActivationCheckpointConfig(mode="full"))


def test_apply_compile_wraps_each_block(tiny_qwen2):
    import copy

    model = copy.deepcopy(tiny_qwen2)
    blocks = dict(model.layers.items())
    apply_compile(model)
    for name, compiled in model.layers.items():
        assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
        assert compiled._orig_mod is blocks[name]
    # The wrapper adds the _orig_mod prefix adapters strip.
    assert any("._orig_mod." in n for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match=re.escape("model.layers to be an nn.ModuleDict")):
        apply_compile(nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fsdp_rejects_unknown_reshard_policy(tiny_qwen2, family):
    import importlib

    apply_fsdp = importlib.import_module(f"archon_models.{family}.infra.parallelize").apply_fsdp
    with pytest.raises(ValueError, match="Invalid reshard_after_forward_policy 'sometimes'"):
        apply_fsdp(tiny_qwen2, dp_mesh=None, reshard_after_forward_policy="sometimes")


# --------------------------------------------------------------------------- launcher


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the worker")
    return rank


def _exit_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def _sleep(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_launcher_returns_every_rank():
    assert launch(lambda rank, world_size, offset: rank * 10 + world_size + offset, 2, args=(100,)) == [102, 112]
    # Tensors come back as copies, still readable after the workers are gone.
    tensors = launch(lambda rank, world_size: torch.full((3,), float(rank)), 2)
    time.sleep(0.2)
    assert [t.tolist() for t in tensors] == [[0.0] * 3, [1.0] * 3]


def test_launcher_propagates_worker_exceptions_with_traceback():
    with pytest.raises(
        WorkerFailure, match=r"(?s)rank 1: ValueError: boom from the worker.*Traceback.*_raise_on_rank_one"
    ):
        launch(_raise_on_rank_one, 2, timeout_s=60)


def test_launcher_reports_dead_and_hung_workers():
    with pytest.raises(WorkerFailure, match=r"rank 0 died without a result \(exit code 3\)"):
        launch(_exit_on_rank_zero, 2, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"did not finish within 2s"):
        launch(_sleep, 2, timeout_s=2)
    assert time.monotonic() - start < 20


def _count_call(rank: int, world_size: int, calls_dir: str) -> int:
    # One file per call: the parent counts how many times fn ran on each rank.
    with open(os.path.join(calls_dir, f"rank{rank}"), "a") as f:
        f.write("x")
    if rank == 1:
        raise ValueError("fn failed")
    return rank


def test_launcher_does_not_rerun_a_function_that_failed():
    # Past the rendezvous a failure is the function's: reported once, never re-run.
    with tempfile.TemporaryDirectory() as calls:
        with pytest.raises(WorkerFailure, match="fn failed"):
            launch(_count_call, 2, args=(calls,), timeout_s=60)
        assert sorted(os.listdir(calls)) == ["rank0", "rank1"]
        assert [Path(calls, f"rank{r}").read_text() for r in range(2)] == ["x", "x"]


def _first_rendezvous_stalls(marker_dir: Path, real: object) -> object:
    """A rendezvous where rank 1 hangs before the store on the first launch only
    (what a forked worker stuck on an inherited lock does); rank 0 times out waiting."""

    def rendezvous(rank: int, world_size: int, port: int) -> None:
        marker = marker_dir / f"rank{rank}"
        first = not marker.exists()
        marker.write_text("seen")
        if first and rank == 1:
            time.sleep(600)
        real(rank, world_size, port)  # type: ignore[operator]

    return rendezvous


def test_launcher_starts_again_when_a_rank_never_reaches_the_rendezvous(monkeypatch, tmp_path, caplog):
    # CI once lost a whole stage 5 to one forked rank that never joined the store: its
    # peers timed out in init_process_group. Nothing had run, so the launch starts over.
    monkeypatch.setattr(distributed, "COLLECTIVE_TIMEOUT_S", 3.0)
    monkeypatch.setattr(distributed, "_rendezvous", _first_rendezvous_stalls(tmp_path, distributed._rendezvous))
    start = time.monotonic()
    with caplog.at_level("WARNING", logger=distributed.__name__):
        assert launch(lambda rank, world_size: rank + 10, 2, timeout_s=60) == [10, 11]
    assert time.monotonic() - start < 40
    assert "did not form a process group (attempt 1 of 3)" in caplog.text
    assert "DistStoreError" in caplog.text


def _never_rendezvous(rank: int, world_size: int, port: int) -> None:
    raise RuntimeError(f"store unreachable from rank {rank}")


def test_launcher_gives_up_after_the_last_rendezvous_attempt(monkeypatch):
    monkeypatch.setattr(distributed, "_rendezvous", _never_rendezvous)
    with pytest.raises(
        WorkerFailure, match=r"(?s)did not form a process group in 3 attempts.*store unreachable from rank"
    ):
        launch(lambda rank, world_size: rank, 2, timeout_s=60)
