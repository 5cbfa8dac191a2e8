"""The AReaL tier: a package, inside a real AReaL, built and loaded as AReaL's engine does.

Runs in a Python that imports ``areal`` (the cached venv of
:mod:`skill.areal.environment`, or the user's AReaL environment for ``export``) with the
package already placed under ``areal/experimental/models/archon/``. For one HF
model_type, every check goes through AReaL's registry and shared modules:

- the engine's keyword arguments (``attn_type``, ``router_dtype`` and an unknown one)
  are accepted, and ``router_dtype`` reaches every router gate;
- the model is built and loaded by AReaL's own ``ArchonEngine`` code
  (:mod:`skill.areal.engine_load`: meta device, the spec's parallelize, ``to_empty``, AReaL's
  ``load_model_from_hf``, ``init_buffers``), for ``sdpa`` and ``varlen``; afterwards every
  checkpoint tensor is in the model, the score-correction bias included, and a tied head is
  still tied, also after a training step (:mod:`skill.areal.engine_checks`);
- logits and gradients match HF fp32 on CPU for several packed documents
  judged by HF's float64 run (``skill.harness.parity``'s comparison);
- ``to_hf`` reproduces the checkpoint; ``convert_single_to_hf`` per parameter, joined,
  equals ``to_hf``, also under activation-checkpoint and compile wrapper names;
- the critic (``is_critic=True``) builds and yields one value per token;
- TP=2 and FSDP=2 on two gloo processes, through AReaL's ``ArchonParallelDims`` and
  ``ActivationCheckpointConfig``, match one process, gradients included
  (``skill.harness.distributed``'s workers).

``python -m skill.areal.checks serve`` answers requests one JSON line at a time, so a
test session pays the import of AReaL once per worker.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from skill.areal.engine_checks import check_materialised, check_training_step
from skill.areal.engine_load import EngineStandIn, build_as_engine
from skill.harness.case import ModelCase
from skill.harness.compare import compare_tensor_dicts
from skill.harness.inputs import make_packed_inputs
from skill.harness.keys import join_single
from skill.harness.models import (
    ArchonModel,
    build_hf_config,
    build_hf_model,
    read_hf_checkpoint,
    save_hf_checkpoint,
)
from skill.harness.parity import (
    archon_outputs,
    check_against_hf,
    float64_truth,
    hf_reference,
    parity_inputs,
    truth_reference,
)
from skill.harness.results import CheckResult, StageRecorder

logger = logging.getLogger(__name__)

# The check recorded instead of TP when AReaL's validate_tp_constraints refuses tp=2.
TP_REFUSED = "AReaL helpers: tp=2 refused by AReaL's own validate_tp_constraints"
# ... and when the package declares it has no TP plan (``unsupported_parallelisms``, which its
# parallelize refuses: a hybrid's linear-attention layers).
TP_NOT_PLANNED = "AReaL helpers: tp=2 not run, the package has no TP plan"

ATTN_TYPES = ("sdpa", "varlen")
WRAPPERS = ("._checkpoint_wrapped_module", "._orig_mod")


class AReaLCheckRequest(BaseModel):
    model_type: str = Field(description="HF model_type the package serves inside AReaL")
    distributed: bool = Field(default=True, description="also run TP=2 and FSDP=2 on 2 gloo processes")


class AReaLCheckResult(BaseModel):
    model_type: str
    package: str = Field(description="the AReaL module whose spec serves model_type")
    checks: list[CheckResult]
    seconds: float = Field(json_schema_extra={"volatile": True})
    max_logit_diff: float | None = None
    max_grad_diff: float | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)


def _engine_model(engine: EngineStandIn) -> ArchonModel:
    model = engine.model
    return ArchonModel(spec=engine.spec, args=model.model_args, model=model, adapter=engine.state_dict_adapter)


def _wrapped(name: str, wrapper: str) -> str:
    """``layers.3.attention.wq.weight`` as a wrapped layer names it."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 2:
        return ".".join(parts[:2]) + wrapper + "." + ".".join(parts[2:])
    return name


def _check_engine_kwargs(rec: StageRecorder, spec: Any, hf_config: Any) -> None:
    try:
        args = spec.model_args_class.from_hf_config(
            hf_config, is_critic=False, attn_type="sdpa", router_dtype=torch.float32, an_option_areal_adds_later=1
        )
    except Exception as exc:
        rec.check("from_hf_config takes the engine's keyword arguments", False, f"{type(exc).__name__}: {exc}")
        return
    rec.check("from_hf_config takes the engine's keyword arguments", True, "attn_type, router_dtype, an unknown one")
    rec.check("attn_type reaches the args", args.attn_type == "sdpa", f"attn_type={args.attn_type!r}")
    with torch.device("meta"):
        model = spec.model_class(args)
    gates = [(n, m) for n, m in model.named_modules() if n.endswith("router.gate")]
    if gates:
        wrong = [n for n, m in gates if getattr(m, "router_dtype", None) is not torch.float32]
        rec.check(
            "router_dtype reaches every router gate",
            not wrong,
            f"{len(gates)} gates" if not wrong else f"not float32: {wrong[:3]}",
        )


def _check_checkpoint_roundtrip(rec: StageRecorder, model: Any, adapter: Any, checkpoint: Path) -> None:
    on_disk = read_hf_checkpoint(checkpoint)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf = adapter.to_hf(state)
    rec.add(compare_tensor_dicts("to_hf reproduces the checkpoint's keys and values", hf, on_disk))
    for wrapper in ("", *WRAPPERS):
        slices: dict[str, list[torch.Tensor]] = {}
        for name, tensor in state.items():
            for hf_key, value in adapter.convert_single_to_hf(_wrapped(name, wrapper), tensor):
                # A fused checkpoint tensor (qkv_proj, gate_up_proj) arrives as one slice
                # per Archon parameter, in parameter order: joined, they are the whole.
                slices.setdefault(hf_key, []).append(value)
        joined = {hf_key: join_single(adapter, hf_key, pieces) for hf_key, pieces in slices.items()}
        label = f" (names with {wrapper.lstrip('.')})" if wrapper else ""
        rec.add(compare_tensor_dicts(f"convert_single_to_hf per parameter equals to_hf{label}", joined, hf))


def _check_critic(rec: StageRecorder, spec: Any, hf_config: Any, checkpoint: Path) -> None:
    # A critic starts from scratch in AReaL's order (init_weights, no load), then takes the trunk.
    engine = build_as_engine(spec, hf_config, None, "sdpa", is_critic=True)
    critic, args = engine.model, engine.model.model_args
    adapter = spec.state_dict_adapter_class(hf_config, str(checkpoint))
    # The checkpoint is a causal LM's: its LM head has no place in a critic, whose
    # ``score`` head starts fresh.
    trunk = {k: v for k, v in adapter.from_hf(read_hf_checkpoint(checkpoint)).items() if not k.startswith("output.")}
    missing, unexpected = critic.load_state_dict(trunk, strict=False)
    inputs = make_packed_inputs((5, 3, 4), hf_config.vocab_size, seed=3)
    with torch.no_grad():
        values = critic(inputs.tokens, inputs.positions, inputs.cu_seqlens, inputs.max_seqlen)
    expected = (1, inputs.num_tokens, args.num_labels)
    ok = (
        hasattr(critic, "score")
        and not unexpected
        and all(k.startswith("score.") for k in missing)
        and tuple(values.shape) == expected
        and bool(torch.isfinite(values).all())
    )
    rec.check(
        "critic (is_critic=True) builds, loads the trunk, yields one value per token",
        ok,
        f"values {tuple(values.shape)}, expected {expected}; missing {list(missing)}, unexpected {list(unexpected)}",
    )


def _check_distributed(rec: StageRecorder, spec: Any, model: Any, case: ModelCase) -> None:
    from areal.experimental.models.archon.activation_checkpoint import ActivationCheckpointConfig
    from areal.experimental.models.archon.parallel_dims import ArchonParallelDims

    from skill.harness import distributed

    doc_lens = distributed._padded_doc_lens(case.doc_lens, 2 * distributed.WORLD_SIZE)
    vocab = model.model_args.vocab_size
    batches = [make_packed_inputs(doc_lens, vocab, seed=case.seed + r) for r in range(distributed.WORLD_SIZE)]
    from areal.experimental.models.archon.utils import validate_tp_constraints

    # TP where AReaL's own constraints allow it (one KV head cannot be split over two ranks).
    chosen: tuple[str, ...] = ("tp", "fsdp")
    not_planned = getattr(model, "unsupported_parallelisms", {}).get("tp")
    try:
        validate_tp_constraints(model.model_args, distributed.WORLD_SIZE)
    except ValueError as exc:
        chosen = ("fsdp",)
        rec.check(TP_REFUSED, True, str(exc))
    else:
        if not_planned is not None:
            chosen = ("fsdp",)
            rec.check(TP_NOT_PLANNED, True, not_planned)
    setup = distributed._Setup(
        spec=spec,
        model=model,
        batches=batches,
        parallelisms=chosen,
        dims_cls=ArchonParallelDims,
        ac_config_cls=ActivationCheckpointConfig,
    )
    for check in distributed.run_parallelisms(setup, case):
        rec.add(check.model_copy(update={"name": f"AReaL helpers: {check.name}"}))


def run_areal_checks(request: AReaLCheckRequest, workdir: str | Path | None = None) -> AReaLCheckResult:
    """Every AReaL-tier check for one model_type; a raising check is a failed check."""
    from areal.experimental.models.archon import get_model_spec

    from skill.areal.cpu_kernels import register_cpu_varlen_kernel

    start = time.perf_counter()
    case = ModelCase(model_type=request.model_type)
    rec = StageRecorder(case, 4)
    spec = get_model_spec(request.model_type)
    package = spec.model_class.__module__.rsplit(".model.", 1)[0]
    register_cpu_varlen_kernel()
    try:
        with tempfile.TemporaryDirectory(prefix="archon-areal-", dir=workdir) as tmp:
            tmp_path = Path(tmp)
            hf_config = build_hf_config(case)
            _check_engine_kwargs(rec, spec, hf_config)
            hf_model = build_hf_model(case, hf_config)
            checkpoint = save_hf_checkpoint(hf_model, tmp_path / "hf")
            inputs = parity_inputs(case, hf_config)
            ref = hf_reference(hf_model, inputs, tmp_path / "hf_grads")
            truth_grads = tmp_path / "truth_grads"
            truth = float64_truth(rec, lambda: truth_reference(hf_model, inputs, truth_grads), "tiny model")
            loaded = None
            for attn_type in ATTN_TYPES:
                engine = build_as_engine(spec, hf_config, checkpoint, attn_type)
                check_materialised(rec, engine, checkpoint, f"AReaL, {attn_type}")
                archon = _engine_model(engine)
                check_against_hf(rec, ref, archon_outputs(archon, inputs), inputs, f"AReaL, {attn_type}", truth)
                if attn_type == "sdpa":
                    loaded = archon
            assert loaded is not None
            check_training_step(rec, spec, hf_config, checkpoint, inputs, "sdpa")
            _check_checkpoint_roundtrip(rec, loaded.model, loaded.adapter, checkpoint)
            _check_critic(rec, spec, hf_config, checkpoint)
            if request.distributed:
                _check_distributed(rec, spec, loaded.model, case)
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        rec.check("raised", False, f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})")
        logger.exception("AReaL checks of %s raised", request.model_type)
    checks = rec.checks
    logits = [c.max_abs_diff for c in checks if c.name.startswith("logits") and c.max_abs_diff is not None]
    grads = [c.max_abs_diff for c in checks if c.name.startswith("gradients of every") and c.max_abs_diff is not None]
    return AReaLCheckResult(
        model_type=request.model_type,
        package=package,
        checks=checks,
        seconds=time.perf_counter() - start,
        max_logit_diff=max(logits) if logits else None,
        max_grad_diff=max(grads) if grads else None,
    )


def serve(stdin: Any = sys.stdin) -> None:
    """One :class:`AReaLCheckRequest` per input line, one :class:`AReaLCheckResult` per output line.

    AReaL's loggers (and forked workers) write to stdout; the protocol keeps the real
    stdout to itself and everything else that writes to file descriptor 1 lands on stderr.
    """
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in stdin:
        if not line.strip():
            continue
        request = AReaLCheckRequest.model_validate_json(line)
        result = run_areal_checks(request)
        stdout.write(result.model_dump_json() + "\n")
        stdout.flush()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="AReaL-tier checks (run inside a Python that imports areal)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="answer JSON-line requests on stdin")
    one = sub.add_parser("run", help="check model types and print one JSON result per line")
    one.add_argument("model_types", nargs="+")
    one.add_argument("--no-distributed", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        serve()
        return 0
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # as in serve(): stdout carries the results only
    sys.stdout = sys.stderr
    failed = False
    for model_type in args.model_types:
        result = run_areal_checks(AReaLCheckRequest(model_type=model_type, distributed=not args.no_distributed))
        out.write(json.dumps(result.model_dump()) + "\n")
        out.flush()
        failed |= not result.passed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
