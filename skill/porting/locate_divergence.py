"""Run HF and Archon side by side and name the first module whose output differs.

Every module of both models gets a forward hook that keeps every call's output. Archon
modules are paired with HF modules by their role, never by where they happen to run:

1. ``adapter_map``: through the adapter's key map (the HF module of an Archon module is
   the common prefix of the HF keys of its parameters);
2. ``module_role``: the module map of the HF model's anatomy, as the analysis reads it
   (:func:`hf_module_roles`): the layers' attention and feed-forward, their norms by the
   role each plays (probed), the attention's q/k norms, the final norm, the embedding
   norm. This pairs the modules without parameters (weightless norms) that have no key;
3. ``execution_order``, last, for a module without parameters that has no role (an
   activation module): the HF module without parameters and of the same kind (a norm or
   not) and output shape that runs between the same two matched neighbours inside the
   same matched parent, among those no role claims.

Every call of a paired module is compared (a module HF runs twice, such as a norm shared
by the embeddings and the output, gives two comparisons); when the two sides run it a
different number of times, the calls are paired from the last. An output whose layout
differs only by the heads and sequence axes (``[b, s, h, d]`` against ``[b, h, s, d]``)
is compared transposed; a pair whose outputs cannot be aligned is listed as not compared.
A module out of tolerance is a divergence unless the next module absorbs the difference
(the two sides put a module boundary at different places); the first one that lasts is
where a port went wrong.

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
from skill.features import BLOCK_NORM_NAMES
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


MatchedBy = Literal["adapter_map", "module_role", "execution_order"]


class ModuleDiff(BaseModel):
    archon_module: str
    hf_module: str
    max_abs_diff: float
    shape: list[int]
    within_tolerance: bool
    input_max_abs_diff: float | None = Field(
        default=None, description="difference of the module's first input, when both sides' inputs compare"
    )
    matched_by: MatchedBy = Field(
        default="adapter_map",
        description="how the HF module was found: through the parameters' adapter keys, by its role in "
        "the HF model's module map, or (a module without parameters and without a role) by running "
        "between the same matched neighbours",
    )
    call: int = Field(default=0, description="which call of the Archon module (0: its first)")
    hf_call: int = Field(default=0, description="which call of the HF module it is compared with")
    absorbed: bool = Field(
        default=False,
        description="out of tolerance, but the next module's output matches again: a module boundary at "
        "another place on the two sides, not a divergence",
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
    not_compared: list[str] = Field(
        default_factory=list,
        description="paired modules whose outputs could not be aligned (another shape), with both shapes",
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
    """Forward hooks on every module of one model: each call's output and first input, and
    the calls in completion order as ``(module, call index)``."""

    def __init__(self, model: Any, with_kwargs: bool):
        self.outputs: dict[str, list[Any]] = {}
        self.inputs: dict[str, list[Any]] = {}
        self.order: list[tuple[str, int]] = []
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
        if tensor is None:
            return
        calls = self.outputs.setdefault(name, [])
        self.order.append((name, len(calls)))
        calls.append(tensor.detach())
        self.inputs.setdefault(name, []).append(first_in.detach() if first_in is not None else None)

    def ran(self, name: str) -> bool:
        return bool(self.outputs.get(name))

    def first_position(self) -> dict[str, int]:
        """Each module's place in completion order at its first call."""
        position: dict[str, int] = {}
        for index, (name, _) in enumerate(self.order):
            position.setdefault(name, index)
        return position

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def hf_module_roles(hf_model: Any, model: Any) -> dict[str, str]:
    """Archon module -> HF module, by role, from the HF model's anatomy as the analysis
    reads it: each layer's attention, feed-forward (``moe`` for an MoE block) and norms
    (their probed roles), the attention's q/k norms, the embedding, the embedding norm, the
    final norm and the LM head. Only Archon modules the model has are named."""
    from skill.analysis import modules as mt
    from skill.analysis import probes

    config = hf_model.config
    anatomy = mt.anatomy(hf_model, config.num_hidden_layers)
    archon = dict(model.named_modules())
    names = {id(module): name for name, module in hf_model.named_modules()}
    roles: dict[str, str] = {}

    def pair(archon_name: str, hf_module: Any) -> None:
        hf_name = names.get(id(hf_module)) if hf_module is not None else None
        if hf_name and archon_name in archon:
            roles[archon_name] = hf_name

    pair("tok_embeddings", anatomy.embedding)
    pair("norm", anatomy.final_norm)
    pair("output", anatomy.lm_head)
    before = probes.modules_before_first_layer(hf_model, anatomy, config)
    embedding_norms = [n for n in before if mt.is_norm(hf_model.get_submodule(n))]
    if len(embedding_norms) == 1:
        roles["embedding_norm"] = embedding_norms[0]
    _, block_roles = probes.probe_block_norms(hf_model, anatomy, config)
    for index, layer in enumerate(anatomy.layers):
        prefix = f"layers.{index}"
        children = dict(layer.named_children())
        attention = layer.get_submodule(anatomy.attention_name) if anatomy.attention_name else None
        pair(f"{prefix}.attention", attention)
        ffn = children.get(anatomy.ffn_name or "")
        pair(f"{prefix}.moe" if f"{prefix}.moe" in archon else f"{prefix}.feed_forward", ffn)
        for hf_norm, role in block_roles.items():
            if role in BLOCK_NORM_NAMES:
                pair(f"{prefix}.{BLOCK_NORM_NAMES[role]}", children.get(hf_norm))
        if attention is not None:
            q_norm, k_norm = mt.qk_norms(attention)
            pair(f"{prefix}.attention.q_norm", q_norm[1] if q_norm else None)
            pair(f"{prefix}.attention.k_norm", k_norm[1] if k_norm else None)
    return roles


def _match_parameterless(
    model: Any, hf_model: Any, matches: dict[str, str], archon: _Recorder, hf: _Recorder
) -> dict[str, str]:
    """Archon modules without parameters and without a role -> HF modules, by where they run.

    The HF partner runs after the HF partner of the last matched Archon module that
    finished before it and before the HF partner of the next one, lies inside the HF
    partner of its nearest matched ancestor, has no parameters either, is a norm exactly
    when the Archon module is one, has the same output shape, and is not the partner of
    another module (by key or role); the first such module.
    """
    from skill.analysis.modules import is_norm

    archon_modules = dict(model.named_modules())
    hf_modules = dict(hf_model.named_modules())
    hf_position = hf.first_position()
    hf_order = [name for name, call in hf.order if call == 0]
    archon_order = [name for name, call in archon.order if call == 0]
    taken = set(matches.values())
    found: dict[str, str] = {}
    for i, name in enumerate(archon_order):
        module = archon_modules[name]
        if name in matches or _has_parameters(module):
            continue
        before = next((n for n in reversed(archon_order[:i]) if n in matches), None)
        after = next((n for n in archon_order[i + 1 :] if n in matches), None)
        low = hf_position.get(matches[before], -1) if before is not None else -1
        high = hf_position.get(matches[after], len(hf.order)) if after is not None else len(hf.order)
        ancestor = _parent(name)
        while ancestor and ancestor not in matches:
            ancestor = _parent(ancestor)
        scope = matches.get(ancestor, "")
        shape = archon.outputs[name][0].shape
        for hf_name in hf_order:
            if not low < hf_position[hf_name] < high:
                continue
            candidate = hf_modules[hf_name]
            if (
                (not scope or hf_name.startswith(scope + "."))
                and hf_name not in taken
                and not _has_parameters(candidate)
                and is_norm(candidate) == is_norm(module)
                and hf.outputs[hf_name][0].shape == shape
            ):
                found[name] = hf_name
                taken.add(hf_name)
                break
    return found


def _aligned(a: Any, h: Any) -> Any | None:
    """``h`` laid out as ``a``: as it is, or with its heads and sequence axes swapped
    (``[b, h, s, d]`` against ``[b, s, h, d]``); ``None`` when neither fits."""
    if a.shape == h.shape:
        return h
    if a.dim() == 4 and h.dim() == 4 and a.shape == h.transpose(1, 2).shape:
        return h.transpose(1, 2)
    return None


def _max_abs_diff(a: Any, h: Any) -> float:
    return float((a.float() - h.float()).abs().max()) if a.numel() else 0.0


def compare_calls(
    archon: _Recorder, hf: _Recorder, pairs: dict[str, str], how: dict[str, MatchedBy]
) -> tuple[list[ModuleDiff], list[str]]:
    """Every call of every paired module, in Archon completion order; and the pairs whose
    outputs cannot be aligned. Calls are paired from the last: a norm HF also runs on the
    embeddings pairs its final call with the Archon final norm's."""
    import torch

    compared: list[ModuleDiff] = []
    not_compared: list[str] = []
    for name, call in archon.order:
        hf_name = pairs.get(name)
        if hf_name is None or not hf.ran(hf_name):
            continue
        hf_call = call + len(hf.outputs[hf_name]) - len(archon.outputs[name])
        if hf_call < 0:
            continue
        a = archon.outputs[name][call]
        h = _aligned(a, hf.outputs[hf_name][hf_call])
        if h is None:
            shapes = f"{list(a.shape)} vs {list(hf.outputs[hf_name][hf_call].shape)}"
            not_compared.append(f"{name} <-> {hf_name}: outputs {shapes}")
            continue
        a_in, h_in = archon.inputs[name][call], hf.inputs[hf_name][hf_call]
        in_diff = None
        if a_in is not None and h_in is not None and a_in.is_floating_point():
            h_in = _aligned(a_in, h_in)
            in_diff = _max_abs_diff(a_in, h_in) if h_in is not None else None
        compared.append(
            ModuleDiff(
                archon_module=name,
                hf_module=hf_name,
                max_abs_diff=_max_abs_diff(a, h),
                shape=list(a.shape),
                within_tolerance=bool(torch.allclose(a.float(), h.float(), rtol=RTOL, atol=ATOL)),
                input_max_abs_diff=in_diff,
                matched_by=how.get(name, "adapter_map"),
                call=call,
                hf_call=hf_call,
            )
        )
    return compared, not_compared


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
    by_role = {a: h for a, h in hf_module_roles(hf_model, model).items() if a not in matches}

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
    paired = {**matches, **by_role}
    by_order = _match_parameterless(model, hf_model, paired, archon_rec, hf_rec)
    how: dict[str, MatchedBy] = {
        **dict.fromkeys(by_order, "execution_order"),
        **dict.fromkeys(by_role, "module_role"),
        **dict.fromkeys(matches, "adapter_map"),
    }
    compared, not_compared = compare_calls(archon_rec, hf_rec, {**by_order, **paired}, how)
    compared = _mark_absorbed(compared)
    logits_diff = float((logits.float() - hf_logits.float()).abs().max())
    logits_ok = bool(torch.allclose(logits, hf_logits, rtol=RTOL, atol=ATOL))
    lasting = [c for c in compared if not c.within_tolerance and not c.absorbed]
    diverged = not logits_ok or bool(lasting)
    unmatched = sorted(
        n for n, m in model.named_modules() if n and n not in matches and list(m.parameters(recurse=False))
    )
    return LocateDivergenceResult(
        model_name=model_name,
        model_type=case.model_type,
        diverged=diverged,
        first_divergence=_first_divergence(compared) if diverged else None,
        logits_max_abs_diff=logits_diff,
        compared=compared,
        unmatched_archon_modules=unmatched,
        not_compared=not_compared,
        config_overrides=case.config_overrides,
    )


def _mark_absorbed(compared: list[ModuleDiff]) -> list[ModuleDiff]:
    """Mark each differing module whose difference the next module absorbs.

    A module boundary can sit at a different place on the two sides (HF may scale the
    embedding inside its embedding module, Archon right after it); the difference then
    vanishes at the next module, so it is not where the port went wrong. "Next" skips the
    module's siblings: they run on their own inputs (``w3`` next to an activation), so
    only what runs after it outside its parent, or the parent itself, can absorb it.
    """
    marked = []
    for i, diff in enumerate(compared):
        if not diff.within_tolerance:
            parent = _parent(diff.archon_module)
            following = next((c for c in compared[i + 1 :] if _parent(c.archon_module) != parent), None)
            if following is not None and following.within_tolerance:
                diff = diff.model_copy(update={"absorbed": True})
        marked.append(diff)
    return marked


def _first_divergence(compared: list[ModuleDiff]) -> ModuleDiff | None:
    """The first differing module whose difference lasts (else the first differing one), or
    the parent whose own code feeds it a different input."""
    by_name = {c.archon_module: c for c in compared if c.call == 0}
    first = next((c for c in compared if not c.within_tolerance and not c.absorbed), None)
    first = first or next((c for c in compared if not c.within_tolerance), None)
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
