"""Run HF and Archon side by side and name the first module whose output differs.

Every module of both models gets a forward hook. Archon modules are matched to HF modules
through the adapter's key map (the HF module of an Archon module is the common prefix of
the HF keys of its parameters). A module without parameters (a weightless LayerNorm, an
activation module) has no key to match by; it is matched by where it runs: to the HF
module without parameters, of the same output shape, that runs between the same two
matched neighbours inside the same matched parent. Pairs are compared in the order the
Archon forward ran them; the first pair outside tolerance is where a port went wrong.

The comparison runs in a fresh interpreter (``python -m skill.porting.locate_divergence``),
so a package edited since this process imported ``archon_models`` is seen as it is now.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, JsonValue

import skill
from skill.codemod import Workspace
from skill.errors import WorkerFailedError, last_error_line
from skill.porting.child_process import run_python_module
from skill.porting.common import PackageLayout, PackageRequest
from skill.porting.overrides import ConfigOverrides, ModelTypeName
from skill.scratch import scratch_dir

logger = logging.getLogger(__name__)

# The engine's own checkout, so the worker runs this code even in a workspace without skill/.
_ENGINE_ROOT = Path(skill.__file__).resolve().parents[1]

# torch.testing.assert_close's fp32 defaults, module by module. Stages 4-6 judge by a float64
# truth instead (skill.harness.truth): on a model with large activations, modules of a correct
# port can differ by more than this, from rounding alone.
RTOL = 1.3e-6
ATOL = 1e-5


class ModuleDiff(BaseModel):
    archon_module: str
    hf_module: str
    max_abs_diff: float
    shape: list[int]
    within_tolerance: bool
    input_max_abs_diff: float | None = Field(
        default=None, description="difference of the module's first input, when both sides' inputs compare"
    )
    matched_by: Literal["adapter_map", "execution_order"] = Field(
        default="adapter_map",
        description="how the HF module was found: through the parameters' adapter keys, or (a module "
        "without parameters) by running between the same matched neighbours",
    )


class LocateDivergenceRequest(PackageRequest):
    model_type: ModelTypeName | None = Field(
        default=None, description="HF model_type (default: the first case of the package's test file, else model_name)"
    )
    num_tokens: int = Field(default=13, ge=2, le=512, description="length of the one document run through both models")
    config_overrides: ConfigOverrides = Field(
        default_factory=dict,
        description="config attributes set on the tiny HF config both sides are built from, on top of the test "
        'case\'s (e.g. {"clip_qkv": 8.0} to exercise a feature the default hides)',
    )


class LocateDivergenceResult(BaseModel):
    model_name: str
    model_type: str
    diverged: bool
    first_divergence: ModuleDiff | None = None
    logits_max_abs_diff: float
    compared: list[ModuleDiff] = Field(description="matched modules in Archon execution order")
    unmatched_archon_modules: list[str] = Field(
        default_factory=list, description="modules with parameters the adapter map does not connect to HF"
    )
    config_overrides: dict[str, JsonValue] = Field(
        default_factory=dict, description="every override on the tiny config: the test case's and the request's"
    )


def locate_divergence(request: LocateDivergenceRequest) -> LocateDivergenceResult:
    """Run a tiny HF model and its Archon port on the same tokens with hooks on every module
    and name the first Archon module (matched to its HF module through the adapter map)
    whose output differs beyond fp32 tolerance, with the numbers. Use when stage 4 fails."""
    workspace = Workspace(request.workspace)
    layout = PackageLayout.for_name(request.model_name)
    if not (workspace.root / layout.package_dir).is_dir():
        raise FileNotFoundError(f"{layout.package_dir}/ does not exist; port the family first (archon-port add).")
    argv = [request.model_name, "--num-tokens", str(request.num_tokens)]
    if request.model_type:
        argv += ["--model-type", request.model_type]
    if request.config_overrides:
        argv += ["--config-overrides", json.dumps(request.config_overrides)]
    paths = [str(workspace.root), str(_ENGINE_ROOT), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    proc = run_python_module("skill.porting.locate_divergence", argv, cwd=workspace.root, env=env, timeout=600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        logger.debug("the divergence run's output:\n%s", proc.stderr)
        raise WorkerFailedError(
            f"divergence run of {request.model_name} failed (exit {proc.returncode}): {last_error_line(proc.stderr)}"
        )
    return LocateDivergenceResult.model_validate_json(lines[-1])


def _case_for(root: Path, model_name: str, model_type: str | None):
    """The test file's case of ``model_type`` (default: its first), read as a literal.

    The file is parsed, never run: what a test file does beyond its ``CASES`` list is for
    pytest to run in a stage, not for a divergence run to execute on the side.
    """
    from skill.harness import ModelCase
    from skill.porting.test_file import read_cases

    test_file = root / PackageLayout.for_name(model_name).test_file
    if test_file.is_file():
        for case in read_cases(test_file.read_text(encoding="utf-8")):
            if model_type is None or case.get("model_type") == model_type:
                return ModelCase(**case)
    return ModelCase(model_type=model_type or model_name)


def _first_tensor(value: Any):
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    prefix: list[str] = []
    for items in zip(*parts, strict=False):
        if len(set(items)) != 1:
            break
        prefix.append(items[0])
    return ".".join(prefix)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _has_parameters(module: Any) -> bool:
    return next(module.parameters(), None) is not None


class _Recorder:
    """Forward hooks on every module of one model: first output, first input, completion order."""

    def __init__(self, model: Any, with_kwargs: bool):
        self.outputs: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}
        self.order: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            if not name:
                continue
            if with_kwargs:
                hook = functools.partial(self._hook_kwargs, name)
                self.handles.append(module.register_forward_hook(hook, with_kwargs=True))
            else:
                self.handles.append(module.register_forward_hook(functools.partial(self._hook, name)))

    def _hook(self, name: str, module: Any, args: Any, out: Any) -> None:
        self._record(name, _first_tensor(args), out)

    def _hook_kwargs(self, name: str, module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        self._record(name, _first_tensor(args) if args else _first_tensor(kwargs.get("hidden_states")), out)

    def _record(self, name: str, first_in: Any, out: Any) -> None:
        tensor = _first_tensor(out)
        if tensor is None or name in self.outputs:
            return
        self.outputs[name] = tensor.detach()
        self.order.append(name)
        if first_in is not None:
            self.inputs[name] = first_in.detach()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _match_parameterless(
    model: Any, hf_model: Any, matches: dict[str, str], archon: _Recorder, hf: _Recorder
) -> dict[str, str]:
    """Archon modules without parameters -> HF modules, by where they run.

    The HF partner runs after the HF partner of the last matched Archon module that
    finished before it and before the HF partner of the next one, lies inside the HF
    partner of its nearest matched ancestor, has no parameters either and has the same
    output shape; the first such module not yet taken.
    """
    archon_modules = dict(model.named_modules())
    hf_modules = dict(hf_model.named_modules())
    hf_position = {name: i for i, name in enumerate(hf.order)}
    taken = set(matches.values())
    found: dict[str, str] = {}
    for i, name in enumerate(archon.order):
        if name in matches or _has_parameters(archon_modules[name]):
            continue
        before = next((n for n in reversed(archon.order[:i]) if n in matches), None)
        after = next((n for n in archon.order[i + 1 :] if n in matches), None)
        low = hf_position.get(matches[before], -1) if before is not None else -1
        high = hf_position.get(matches[after], len(hf.order)) if after is not None else len(hf.order)
        ancestor = _parent(name)
        while ancestor and ancestor not in matches:
            ancestor = _parent(ancestor)
        scope = matches.get(ancestor, "")
        shape = archon.outputs[name].shape
        for hf_name in hf.order[low + 1 : high]:
            inside = not scope or hf_name.startswith(scope + ".")
            if (
                inside
                and hf_name not in taken
                and not _has_parameters(hf_modules[hf_name])
                and hf.outputs[hf_name].shape == shape
            ):
                found[name] = hf_name
                taken.add(hf_name)
                break
    return found


def run_locally(
    root: Path, model_name: str, model_type: str | None, num_tokens: int, config_overrides: dict[str, Any] | None = None
) -> LocateDivergenceResult:
    import torch

    from skill.harness.models import build_model_pair

    case = _case_for(root, model_name, model_type)
    if config_overrides:
        case = case.model_copy(update={"config_overrides": {**case.config_overrides, **config_overrides}})
    with scratch_dir("diverge") as tmp:
        pair = build_model_pair(case, tmp, attn_type="sdpa")
    hf_model, archon = pair.hf_model, pair.archon
    adapter, model = archon.adapter, archon.model

    # Archon module -> HF module, through the adapter's key map.
    hf_params: dict[str, list[str]] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        pairs = adapter.convert_single_to_hf(name, torch.empty(0))
        for hf_key, _ in pairs:
            hf_module = hf_key.rsplit(".", 1)[0]
            archon_path = name.rsplit(".", 1)[0]
            parts = archon_path.split(".")
            for i in range(1, len(parts) + 1):
                hf_params.setdefault(".".join(parts[:i]), []).append(hf_module)
    hf_modules = dict(hf_model.named_modules())
    matches = {a: _common_prefix(h) for a, h in hf_params.items()}
    matches = {a: h for a, h in matches.items() if h in hf_modules}

    generator = torch.Generator().manual_seed(case.seed)
    args: Any = archon.args  # the family's ModelArgs; vocab_size is not a BaseModelArgs field
    tokens = torch.randint(0, args.vocab_size, (1, num_tokens), generator=generator)
    positions = torch.arange(num_tokens).unsqueeze(0)
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32)

    archon_rec = _Recorder(model, with_kwargs=False)
    hf_rec = _Recorder(hf_model, with_kwargs=True)
    try:
        with torch.no_grad():
            hf_logits = hf_model(tokens).logits
            logits = model(tokens, positions, cu_seqlens, num_tokens)
    finally:
        archon_rec.remove()
        hf_rec.remove()
    by_order = _match_parameterless(model, hf_model, matches, archon_rec, hf_rec)

    compared: list[ModuleDiff] = []
    for name in archon_rec.order:
        hf_name = matches.get(name) or by_order.get(name)
        if hf_name is None:
            continue
        a, h = archon_rec.outputs[name], hf_rec.outputs.get(hf_name)
        if h is None or a.shape != h.shape:
            continue
        diff = float((a.float() - h.float()).abs().max()) if a.numel() else 0.0
        ok = bool(torch.allclose(a.float(), h.float(), rtol=RTOL, atol=ATOL))
        a_in, h_in = archon_rec.inputs.get(name), hf_rec.inputs.get(hf_name)
        in_diff = None
        if a_in is not None and h_in is not None and a_in.shape == h_in.shape and a_in.is_floating_point():
            in_diff = float((a_in.float() - h_in.float()).abs().max()) if a_in.numel() else 0.0
        compared.append(
            ModuleDiff(
                archon_module=name,
                hf_module=hf_name,
                max_abs_diff=diff,
                shape=list(a.shape),
                within_tolerance=ok,
                input_max_abs_diff=in_diff,
                matched_by="adapter_map" if name in matches else "execution_order",
            )
        )
    logits_diff = float((logits.float() - hf_logits.float()).abs().max())
    logits_ok = bool(torch.allclose(logits, hf_logits, rtol=RTOL, atol=ATOL))
    first = None if logits_ok else _first_lasting(compared)
    unmatched = sorted(
        n for n, m in model.named_modules() if n and n not in matches and list(m.parameters(recurse=False))
    )
    return LocateDivergenceResult(
        model_name=model_name,
        model_type=case.model_type,
        diverged=not logits_ok,
        first_divergence=first,
        logits_max_abs_diff=logits_diff,
        compared=compared,
        unmatched_archon_modules=unmatched,
        config_overrides=case.config_overrides,
    )


def _first_lasting(compared: list[ModuleDiff]) -> ModuleDiff | None:
    """The first differing module whose difference the next module does not absorb.

    A module boundary can sit at a different place on the two sides (HF may scale the
    embedding inside its embedding module, Archon right after it); the difference then
    vanishes at the next module, so it is not where the port went wrong. "Next" skips the
    module's siblings: they run on their own inputs (``w3`` next to an activation), so
    only what runs after it outside its parent, or the parent itself, can absorb it.
    """
    by_name = {c.archon_module: c for c in compared}
    for i, diff in enumerate(compared):
        if diff.within_tolerance:
            continue
        parent = _parent(diff.archon_module)
        following = next((c for c in compared[i + 1 :] if _parent(c.archon_module) != parent), None)
        if following is None or not following.within_tolerance:
            return _culprit(diff, by_name)
    first = next((c for c in compared if not c.within_tolerance), None)
    return None if first is None else _culprit(first, by_name)


def _culprit(diff: ModuleDiff, by_name: dict[str, ModuleDiff]) -> ModuleDiff:
    """The module whose own code went wrong.

    A sub-module that already receives a different input, although every module before
    it matched, is fed by its parent's own code (the glue between sub-modules): report
    the nearest matched parent instead.
    """
    tolerance = ATOL
    if diff.input_max_abs_diff is None or diff.input_max_abs_diff <= tolerance:
        return diff
    parts = diff.archon_module.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = by_name.get(".".join(parts[:i]))
        if parent is not None and not parent.within_tolerance:
            return parent
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="worker of locate_divergence: prints one JSON line")
    parser.add_argument("model_name")
    parser.add_argument("--model-type")
    parser.add_argument("--num-tokens", type=int, default=13)
    parser.add_argument("--config-overrides", type=json.loads, default={}, help="JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    result = run_locally(Path.cwd(), args.model_name, args.model_type, args.num_tokens, args.config_overrides)
    sys.stdout.write(json.dumps(result.model_dump()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
