"""Does every entry of a package's TP plan name a module the model has?

``parallelize_module`` resolves each plan key (``"attention.q_norm"``) against the module
it is applied to and, when nothing matches, only warns and skips the entry: a plan written
for a feature the model lacks (QK norm, a post-norm, shared experts) passes every test
that does not look for it. This check builds the package's model on the meta device,
runs the package's own ``parallelize_<model>`` with tensor (and, for MoE, expert)
parallelism switched on and ``parallelize_module`` replaced by a recorder, and resolves
every recorded key the way torch does (one ``fnmatch`` per dotted atom). Layer-level
keys are thereby matched against the ``TransformerBlock`` they were applied to, top-level
keys against the model.

It runs in a fresh interpreter (``python -m skill.porting.tp_plan``) over a copy of the
staged ``archon_models/``, so a package staged but not yet written is checked as it will
be, and a package edited since this process imported ``archon_models`` is seen as it is.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

import skill
from skill.codemod import StagedTree
from skill.porting.child_process import run_python_module
from skill.porting.common import PackageLayout
from skill.scratch import scratch_dir

logger = logging.getLogger(__name__)

# The engine's own checkout, so the worker runs this code even in a workspace without skill/.
_ENGINE_ROOT = Path(skill.__file__).resolve().parents[1]
PLAN_TIMEOUT_S = 300.0


class UnmatchedPlanEntry(BaseModel):
    """One plan key that resolves to no module of the module it was applied to."""

    key: str = Field(description="the plan key, e.g. 'attention.q_norm'")
    level: str = Field(
        description="'layer' (applied to each TransformerBlock), 'model' (the top level), or the module path"
    )
    applied_to: str = Field(description="the module(s) the plan was applied to, e.g. 'layers.0-1' or '(model)'")
    probe: str = Field(description="the model the plan was traced on (config and parallelism)")
    children: list[str] = Field(description="what that module has at the atom that did not match")


class PlanTrace(BaseModel):
    """What the worker found: unmatched entries, how many keys matched, and probes that could not run."""

    unmatched: list[UnmatchedPlanEntry] = Field(default_factory=list)
    matched_keys: int = Field(default=0, description="distinct plan keys (per level) that resolved")
    probes: list[str] = Field(default_factory=list)
    skipped_probes: list[str] = Field(default_factory=list, description="configs whose model could not be built")


class PlanTraceError(RuntimeError):
    """The package could not be imported, built on the meta device or parallelised."""


def trace_tp_plan(
    tree: StagedTree, model_name: str, sources: list[str], timeout_s: float = PLAN_TIMEOUT_S
) -> PlanTrace:
    """Trace ``model_name``'s TP plan on models built from its args defaults and from each of
    ``sources`` (model_types or config paths); raise :class:`PlanTraceError` when it cannot run."""
    with scratch_dir("plan") as root:
        for rel in tree.list_files("archon_models"):
            text = tree.read_text(rel)
            if text is not None:
                target = root / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
        out = root / "plan.json"
        argv = [model_name, "--out", str(out)]
        for source in sources:
            argv += ["--source", source]
        paths = [str(root), str(_ENGINE_ROOT), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        try:
            proc = run_python_module("skill.porting.tp_plan", argv, cwd=root, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise PlanTraceError(f"tracing the TP plan ran past {timeout_s:.0f}s") from e
        if proc.returncode != 0 or not out.is_file():
            raise PlanTraceError(_last_error(proc.stderr))
        return PlanTrace.model_validate_json(out.read_text(encoding="utf-8"))


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "the worker exited without a result"


# --- the worker ------------------------------------------------------------------------


class _ProbeMesh:
    """A one-rank stand-in for a device mesh: the plan functions only ask its size and this
    rank's place in it (an ALiBi family's head offset)."""

    ndim = 1

    def __init__(self, name: str):
        self.mesh_dim_names = (name,)

    def size(self, mesh_dim: int | None = None) -> int:
        return 1

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        return 0


@dataclass
class _ProbeDims:
    """The flags and meshes a ``parallelize_<model>`` reads, with TP (and EP) switched on and
    everything that needs a process group (CP, FSDP, PP) off."""

    ep_enabled: bool = False
    tp_enabled: bool = True
    etp_enabled: bool = False
    cp_enabled: bool = False
    pp_enabled: bool = False
    fsdp_enabled: bool = False
    dp_replicate_enabled: bool = False
    dp_shard_enabled: bool = False
    tp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    fsdp_gradient_divide_factor: int = 1
    _meshes: dict[str, _ProbeMesh] = field(default_factory=dict)

    def get_mesh(self, name: str) -> _ProbeMesh | None:
        if name == "ep" and not self.ep_enabled:
            return None
        return self._meshes.setdefault(name, _ProbeMesh(name))

    def get_group(self, name: str) -> None:
        raise RuntimeError(f"the TP plan check runs without process groups (asked for {name!r})")


def _unresolved(module: Any, key: str) -> tuple[str, list[str]] | None:
    """``None`` when ``key`` resolves like torch's ``parallelize_module`` does, else the
    atom that matched nothing and the children present at that point."""
    if key == "":
        return None
    frontier = [module]
    for atom in key.split("."):
        matched = [child for m in frontier for name, child in m.named_children() if fnmatch(name, atom)]
        if not matched:
            return atom, sorted({name for m in frontier for name, _ in m.named_children()})
        frontier = matched
    return None


def _level(model: Any, target: Any) -> tuple[str, str]:
    if target is model:
        return "model", "(model)"
    layers = getattr(model, "layers", None)
    if layers is not None:
        for index, block in layers.items():
            if block is target:
                return "layer", f"layers.{index}"
    for name, module in model.named_modules():
        if module is target:
            return name, name
    return "unknown", type(target).__name__


def _layer_span(names: list[str]) -> str:
    indices = [name.split(".", 1)[1] for name in names]
    return f"layers.{indices[0]}" if len(indices) == 1 else f"layers.{indices[0]}-{indices[-1]}"


def _trace_one(package: str, args: Any, probe: str, ep: bool) -> tuple[list[UnmatchedPlanEntry], set[str], bool]:
    """Unmatched entries, the matched ``level:key`` names, and whether the model has experts."""
    import torch

    layout = PackageLayout.for_name(package)
    model_module = importlib.import_module(f"{layout.module}.model.model")
    parallelize_module_ = importlib.import_module(f"{layout.module}.infra.parallelize")
    model_class = getattr(model_module, layout.model_class)
    parallelize_fn = getattr(parallelize_module_, layout.parallelize_fn)
    with torch.device("meta"):
        model = model_class(args)
    calls: list[tuple[Any, Any]] = []

    def record(module: Any, device_mesh: Any, parallelize_plan: Any = None, **kwargs: Any) -> Any:
        calls.append((module, parallelize_plan))
        return module

    def keep_local(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor  # a parameter the plan shards itself (attention sinks): nothing to trace

    stand_ins = {"parallelize_module": record, "distribute_tensor": keep_local}
    originals = {name: parallelize_module_.__dict__.get(name) for name in stand_ins}
    vars(parallelize_module_).update(stand_ins)
    try:
        parallelize_fn(model, _ProbeDims(ep_enabled=ep), enable_compile=False)
    finally:
        for name, original in originals.items():
            if original is not None:
                vars(parallelize_module_)[name] = original
            else:
                vars(parallelize_module_).pop(name, None)
    # One entry per (key, level): a layer key missing from every block is reported once.
    missing: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    matched: set[str] = set()
    for target, plan in calls:
        if not isinstance(plan, dict):
            continue
        level, where = _level(model, target)
        for key in plan:
            problem = _unresolved(target, key)
            if problem is None:
                matched.add(f"{level}:{key}")
                continue
            places, _ = missing.setdefault((key, level), ([], problem[1]))
            places.append(where)
    entries = [
        UnmatchedPlanEntry(
            key=key,
            level=level,
            applied_to=_layer_span(places) if level == "layer" else ", ".join(places),
            probe=probe + (" with EP" if ep else ""),
            children=children,
        )
        for (key, level), (places, children) in missing.items()
    ]
    has_experts = any(name.endswith(".experts") for name, _ in model.named_modules())
    return entries, matched, has_experts


def run_locally(package: str, sources: list[str]) -> PlanTrace:
    """Trace the plan on the args defaults and on each source's config (worker side)."""
    from skill.porting.hf_source import load_config

    layout = PackageLayout.for_name(package)
    args_class = getattr(importlib.import_module(f"{layout.module}.model.args"), layout.args_class)
    probes: list[tuple[str, Any]] = [(f"{layout.args_class}()", args_class())]
    skipped: list[str] = []
    for source in dict.fromkeys(sources):
        for critic in (False, True):
            label = f"from_hf_config({source}{', is_critic=True' if critic else ''})"
            try:
                probes.append((label, args_class.from_hf_config(load_config(source), is_critic=critic)))
            except Exception as e:  # a config the args cannot read is config_attributes' and stage 1's to report
                skipped.append(f"{label}: {type(e).__name__}: {e}")
        # The tiny config the stages run: the plan must fit the model they test.
        from skill.tiny_model import tiny_config

        try:
            probes.append(
                (f"from_hf_config(tiny {source})", args_class.from_hf_config(tiny_config(load_config(source))))
            )
        except Exception as e:  # as above: stage 1 reports it
            skipped.append(f"from_hf_config(tiny {source}): {type(e).__name__}: {e}")
    trace = PlanTrace(skipped_probes=skipped)
    seen: set[tuple[str, str]] = set()
    matched_keys: set[str] = set()
    traced = 0
    for index, (label, args) in enumerate(probes):
        has_experts = False
        for ep in (False, True):
            if ep and not has_experts:
                continue  # expert parallelism only changes the plan of MoE blocks
            try:
                entries, matched, has_experts = _trace_one(package, args, label, ep)
            except ValueError as e:
                # A model the args refuse to build (a config class whose defaults are no real
                # model, such as an odd rotary width) is skipped while another probe builds.
                if traced or index + 1 < len(probes):
                    skipped.append(f"{label}: {type(e).__name__}: {e}")
                    break
                raise
            traced += 1
            matched_keys |= matched
            trace.probes.append(label + (" with EP" if ep else ""))
            for entry in entries:
                if (entry.key, entry.level) not in seen:
                    seen.add((entry.key, entry.level))
                    trace.unmatched.append(entry)
    if not traced:
        raise ValueError("no probe of the args builds a model: " + "; ".join(skipped))
    trace.skipped_probes = skipped
    trace.matched_keys = len(matched_keys)
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="worker of check_package's TP plan check: writes one JSON file")
    parser.add_argument("model_name")
    parser.add_argument("--source", action="append", default=[], help="model_type or config path (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    trace = run_locally(args.model_name, args.source)
    args.out.write_text(trace.model_dump_json(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
