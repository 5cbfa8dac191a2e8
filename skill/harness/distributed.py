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

Every result is judged by a float64 run of the same one-process reference
(``skill.harness.truth``): its error against that truth within a small multiple of the
one-process fp32 run's own. A fixed tolerance would fail a correct plan on a model whose
logits reach +-30. A model that cannot run in float64 is compared with ``assert_close``'s
fp32 defaults, and the stage says so.

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
from collections.abc import Callable, Collection, Sequence
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
from archon_models.pipeline_parallel import ArchonPipelineConfig, build_pipeline_schedule
from archon_models.ulysses import ulysses_gather_output, ulysses_slice_inputs
from archon_models.utils import validate_cp_constraints, validate_ep_constraints, validate_tp_constraints
from skill.harness.case import ModelCase
from skill.harness.inputs import PackedInputs, make_packed_inputs, next_token_loss, special_token_ids
from skill.harness.models import build_model_pair
from skill.harness.results import CheckResult, StageRecorder, StageResult, run_stage
from skill.harness.truth import TRUTH_DTYPE, float64_default, judge, judge_dicts

logger = logging.getLogger(__name__)

__all__ = [
    "PARALLELISMS",
    "WorkerFailure",
    "applicable_parallelisms",
    "launch",
    "not_run_checks",
    "run_parallelisms",
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
    joined = False
    try:
        # Two workers share the cores; more threads each only contend.
        torch.set_num_threads(1)
        # The store's port comes once every rank is forked (see _launch_once).
        port = port_conn.recv() if port_conn.poll(COLLECTIVE_TIMEOUT_S) else None
        port_conn.close()
        if not isinstance(port, int):
            raise RuntimeError(f"the launcher sent no store port within {COLLECTIVE_TIMEOUT_S:.0f}s")
        _rendezvous(rank, world_size, port)
        joined = True
        phase = _RUN
        result = fn(rank, world_size, *args)
        # Plain pickle, not the Connection's ForkingPickler: that one hands tensors over
        # as shared-memory handles, which die with the worker.
        report = pickle.dumps(("ok", result))
    except BaseException as exc:
        message = f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        report = pickle.dumps((phase, message))
    try:
        # Reported before the process group closes: a peer blocked in a collective with this
        # rank fails when its connections close, so this report is the first of the two.
        conn.send_bytes(report)
    finally:
        conn.close()
        if joined:
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int = WORLD_SIZE,
    args: tuple[Any, ...] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    stop_when: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` forked processes on gloo.

    Returns each rank's return value (it must pickle; tensors come back as copies).
    ``args`` are inherited through fork, not pickled, so they may hold models. Raises
    :class:`WorkerFailure` with the worker's traceback if any rank raises, dies
    or runs past ``timeout_s``; the other workers are then terminated.

    ``stop_when(result)`` true says a rank caught its own failure and returned it: its peers
    may be blocked in a collective with it until the collective timeout. The others then
    get :data:`ERROR_GRACE_S` to report, and those that have not are terminated, their
    result ``None``.

    When the ranks never form their process group (no rank reached ``fn``), nothing
    about ``fn`` is known yet: the launch starts again with fresh processes, up to
    :data:`RENDEZVOUS_ATTEMPTS` times, and says so in the log.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _launch_once(fn, world_size, args, timeout_s, stop_when)
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
    stop_when: Callable[[Any], bool] | None = None,
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
    stopping = False  # a rank returned a failure its peers may be blocked on
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if stopping and not errors:
                    logger.info("ranks %s stopped: another rank failed", sorted(pending))
                elif not errors:
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
                    if stop_when is not None and not stopping and stop_when(payload):
                        stopping = True
                        deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                else:
                    if not errors:
                        # The first failure usually breaks its peers' collectives too;
                        # wait briefly for their reports so the root cause is among them.
                        deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                    errors.append(payload)
    finally:
        for worker in procs:
            if errors or stopping:
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


def applicable_parallelisms(model: nn.Module, spec: ModelSpec | None = None) -> dict[str, str | None]:
    """Each parallelism, with ``None`` if it applies to ``model`` (registered as ``spec``)
    or the reason it does not."""
    reasons: dict[str, str | None] = dict.fromkeys(PARALLELISMS)
    # What the package itself declares it has no plan for (its parallelize refuses it).
    declared: dict[str, str] = getattr(model, "unsupported_parallelisms", {})
    if not _has_moe(model):
        reasons["ep"] = "the model has no MoE layer"
        reasons["ep_tp"] = "the model has no MoE layer"
    if getattr(model.model_args, "enable_weight_tying", False):
        # Name the function the spec pipelines with: a package with modules around its blocks has its own.
        pipelining_fn = getattr(spec, "pipelining_fn", None)
        splitter = getattr(pipelining_fn, "__name__", None) or "pipeline_llm"
        reasons["pp"] = f"the embedding and LM head are tied, which {splitter} cannot split over stages"
    elif spec is not None and spec.pipelining_fn is None:
        reasons["pp"] = "the ModelSpec has no pipelining_fn (AReaL's engine refuses pipeline parallelism for it)"
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
    for parallelism, reason in declared.items():
        reasons[parallelism] = reason
        if parallelism == "tp" and reasons["ep_tp"] is None:
            reasons["ep_tp"] = f"TP=2 does not apply: {reason}"
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


def _grads(model: nn.Module, gradless: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, by canonical name. A parameter that received none raises,
    unless it is one of ``gradless``, those that received none in the one-process reference
    (a module HF runs without gradient, such as a sparse-attention indexer: zeros, as stage 4
    holds them against HF's). ``None``: this is that reference, where any may."""
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        key = _canonical(name)
        if param.grad is None:
            if gradless is not None and key not in gradless:
                raise RuntimeError(f"parameter {key} received no gradient")
            grads[key] = torch.zeros_like(_local(param.detach()))
            continue
        grads[key] = _local(param.grad).detach().clone()
    return grads


def _gradless(model: nn.Module) -> frozenset[str]:
    return frozenset(_canonical(name) for name, param in model.named_parameters() if param.grad is None)


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
    # The same run in float64, which judges every comparison with this reference; None (and
    # why in ``truth_missing``) when the model cannot run in float64.
    truth: _Reference | None = None
    truth_missing: str = ""
    # The parameters that received no gradient in this run (zeros in ``grads``).
    gradless: frozenset[str] = frozenset()


def _reference(model: nn.Module, batches: Sequence[PackedInputs], mean: bool = True) -> _Reference:
    """:func:`_one_process`, in fp32 and, as its truth, on a float64 copy of ``model``."""
    ref = _one_process(model, batches, mean)
    try:
        with float64_default():
            ref.truth = _one_process(copy.deepcopy(model).to(TRUTH_DTYPE), batches, mean)
    except Exception as exc:  # a kernel that takes fp32 or bf16 only
        ref.truth_missing = f"the one-process run raised in float64: {type(exc).__name__}: {exc}"
        logger.warning("%s; stage 5 compares with assert_close's fp32 defaults", ref.truth_missing)
    return ref


def _judged(
    name: str, actual: torch.Tensor, ref: _Reference, pick: Callable[[_Reference], torch.Tensor]
) -> CheckResult:
    """``actual`` against ``pick(ref)``, judged by ``pick`` of the float64 truth."""
    truth = pick(ref.truth) if ref.truth is not None else None
    return judge(name, actual, pick(ref), truth, reference_label="one process fp32")


def _judged_dicts(
    name: str,
    actual: dict[str, torch.Tensor],
    ref: _Reference,
    pick: Callable[[_Reference], dict[str, torch.Tensor]],
) -> CheckResult:
    truth = pick(ref.truth) if ref.truth is not None else None
    return judge_dicts(name, actual, pick(ref), truth, reference_label="one process fp32")


def _one_process(model: nn.Module, batches: Sequence[PackedInputs], mean: bool) -> _Reference:
    """One process: logits and loss of each batch, gradients of their mean (or sum), one SGD step."""
    ref = copy.deepcopy(model)
    logits = [_forward(ref, b) for b in batches]
    losses = [next_token_loss(lg, b.tokens, b.doc_lens) for lg, b in zip(logits, batches, strict=True)]
    total = torch.stack(losses).sum()
    (total / len(losses) if mean else total).backward()
    gradless = _gradless(ref)
    grads = _grads(ref)
    torch.optim.SGD(ref.parameters(), lr=SGD_LR).step()
    return _Reference(
        logits=[lg.detach() for lg in logits],
        losses=[loss.detach() for loss in losses],
        grads=grads,
        params_after_step=_params(ref),
        gradless=gradless,
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
    rec.add(_judged("logits (tp=2)", logits.detach(), ref, lambda r: r.logits[0]))
    rec.add(_judged("loss (tp=2)", loss.detach(), ref, lambda r: r.losses[0]))
    rec.add(_judged_dicts("gradients (tp=2)", _grads(model, ref.gradless), ref, lambda r: r.grads))

    # The default loss_parallel=True leaves each rank its slice of the vocabulary.
    sharded = setup.spec.parallelize_fn(copy.deepcopy(setup.model), dims, **_parallelize_kwargs(loss_parallel=True))
    with torch.no_grad():
        vocab_shard = _forward(sharded, batch)
    rec.add(
        _judged(
            "logits (tp=2, loss_parallel vocabulary shard)",
            vocab_shard,
            ref,
            lambda r: r.logits[0].chunk(WORLD_SIZE, dim=-1)[rank],
        )
    )
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

    def run(model: nn.Module, gradless: Collection[str] | None = None) -> _Reference:
        values = _forward(model, batch)
        torch.nn.functional.mse_loss(values, targets.to(values.dtype)).backward()
        return _Reference(
            logits=[values.detach()],
            losses=[],
            grads=_grads(model, gradless),
            params_after_step={},
            gradless=_gradless(model),
        )

    ref = run(copy.deepcopy(critic))
    if setup.reference("first").truth is not None:
        with float64_default():
            ref.truth = run(copy.deepcopy(critic).to(TRUTH_DTYPE))
    model = setup.spec.parallelize_fn(copy.deepcopy(critic), dims, **_parallelize_kwargs())
    got = run(model, ref.gradless)
    rec.add(_judged("logits (tp=2, critic values)", got.logits[0], ref, lambda r: r.logits[0]))
    rec.add(_judged_dicts("gradients (tp=2, critic)", got.grads, ref, lambda r: r.grads))


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
    rec.add(_judged(f"logits ({label})", logits.detach(), ref, lambda r: r.logits[rank]))
    rec.add(_judged(f"loss ({label})", loss.detach(), ref, lambda r: r.losses[rank]))
    rec.add(_judged_dicts(f"gradients ({label})", _grads(model, ref.gradless), ref, lambda r: r.grads))
    torch.optim.SGD(model.parameters(), lr=SGD_LR).step()
    after = f"parameters after one SGD step ({label})"
    rec.add(_judged_dicts(after, _params(model), ref, lambda r: r.params_after_step))


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
    # The spec's pipelining_fn, as AReaL's engine calls it (pipeline_llm, or the package's own
    # when its model has modules around the blocks that pipeline_llm would drop).
    pipelining_fn = setup.spec.pipelining_fn
    if pipelining_fn is None:
        raise ValueError(f"{setup.spec.name}'s ModelSpec has no pipelining_fn")
    stages, parts, has_first, has_last = pipelining_fn(
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
        rec.add(_judged("logits (pp=2, last stage)", output.detach(), ref, lambda r: torch.cat(r.logits)))
        stacked = torch.stack(losses).detach()
        rec.add(_judged("losses (pp=2, last stage)", stacked, ref, lambda r: torch.stack(r.losses)))
    owned = _grads(parts[0], ref.gradless)
    stage = stages[0].stage_index
    if not owned:
        raise RuntimeError(f"pipeline stage {stage} owns no parameters")
    name = f"gradients (pp=2, stage {stage})"
    rec.add(_judged_dicts(name, owned, ref, lambda r: {k: r.grads[k] for k in owned if k in r.grads}))


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
    rec.add(_judged("logits (cp=2, gathered)", logits.detach(), ref, lambda r: r.logits[0]))
    rec.add(_judged("loss (cp=2)", loss.detach(), ref, lambda r: r.losses[0]))
    rec.add(_judged_dicts("gradients (cp=2)", _grads(model, ref.gradless), ref, lambda r: r.grads))


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


@dataclass
class _RankReport:
    """What one rank found: its checks, and when one of them raised (``time.monotonic()``,
    one clock for every process of the machine), after which it ran nothing more."""

    checks: list[dict[str, Any]]
    ran: list[str]  # the parallelisms it ran, the one that raised included
    raised_at: float | None = None


def _stage5_worker(rank: int, world_size: int, setup: _Setup, case: ModelCase) -> _RankReport:
    rec = StageRecorder(case, 5)
    ran: list[str] = []
    for name in setup.parallelisms:
        start = time.perf_counter()
        ran.append(name)
        try:
            _CHECKS[name](rec, setup, rank)
        except Exception as exc:
            raised_at = time.monotonic()
            where = traceback.extract_tb(exc.__traceback__)[-1]
            rec.check(
                f"raised ({LABELS[name]})", False, f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})"
            )
            logger.exception("rank %d: %s check raised", rank, name)
            # A peer may be blocked in a collective this rank left: the process group is not
            # usable for another check.
            return _RankReport([check.model_dump() for check in rec.checks], ran, raised_at)
        logger.info("rank %d: %s checks took %.2fs", rank, name, time.perf_counter() - start)
    return _RankReport([check.model_dump() for check in rec.checks], ran)


def _raised(report: _RankReport) -> bool:
    return report.raised_at is not None


def _merge_ranks(reports: Sequence[_RankReport | None]) -> list[CheckResult]:
    """One check per name: passed on every rank that ran it, the largest difference, and the
    errors against the float64 truth of the rank nearest its bound.

    A failed check lists each different detail once, with the ranks that reported it. When
    a rank raised, a peer whose check raised later with another error, or that was stopped
    before it reported (``None``), failed because of it: it is named as stopped by that rank
    rather than as a failure of its own (its error is the collective it was left in).
    """
    raised_at = {rank: r.raised_at for rank, r in enumerate(reports) if r is not None and r.raised_at is not None}
    first = min(raised_at, key=lambda rank: raised_at[rank]) if raised_at else None
    merged: dict[str, list[tuple[int, CheckResult]]] = {}
    for rank, report in enumerate(reports):
        for data in report.checks if report is not None else ():
            check = CheckResult.model_validate(data)
            merged.setdefault(check.name, []).append((rank, check))
    # The check the first failing rank raised in: the last it recorded.
    first_report = reports[first] if first is not None else None
    root_check = first_report.checks[-1]["name"] if first_report is not None else None
    results = []
    for name, entries in merged.items():
        failed = [(rank, c) for rank, c in entries if not c.passed]
        diffs = [c.max_abs_diff for _, c in entries if c.max_abs_diff is not None]
        ranks = ",".join(str(rank) for rank, _ in entries)
        if failed:
            detail = _failed_detail(name, failed, reports, first, root_check)
        else:
            detail = f"ranks {ranks}" + (f": {entries[0][1].detail}" if entries[0][1].detail else "")
        worst = max((c for _, c in entries), key=lambda c: c.share_of_bound() or 0.0)
        results.append(
            worst.model_copy(
                update={"passed": not failed, "detail": detail, "max_abs_diff": max(diffs) if diffs else None}
            )
        )
    return results


def _failed_detail(
    name: str,
    failed: list[tuple[int, CheckResult]],
    reports: Sequence[_RankReport | None],
    first: int | None,
    root_check: str | None,
) -> str:
    root_detail = next((c.detail for rank, c in failed if rank == first), None)
    by_detail: dict[str, list[int]] = {}
    stopped: list[int] = []
    for rank, check in failed:
        if first is not None and name == root_check and rank != first and check.detail != root_detail:
            stopped.append(rank)
        else:
            by_detail.setdefault(check.detail, []).append(rank)
    if name == root_check:
        stopped += [rank for rank, report in enumerate(reports) if report is None]
    parts = [
        f"{'ranks' if len(ranks) > 1 else 'rank'} {','.join(map(str, ranks))}: {detail}"
        for detail, ranks in by_detail.items()
    ]
    if stopped:
        who = "ranks " + ",".join(map(str, sorted(stopped))) if len(stopped) > 1 else f"rank {stopped[0]}"
        parts.append(f"{who} stopped when rank {first} failed")
    return "; ".join(parts)


def run_parallelisms(setup: _Setup, case: ModelCase, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[CheckResult]:
    """``setup.parallelisms`` on forked workers, merged over ranks.

    The parallelisms of one world size share one launch. A rank that fails leaves its peers
    in a collective: the launch's workers are stopped (:func:`launch`'s ``stop_when``)
    without waiting for the collective timeout, and the parallelisms it had not reached
    start again on fresh workers, so a failure never shows as another's. A launch that dies
    (a crashed worker, a timeout) is retried one parallelism per launch, to name the one.
    """
    checks: list[CheckResult] = []
    for world_size in sorted({WORLD_SIZES[p] for p in setup.parallelisms}):
        pending = [p for p in setup.parallelisms if WORLD_SIZES[p] == world_size]
        while pending:
            group = dataclasses.replace(setup, parallelisms=tuple(pending))
            for name in pending:  # in the parent, before forking: shared by the ranks
                setup.reference(_REFERENCE_OF[name])
            try:
                reports = launch(_stage5_worker, world_size, args=(group, case), timeout_s=timeout_s, stop_when=_raised)
            except WorkerFailure as failure:
                if len(pending) == 1:
                    checks.append(CheckResult(name=f"raised ({LABELS[pending[0]]})", passed=False, detail=str(failure)))
                    pending = []
                else:
                    checks += run_parallelisms(dataclasses.replace(setup, parallelisms=(pending[0],)), case, timeout_s)
                    pending = pending[1:]
                continue
            checks += _merge_ranks(reports)
            # Done: up to the first parallelism a rank raised in, or all of them.
            raised = [len(r.ran) for r in reports if r is not None and r.raised_at is not None]
            pending = pending[min(raised) :] if raised else []
    return checks


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
        reasons = applicable_parallelisms(model, pair.archon.spec)
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
        setup = _Setup(spec=spec, model=model, batches=batches, parallelisms=chosen)
        for check in run_parallelisms(setup, case, timeout_s):
            rec.add(check)
        missing = sorted({ref.truth_missing for ref in setup.references.values() if ref.truth is None})
        for reason in missing:
            rec.check("not run (float64 one-process reference)", True, f"{reason}; judged by assert_close's defaults")

    return run_stage(case, 5, body, raise_on_failure)
