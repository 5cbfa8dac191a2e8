"""Stage 5: the model trains the same on two processes as on one.

Two forked processes on gloo (CPU) run the model's registered ``parallelize_fn``
under each parallelism and compare with one process running the same, unsplit
model on the same data:

- ``tp``: TP=2 (with per-op selective activation checkpointing): logits, loss and
  the gradient of every parameter, gathered; the vocabulary shard each rank keeps
  under ``loss_parallel``; and a critic (``score`` head) with its gradients. Gradients, not only logits: a wrong
  plan (a missing SequenceParallel on a norm, a router gate whose partial gradient
  is taken as whole) leaves the forward exact and the gradients wrong.
- ``fsdp``: FSDP=2 (with full activation checkpointing), a different batch per rank:
  each rank's logits and loss, the averaged gradients, and the parameters after one
  optimizer step.
- ``ep``: EP=2 for MoE models (expert weights split over the ranks; FSDP=2 on the rest),
  a different batch per rank: as ``fsdp``, gradients and one step.
- ``pp``: PP=2 with the 1F1B schedule over two micro-batches: losses, last-stage logits
  and each stage's gradients.
- ``cp``: CP=2 (Ulysses all-to-all), each rank holding half the sequence; the logits
  gathered over ranks and the gradients. Skipped (and said so) when the head counts
  cannot be split over 2 ranks.
- ``ep_tp``: EP=2 x TP=2 for MoE models, on four processes (FSDP=2 over the data
  ranks, a different batch per data rank, the same batch on the two TP ranks of one),
  in both of AReaL 1.0.4's expert layouts: ``etp=1`` (the TP ranks are borrowed by EP:
  experts split whole over the TP group, ``ExpertParallel``, each TP rank dispatching
  its own slice of the tokens) and ``etp=tp`` (experts split over a 2D ``[ep, tp]``
  mesh, ``ExpertTensorParallel``, EP over the data ranks). Logits, loss, gradients and
  one SGD step each. Skipped (and said so) when TP or EP does not apply.

A parallelism that does not apply to a model is not run and the stage says why in one
passing check named ``not run (<parallelism>)``.

The optimizer step is plain SGD: its update is linear in the gradient, so the
gradient tolerance carries over to the parameters. (Adam's first step is
``lr * sign(g)`` and turns a 1e-9 difference on a near-zero gradient into ``2 * lr``.)

All comparisons use ``torch.testing.assert_close``'s fp32 defaults.

Workers are forked (they inherit the models built in the parent, nothing is
pickled) and start in well under a second, against several seconds for spawn. The
parent serves the rendezvous store, so no port has to be guessed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import logging
import multiprocessing as mp
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from archon_models.activation_checkpoint import ActivationCheckpointConfig
from archon_models.model_spec import ModelSpec, ParallelizeFn
from archon_models.parallel_dims import ArchonParallelDims
from archon_models.pipeline_parallel import ArchonPipelineConfig, build_pipeline_schedule, pipeline_llm
from archon_models.ulysses import ulysses_gather_output, ulysses_slice_inputs
from archon_models.utils import validate_cp_constraints, validate_ep_constraints, validate_tp_constraints
from skill.harness.case import ModelCase
from skill.harness.compare import compare_tensor_dicts, compare_tensors
from skill.harness.inputs import PackedInputs, make_packed_inputs, next_token_loss, special_token_ids
from skill.harness.models import build_model_pair
from skill.harness.results import CheckResult, StageRecorder, StageResult, run_stage

logger = logging.getLogger(__name__)

__all__ = [
    "PARALLELISMS",
    "WorkerFailure",
    "applicable_parallelisms",
    "launch",
    "not_run_checks",
    "run_stage5",
]

WORLD_SIZE = 2
PARALLELISMS = ("tp", "fsdp", "ep", "pp", "cp", "ep_tp")
# EP x TP needs a data dimension for the experts to borrow from (etp=tp) and a TP
# dimension (etp=1): 2 x 2 ranks. Every other parallelism runs on WORLD_SIZE ranks.
EP_TP_WORLD_SIZE = 4
WORLD_SIZES = {name: (EP_TP_WORLD_SIZE if name == "ep_tp" else WORLD_SIZE) for name in PARALLELISMS}
LABELS = {
    "tp": "tp=2",
    "fsdp": "fsdp=2",
    "ep": "ep=2",
    "pp": "pp=2",
    "cp": "cp=2",
    "ep_tp": "ep=2 x tp=2",
}
SGD_LR = 0.1
# A collective that waits longer than this is a hang, not slowness (tiny models).
COLLECTIVE_TIMEOUT_S = 60.0
DEFAULT_TIMEOUT_S = 300.0
ERROR_GRACE_S = 5.0
# A launch whose ranks never all met (a forked worker stuck before the store: the
# fork copied a lock another thread held, or a loaded machine starved it for a
# minute) is started again with fresh processes, this many times in all.
RENDEZVOUS_ATTEMPTS = 3
# The phase a worker's error came from.
_RENDEZVOUS = "rendezvous_error"
_RUN = "error"
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


# --------------------------------------------------------------------------- launcher


class WorkerFailure(RuntimeError):
    """A worker raised, died or timed out; the message carries its traceback."""


def _rendezvous(rank: int, world_size: int, port: int) -> None:
    """Join the parent's store and form the gloo group (every rank, or none, returns)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    # init returns per rank; without this barrier a fast rank can finish and close
    # its connections while its peer is still in gloo's connectFullMesh.
    dist.barrier()


def _worker_main(
    rank: int,
    world_size: int,
    port_conn: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
) -> None:
    phase = _RENDEZVOUS
    try:
        # Two workers share the cores; more threads each only contend.
        torch.set_num_threads(1)
        # The store's port comes once every rank is forked (see _launch_once).
        port = port_conn.recv() if port_conn.poll(COLLECTIVE_TIMEOUT_S) else None
        port_conn.close()
        if not isinstance(port, int):
            raise RuntimeError(f"the launcher sent no store port within {COLLECTIVE_TIMEOUT_S:.0f}s")
        _rendezvous(rank, world_size, port)
        phase = _RUN
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle, not the Connection's ForkingPickler: that one hands tensors over
        # as shared-memory handles, which die with the worker.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:
        message = f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps((phase, message)))
    finally:
        conn.close()


def launch(
    fn: Callable[..., Any],
    world_size: int = WORLD_SIZE,
    args: tuple[Any, ...] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` forked processes on gloo.

    Returns each rank's return value (it must pickle; tensors come back as copies).
    ``args`` are inherited through fork, not pickled, so they may hold models. Raises
    :class:`WorkerFailure` with the worker's traceback if any rank raises, dies
    or runs past ``timeout_s``; the other workers are then terminated.

    When the ranks never form their process group (no rank reached ``fn``), nothing
    about ``fn`` is known yet: the launch starts again with fresh processes, up to
    :data:`RENDEZVOUS_ATTEMPTS` times, and says so in the log.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _launch_once(fn, world_size, args, timeout_s)
        except _RendezvousFailure as failure:
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise WorkerFailure(
                    f"the {world_size} workers did not form a process group in {attempt} attempts:\n{failure}"
                ) from None
            logger.warning(
                "the %d workers did not form a process group (attempt %d of %d); starting them again:\n%s",
                world_size,
                attempt,
                RENDEZVOUS_ATTEMPTS,
                failure,
            )
    raise AssertionError("unreachable")


class _RendezvousFailure(WorkerFailure):
    """No rank got past the rendezvous: the launch may be started again."""


def _launch_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout_s: float,
) -> list[Any]:
    ctx = mp.get_context("fork")
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    port_conns: list[Connection] = []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        port_in, port_out = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker_main,
            args=(rank, world_size, port_in, fn, args, child_conn),
            name=f"archon-stage5-rank{rank}",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        port_in.close()
        procs.append(proc)
        conns.append(parent_conn)
        port_conns.append(port_out)
    # The parent serves the rendezvous store on a port the OS picks while binding, so
    # concurrent launches (pytest-xdist) cannot race for a port. It starts after the last
    # fork, so no worker is forked while the store's server threads run (a lock one of them
    # holds at the fork stays held in the child). Measured on 2 busy cores, 4 ranks: with
    # the store started before the forks, 2 launches in 300 had a rank that never reached
    # it; started after, none in 600.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    for port_out in port_conns:
        with contextlib.suppress(OSError):  # a worker that died already is reported below
            port_out.send(store.port)
        port_out.close()

    deadline = time.monotonic() + timeout_s
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    errors: list[str] = []
    # Each report's kind: "ok", a worker's error phase, "died" or "timeout".
    reports: list[str] = []
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if not errors:
                    reports.append("timeout")
                    errors.append(
                        f"ranks {sorted(pending)} did not finish within {timeout_s:.0f}s "
                        "(a hang in a collective, or a deadlock in a forked worker)"
                    )
                break
            ready = mp.connection.wait([conns[r] for r in pending], timeout=min(remaining, 1.0))
            for rank in [r for r in sorted(pending) if conns[r] in ready]:
                conn = conns[rank]
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=1.0)
                    reports.append("died")
                    errors.append(f"rank {rank} died without a result (exit code {procs[rank].exitcode})")
                    pending.discard(rank)
                    continue
                pending.discard(rank)
                reports.append(status)
                if status == "ok":
                    results[rank] = payload
                else:
                    if not errors:
                        # The first failure usually breaks its peers' collectives too;
                        # wait briefly for their reports so the root cause is among them.
                        deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                    errors.append(payload)
    finally:
        for worker in procs:
            if errors:
                worker.terminate()
            worker.join(timeout=10.0)
            if worker.is_alive():
                worker.kill()
                worker.join()
        for parent in conns:
            parent.close()
    if errors:
        # Started again only when every report is a rendezvous error (ranks that never
        # reported were stuck before it too): no rank ran fn.
        failure = _RendezvousFailure if set(reports) == {_RENDEZVOUS} else WorkerFailure
        raise failure("distributed workers failed:\n" + "\n".join(errors))
    return results


# ------------------------------------------------------------------------ stage 5


@dataclass
class _Setup:
    """What the parent builds once and the forked workers inherit."""

    spec: ModelSpec
    model: nn.Module
    batches: list[PackedInputs]  # one per rank, for the data-parallel checks
    parallelisms: tuple[str, ...]
    # The parallel-dims and activation-checkpoint classes handed to parallelize_fn:
    # archon_models' by default, AReaL's own when the AReaL tier runs a package there.
    dims_cls: type = ArchonParallelDims
    ac_config_cls: type = ActivationCheckpointConfig
    # One-process references by kind (see _REFERENCE_OF): filled in the parent before
    # forking, so no rank recomputes what every rank would compute the same.
    references: dict[str, _Reference] = dataclasses.field(default_factory=dict)

    def reference(self, kind: str) -> _Reference:
        """The one-process reference of ``kind``: ``"first"`` (the first batch alone),
        ``"mean"`` or ``"sum"`` (of every batch's loss)."""
        if kind not in self.references:
            batches = self.batches[:1] if kind == "first" else self.batches
            self.references[kind] = _reference(self.model, batches, mean=kind != "sum")
        return self.references[kind]


def _has_moe(model: nn.Module) -> bool:
    layers = cast(nn.ModuleDict, model.layers)
    return any(getattr(block, "moe_enabled", False) for block in layers.values())


def applicable_parallelisms(model: nn.Module) -> dict[str, str | None]:
    """Each parallelism, with ``None`` if it applies to ``model`` or the reason it does not."""
    reasons: dict[str, str | None] = dict.fromkeys(PARALLELISMS)
    if not _has_moe(model):
        reasons["ep"] = "the model has no MoE layer"
        reasons["ep_tp"] = "the model has no MoE layer"
    if getattr(model.model_args, "enable_weight_tying", False):
        reasons["pp"] = "the embedding and LM head are tied, which pipeline_llm cannot split over stages"
    try:
        # AReaL's TP splits the KV heads over the ranks: one KV head (multi-query) cannot be.
        validate_tp_constraints(_model_args(model), WORLD_SIZE)
    except ValueError as exc:
        reasons["tp"] = f"heads cannot be split over {WORLD_SIZE} ranks: {exc}"
        if reasons["ep_tp"] is None:
            reasons["ep_tp"] = f"TP=2 does not apply: heads cannot be split over {WORLD_SIZE} ranks: {exc}"
    if reasons["ep_tp"] is None:
        try:
            validate_ep_constraints(_model_args(model), WORLD_SIZE)
        except ValueError as exc:
            reasons["ep_tp"] = f"EP=2 does not apply: {exc}"
    try:
        validate_cp_constraints(_model_args(model), WORLD_SIZE, 1)
    except ValueError as exc:
        reasons["cp"] = f"heads cannot be split over {WORLD_SIZE} ranks: {exc}"
    return reasons


def not_run_checks(reasons: dict[str, str | None]) -> list[CheckResult]:
    """One passing check per parallelism left out, naming why: said in the result, not
    only the log, so a family that cannot run one is never a silent skip. A dense model
    gets no line for the MoE-only parallelisms (that they do not apply is no news)."""
    dense = reasons["ep"] is not None
    return [
        CheckResult(name=f"not run ({LABELS[p]})", passed=True, detail=reason)
        for p, reason in reasons.items()
        if reason is not None and not (dense and p in ("ep", "ep_tp"))
    ]


def _padded_doc_lens(doc_lens: Sequence[int], multiple: int) -> tuple[int, ...]:
    """Append a filler document so the total length splits evenly over the ranks."""
    remainder = sum(doc_lens) % multiple
    return tuple(doc_lens) if remainder == 0 else (*doc_lens, multiple - remainder)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: DTensors are gathered (a collective: call on every rank in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _canonical(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            raise RuntimeError(f"parameter {_canonical(name)} received no gradient")
        grads[_canonical(name)] = _local(param.grad).detach().clone()
    return grads


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {_canonical(name): _local(param).detach().clone() for name, param in model.named_parameters()}


def _forward(model: nn.Module, batch: PackedInputs) -> torch.Tensor:
    logits = model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
    return _local(logits)


@dataclass
class _Reference:
    logits: list[torch.Tensor]
    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    params_after_step: dict[str, torch.Tensor]


def _reference(model: nn.Module, batches: Sequence[PackedInputs], mean: bool = True) -> _Reference:
    """One process: logits and loss of each batch, gradients of their mean (or sum), one SGD step."""
    ref = copy.deepcopy(model)
    logits = [_forward(ref, b) for b in batches]
    losses = [next_token_loss(lg, b.tokens, b.doc_lens) for lg, b in zip(logits, batches, strict=True)]
    total = torch.stack(losses).sum()
    (total / len(losses) if mean else total).backward()
    grads = _grads(ref)
    torch.optim.SGD(ref.parameters(), lr=SGD_LR).step()
    return _Reference(
        logits=[lg.detach() for lg in logits],
        losses=[loss.detach() for loss in losses],
        grads=grads,
        params_after_step=_params(ref),
    )


def _parallelize_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "param_dtype": torch.float32,
        "reduce_dtype": torch.float32,
        "loss_parallel": False,
        "enable_compile": False,
    }
    kwargs.update(overrides)
    return kwargs


def _check_tp(rec: StageRecorder, setup: _Setup, rank: int) -> None:
    batch = setup.batches[0]
    ref = setup.reference("first")
    dims = setup.dims_cls(tp=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    model = setup.spec.parallelize_fn(
        copy.deepcopy(setup.model),
        dims,
        **_parallelize_kwargs(ac_config=setup.ac_config_cls(mode="selective", selective_ac_option="op")),
    )
    logits = _forward(model, batch)
    loss = next_token_loss(logits, batch.tokens, batch.doc_lens)
    loss.backward()
    rec.add(compare_tensors("logits (tp=2)", logits.detach(), ref.logits[0]))
    rec.add(compare_tensors("loss (tp=2)", loss.detach(), ref.losses[0]))
    rec.add(compare_tensor_dicts("gradients (tp=2)", _grads(model), ref.grads))

    # The default loss_parallel=True leaves each rank its slice of the vocabulary.
    sharded = setup.spec.parallelize_fn(copy.deepcopy(setup.model), dims, **_parallelize_kwargs(loss_parallel=True))
    with torch.no_grad():
        vocab_shard = _forward(sharded, batch)
    expected_shard = ref.logits[0].chunk(WORLD_SIZE, dim=-1)[rank]
    rec.add(compare_tensors("logits (tp=2, loss_parallel vocabulary shard)", vocab_shard, expected_shard))
    _check_tp_critic(rec, setup, dims)


def _model_args(model: nn.Module) -> Any:
    """The args dataclass every Archon model keeps as ``model_args`` (nn.Module's attribute
    typing knows only tensors and submodules)."""
    return model.model_args


def _critic(model: nn.Module) -> nn.Module:
    """The same network with a seeded ``score`` head (a PPO value model) in place of ``output``."""
    args = dataclasses.replace(_model_args(model), is_critic=True)
    torch.manual_seed(0)
    critic: Any = type(model)(args)
    # As the engine does after building: buffers that are computed, not loaded (the RoPE
    # cache; AReaL's MoE registers its load-balancing buffers only here).
    critic.init_buffers(buffer_device="cpu")
    trunk = {k: v for k, v in model.state_dict().items() if not k.startswith("output.")}
    missing, unexpected = critic.load_state_dict(trunk, strict=False)
    if unexpected or any(not k.startswith("score.") for k in missing):
        raise RuntimeError(f"critic of {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    return critic


def _check_tp_critic(rec: StageRecorder, setup: _Setup, dims: ArchonParallelDims) -> None:
    """TP of a critic: values and every gradient of a regression loss."""
    batch = setup.batches[0]
    critic = _critic(setup.model)
    targets = torch.randn(
        1, batch.num_tokens, _model_args(critic).num_labels, generator=torch.Generator().manual_seed(1)
    )

    def loss_of(values: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(values, targets)

    ref = copy.deepcopy(critic)
    ref_values = _forward(ref, batch)
    loss_of(ref_values).backward()
    model = setup.spec.parallelize_fn(copy.deepcopy(critic), dims, **_parallelize_kwargs())
    values = _forward(model, batch)
    loss_of(values).backward()
    rec.add(compare_tensors("logits (tp=2, critic values)", values.detach(), ref_values.detach()))
    rec.add(compare_tensor_dicts("gradients (tp=2, critic)", _grads(model), _grads(ref)))


def _check_data_parallel(
    rec: StageRecorder, setup: _Setup, rank: int, label: str, dims: ArchonParallelDims, **kw: Any
) -> None:
    """A training step with a different batch per rank against one process on the mean loss."""
    ref = setup.reference("mean")
    model = setup.spec.parallelize_fn(copy.deepcopy(setup.model), dims, **_parallelize_kwargs(**kw))
    batch = setup.batches[rank]
    logits = _forward(model, batch)
    loss = next_token_loss(logits, batch.tokens, batch.doc_lens)
    loss.backward()  # FSDP averages the gradients over the ranks
    rec.add(compare_tensors(f"logits ({label})", logits.detach(), ref.logits[rank]))
    rec.add(compare_tensors(f"loss ({label})", loss.detach(), ref.losses[rank]))
    rec.add(compare_tensor_dicts(f"gradients ({label})", _grads(model), ref.grads))
    torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    rec.add(compare_tensor_dicts(f"parameters after one SGD step ({label})", _params(model), ref.params_after_step))


def _check_fsdp(rec: StageRecorder, setup: _Setup, rank: int) -> None:
    dims = setup.dims_cls(dp_shard=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    _check_data_parallel(rec, setup, rank, "fsdp=2", dims, ac_config=setup.ac_config_cls(mode="full"))


def _check_ep(rec: StageRecorder, setup: _Setup, rank: int) -> None:
    dims = setup.dims_cls(ep=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    _check_data_parallel(rec, setup, rank, "ep=2", dims)


def _check_ep_tp(rec: StageRecorder, setup: _Setup, rank: int) -> None:
    """EP=2 x TP=2 on four ranks, in both expert layouts AReaL 1.0.4 offers.

    The mesh is ``(dp_shard_mod_ep, dp_shard_in_ep, tp)``, so ranks ``2d`` and ``2d + 1``
    are the TP pair of data rank ``d`` and see the same batch. ``etp=1``: EP borrows the
    TP group (experts split whole over the TP pair, their weights FSDP-sharded over the
    data ranks). ``etp=tp``: EP runs over the data ranks and each expert is also split
    over TP (a 2D ``[ep, tp]`` mesh).
    """
    tp = 2
    data_rank = rank // tp
    for etp in (1, tp):
        dims = setup.dims_cls(dp_shard=2, tp=tp, ep=2, etp=etp, world_size=EP_TP_WORLD_SIZE, device_type="cpu")
        _check_data_parallel(rec, setup, data_rank, f"ep=2 x tp=2, etp={etp}", dims)


def _check_pp(rec: StageRecorder, setup: _Setup, rank: int) -> None:
    """1F1B over two micro-batches (rows of one ``[2, T]`` batch sharing the document boundaries)."""
    microbatches = setup.batches
    ref = setup.reference("sum")
    dims = setup.dims_cls(pp=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    stages, parts, has_first, has_last = pipeline_llm(
        copy.deepcopy(setup.model),
        torch.device("cpu"),
        dims,
        ArchonPipelineConfig(pp_schedule="1F1B"),
        setup.spec.parallelize_fn,
        **_parallelize_kwargs(),
    )
    doc_lens = microbatches[0].doc_lens

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return next_token_loss(logits, target, doc_lens)

    schedule = build_pipeline_schedule(
        stages, "1F1B", n_microbatches=len(microbatches), pp_degree=dims.pp, loss_fn=loss_fn
    )
    tokens = torch.cat([b.tokens for b in microbatches])
    kwargs: dict[str, Any] = {
        "positions": torch.cat([b.positions for b in microbatches]),
        "cu_seqlens": microbatches[0].cu_seqlens,
        "max_seqlen": microbatches[0].max_seqlen,
    }
    losses: list[torch.Tensor] = []
    if has_first:
        output = schedule.step(tokens, target=tokens, losses=losses, **kwargs)
    else:
        output = schedule.step(target=tokens, losses=losses, **kwargs)
    if has_last:
        rec.add(compare_tensors("logits (pp=2, last stage)", output.detach(), torch.cat(ref.logits)))
        rec.add(compare_tensors("losses (pp=2, last stage)", torch.stack(losses).detach(), torch.stack(ref.losses)))
    owned = _grads(parts[0])
    stage = stages[0].stage_index
    if not owned:
        raise RuntimeError(f"pipeline stage {stage} owns no parameters")
    rec.add(
        compare_tensor_dicts(
            f"gradients (pp=2, stage {stage})", owned, {k: ref.grads[k] for k in owned if k in ref.grads}
        )
    )


def _check_cp(rec: StageRecorder, setup: _Setup, rank: int) -> None:
    """Each rank runs its half of the sequence; attention all-to-alls heads for sequence."""
    batch = setup.batches[0]
    ref = setup.reference("first")
    dims = setup.dims_cls(cp=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    model = setup.spec.parallelize_fn(copy.deepcopy(setup.model), dims, **_parallelize_kwargs())
    cp_group = dims.get_group("cp")
    sliced, _ = ulysses_slice_inputs(
        {"input_ids": batch.tokens, "position_ids": batch.positions}, batch.tokens, rank, WORLD_SIZE
    )
    local_logits = model(sliced["input_ids"], sliced["position_ids"], batch.cu_seqlens, batch.max_seqlen)
    logits = ulysses_gather_output(local_logits, cp_group, seq_dim=1)
    # Every rank computes the whole loss from the gathered logits; the gather's
    # backward sums the ranks' copies (x2) and FSDP's average over the CP ranks (/2)
    # undoes it, leaving the gradient of the loss.
    loss = next_token_loss(logits, batch.tokens, batch.doc_lens)
    loss.backward()
    rec.add(compare_tensors("logits (cp=2, gathered)", logits.detach(), ref.logits[0]))
    rec.add(compare_tensors("loss (cp=2)", loss.detach(), ref.losses[0]))
    rec.add(compare_tensor_dicts("gradients (cp=2)", _grads(model), ref.grads))


# The one-process reference each parallelism compares with.
_REFERENCE_OF = {"tp": "first", "cp": "first", "fsdp": "mean", "ep": "mean", "ep_tp": "mean", "pp": "sum"}

_CHECKS: dict[str, Callable[[StageRecorder, _Setup, int], None]] = {
    "tp": _check_tp,
    "fsdp": _check_fsdp,
    "ep": _check_ep,
    "pp": _check_pp,
    "cp": _check_cp,
    "ep_tp": _check_ep_tp,
}


def _stage5_worker(rank: int, world_size: int, setup: _Setup, case: ModelCase) -> list[dict[str, Any]]:
    rec = StageRecorder(case, 5)
    for name in setup.parallelisms:
        start = time.perf_counter()
        try:
            _CHECKS[name](rec, setup, rank)
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            rec.check(
                f"raised ({LABELS[name]})", False, f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})"
            )
            logger.exception("rank %d: %s check raised", rank, name)
        logger.info("rank %d: %s checks took %.2fs", rank, name, time.perf_counter() - start)
    return [check.model_dump() for check in rec.checks]


def _merge_ranks(per_rank: list[list[dict[str, Any]]]) -> list[CheckResult]:
    """One check per name: passed on every rank that ran it, the largest difference."""
    merged: dict[str, list[tuple[int, CheckResult]]] = {}
    for rank, checks in enumerate(per_rank):
        for data in checks:
            check = CheckResult.model_validate(data)
            merged.setdefault(check.name, []).append((rank, check))
    results = []
    for name, entries in merged.items():
        failed = [(rank, c) for rank, c in entries if not c.passed]
        diffs = [c.max_abs_diff for _, c in entries if c.max_abs_diff is not None]
        ranks = ",".join(str(rank) for rank, _ in entries)
        if failed:
            detail = "; ".join(f"rank {rank}: {c.detail}" for rank, c in failed)
        else:
            detail = f"ranks {ranks}" + (f": {entries[0][1].detail}" if entries[0][1].detail else "")
        results.append(
            CheckResult(name=name, passed=not failed, detail=detail, max_abs_diff=max(diffs) if diffs else None)
        )
    return results


def run_stage5(
    case: ModelCase,
    workdir: str | Path | None = None,
    raise_on_failure: bool = True,
    parallelisms: Sequence[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    parallelize_fn: ParallelizeFn | None = None,
) -> StageResult:
    """Stage 5 for ``case``: the chosen parallelisms (default: every one that applies).

    Asking for a parallelism that does not apply to the model (EP on a dense model)
    is an error; by default those are left out and logged. ``parallelize_fn``
    replaces the registered spec's, to try a plan before registering it.
    """
    requested = tuple(parallelisms) if parallelisms is not None else None
    if requested is not None:
        unknown = sorted(set(requested) - set(PARALLELISMS))
        if unknown or not requested:
            raise ValueError(f"parallelisms={requested}: choose a non-empty subset of {PARALLELISMS}.")

    def body(rec: StageRecorder) -> None:
        with tempfile.TemporaryDirectory(prefix="archon-stage5-", dir=workdir) as tmp:
            pair = build_model_pair(case, tmp, attn_type="sdpa")
        model = pair.archon.model
        reasons = applicable_parallelisms(model)
        if requested is None:
            chosen = tuple(p for p in PARALLELISMS if reasons[p] is None)
            for check in not_run_checks(reasons):
                logger.info("stage 5 for %s: %s: %s", case.id, check.name, check.detail)
                rec.add(check)
        else:
            bad = {p: reasons[p] for p in requested if reasons[p] is not None}
            if bad:
                raise ValueError(f"stage 5 for {case.id}: not applicable: {bad}")
            chosen = requested
        doc_lens = _padded_doc_lens(case.doc_lens, 2 * WORLD_SIZE)
        vocab = _model_args(model).vocab_size
        special = special_token_ids(pair.hf_config)
        batches = [
            make_packed_inputs(doc_lens, vocab, seed=case.seed + rank, special=special) for rank in range(WORLD_SIZE)
        ]
        spec = pair.archon.spec
        if parallelize_fn is not None:
            spec = dataclasses.replace(spec, parallelize_fn=parallelize_fn)
        references: dict[str, _Reference] = {}
        # One launch per world size: every parallelism of a size shares its workers.
        for world_size in sorted({WORLD_SIZES[p] for p in chosen}):
            group = tuple(p for p in chosen if WORLD_SIZES[p] == world_size)
            setup = _Setup(spec=spec, model=model, batches=batches, parallelisms=group, references=references)
            for p in group:
                setup.reference(_REFERENCE_OF[p])
            per_rank = launch(_stage5_worker, world_size, args=(setup, case), timeout_s=timeout_s)
            for check in _merge_ranks(per_rank):
                rec.add(check)

    return run_stage(case, 5, body, raise_on_failure)
