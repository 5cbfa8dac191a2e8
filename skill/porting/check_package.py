"""The guide's "common mistakes", each an automatic check on a package's source."""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Callable

from pydantic import BaseModel, Field

from skill.codemod import StagedTree, Workspace
from skill.codemod.cst import CodemodError, Document, read_dict_literal
from skill.porting.common import HAND_EDIT_MARKER, PackageLayout, PackageRequest
from skill.porting.edit_adapter_map import (
    FUSED_EXPERTS_MAP,
    FUSED_MAP,
    MAP_TARGETS,
    RUNTIME_BUFFERS,
    rotary_buffer_keys,
)
from skill.porting.hf_source import checkpoint_keys, generalised_keys, load_config
from skill.porting.register_spec import ARCHON_INIT, import_line_for, spec_model_types
from skill.porting.tp_plan import PlanTraceError, trace_tp_plan

logger = logging.getLogger(__name__)

PACKAGE_FILES = (
    "__init__.py",
    "spec.py",
    "model/__init__.py",
    "model/args.py",
    "model/model.py",
    "model/rope.py",
    "model/state_dict_adapter.py",
    "infra/__init__.py",
    "infra/parallelize.py",
)


class PackageCheck(BaseModel):
    name: str
    passed: bool
    detail: str = ""


class CheckPackageRequest(PackageRequest):
    source: str | None = Field(
        default=None,
        description="model_type or config path of the family, for the checks against its checkpoint "
        "keys and config (default: the package's model_types)",
    )
    model_types: list[str] = Field(
        default_factory=list, description="model_type variants the package must register (default: [model_name])"
    )
    trust_remote_code: bool = Field(default=False, description="the source folder's own code builds the HF side")


class CheckPackageResult(BaseModel):
    package_dir: str
    passed: bool
    checks: list[PackageCheck]

    @property
    def failures(self) -> list[PackageCheck]:
        return [c for c in self.checks if not c.passed]


def _runtime_buffers(source: str, trust_remote_code: bool) -> list[str]:
    """Where the family's released checkpoints may hold a layer's rotary table (the analysis'
    layout); the llama layout's name for a source the analysis cannot read."""
    from skill.porting.plan import report_for

    try:
        report = report_for(source, trust_remote_code)
    except Exception:  # an unknown family: the other checks report it
        return list(RUNTIME_BUFFERS)
    return rotary_buffer_keys(report)


def check_package(request: CheckPackageRequest) -> CheckPackageResult:
    """Check archon_models/<model_name>/ for the porting guide's common mistakes: missing
    files, HF keys with no mapping, from_hf_config reading attributes the config lacks,
    runtime buffers without a None entry, MoE experts without 3D<->2D conversion, a TP plan
    that does not match QK norm or has an entry matching no module of the model (built on
    the meta device), a missing import line or model_type variant, print(), a hand edit
    still marked as needed."""
    tree = StagedTree(Workspace(request.workspace))
    return run_checks(tree, request)


def run_checks(tree: StagedTree, request: CheckPackageRequest) -> CheckPackageResult:
    layout = PackageLayout.for_name(request.model_name)
    sources = {rel: tree.read_text(layout.file(rel)) for rel in PACKAGE_FILES}
    checks: list[PackageCheck] = []
    missing = [layout.file(rel) for rel, text in sources.items() if text is None]
    checks.append(_check("files", not missing, f"missing {missing}" if missing else f"{len(PACKAGE_FILES)} files"))
    if missing and sources["model/model.py"] is None:
        return CheckPackageResult(package_dir=layout.package_dir, passed=False, checks=checks)
    spec_types = _spec_types(sources["spec.py"] or "")
    model_types = request.model_types or [request.model_name]
    source = request.source or (model_types[0] if model_types else request.model_name)
    hf_map = _from_hf_map(sources["model/state_dict_adapter.py"] or "")
    fused_map = _fused_map(sources["model/state_dict_adapter.py"] or "")
    keys: list[str] = []
    concrete: list[str] = []
    try:
        concrete = list(checkpoint_keys(source, request.trust_remote_code))
        keys = generalised_keys(concrete)
    except Exception as e:  # an unknown family: report it as a failed check, not a crash
        checks.append(_check("checkpoint_keys", False, f"cannot build a tiny {source!r} checkpoint: {e}"))
    if keys:
        mapped = _template_matcher([*hf_map, *fused_map, "lm_head.weight"])
        unmapped = generalised_keys(k for k in concrete if not mapped(k))
        checks.append(
            _check("hf_keys_mapped", not unmapped, f"unmapped HF keys {unmapped}" if unmapped else f"{len(keys)} keys")
        )
    buffers = _runtime_buffers(source, request.trust_remote_code)
    drops = [k for k in buffers if hf_map.get(k, "missing") is not None]
    checks.append(
        _check(
            "runtime_buffers_dropped",
            not drops,
            f"no None entry for {drops}" if drops else ("inv_freq dropped" if buffers else "no rotary table"),
        )
    )
    checks.append(_check_config_attrs(sources["model/args.py"] or "", source, request.trust_remote_code))
    has_experts = any(".experts.{}." in k for k in keys)
    adapter_text = sources["model/state_dict_adapter.py"] or ""
    moe_ok = not has_experts or "MoEWeightConverter" in adapter_text or "experts" in adapter_text
    checks.append(
        _check("moe_conversion", moe_ok, "" if moe_ok else "per-expert HF keys but the adapter converts no experts")
    )
    model_text = sources["model/model.py"] or ""
    if _refuses_tp(model_text):
        no_plan = "no TP plan: the model refuses TP by name (unsupported_parallelisms)"
        checks.append(_check("tp_plan_qk_norm", True, no_plan))
        if not missing:
            checks.append(_check("tp_plan_modules", True, no_plan))
    else:
        checks.append(_check_tp_plan(model_text, sources["infra/parallelize.py"] or ""))
        if not missing:
            checks.append(_check_tp_plan_modules(tree, request.model_name, [source, *model_types], layout))
    init_text = tree.read_text(ARCHON_INIT) or ""
    line_ok = _has_import(init_text, layout.names.package)
    checks.append(
        _check(
            "import_line", line_ok, "" if line_ok else f"add `{import_line_for(layout.names.package)}` to {ARCHON_INIT}"
        )
    )
    missing_types = sorted(set(model_types) - set(spec_types))
    checks.append(
        _check(
            "model_types",
            not missing_types,
            f"spec.py lacks {missing_types} (has {sorted(spec_types)})" if missing_types else str(sorted(spec_types)),
        )
    )
    prints = [f"{rel}:{line}" for rel, text in sources.items() if text for line in _print_calls(text)]
    checks.append(_check("logging_not_print", not prints, f"print() at {prints}" if prints else ""))
    checks.append(_check_hand_edits(sources, layout))
    return CheckPackageResult(package_dir=layout.package_dir, passed=all(c.passed for c in checks), checks=checks)


def _check(name: str, passed: bool, detail: str = "") -> PackageCheck:
    return PackageCheck(name=name, passed=passed, detail=detail)


def _template_matcher(templates: list[str]) -> Callable[[str], bool]:
    """Whether a concrete checkpoint key is one of ``templates``, where ``{}`` stands for an index
    and a literal number for itself (``transformer.h.{}.ffn.0.weight``: an ``nn.Sequential``
    position kept literal by the map, which matches ``transformer.h.3.ffn.0.weight`` only).
    ``templates`` is never empty: the caller always passes ``lm_head.weight``."""
    pattern = re.compile("|".join(re.escape(t).replace(r"\{\}", r"\d+") for t in templates))
    return lambda key: pattern.fullmatch(key) is not None


def _from_hf_map(adapter_text: str) -> dict[str, str | None]:
    adapter = Document(adapter_text)
    for target in MAP_TARGETS:
        try:
            return read_dict_literal(adapter, target)
        except CodemodError:
            continue
    return {}


def _fused_map(adapter_text: str) -> dict[str, list[str]]:
    """The adapter's ``fused_from_hf_map`` and ``fused_experts_from_hf_map`` literals (fused
    checkpoint key -> its parts), merged; empty when it has neither."""
    try:
        tree = ast.parse(adapter_text)
    except SyntaxError:
        return {}
    merged: dict[str, list[str]] = {}
    names = (FUSED_MAP, FUSED_EXPERTS_MAP)
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(getattr(t, "id", None) in names or getattr(t, "attr", None) in names for t in targets):
                try:
                    value = ast.literal_eval(node.value) if node.value is not None else {}
                except ValueError:
                    continue
                if isinstance(value, dict):
                    merged.update(value)
    return merged


def _spec_types(spec_text: str) -> list[str]:
    return spec_model_types(spec_text) or []


def _has_import(init_text: str, package: str) -> bool:
    try:
        tree = ast.parse(init_text)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in (
            f"archon_models.{package}",
            f"archon_models.{package}.spec",
        ):
            return True
    return False


def _print_calls(text: str) -> list[int]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]


def _guarded_attrs(test: ast.expr) -> set[str]:
    """Attributes an ``if`` test makes sure of: ``getattr(hf_config, "X", ...)`` or
    ``hasattr(hf_config, "X")`` anywhere in it (its body reads ``hf_config.X`` safely)."""
    guarded: set[str] = set()
    for node in ast.walk(test):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "hf_config"
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            guarded.add(node.args[1].value)
    return guarded


def _config_reads(args_text: str) -> set[str]:
    """Attributes read as ``hf_config.X`` (no default) anywhere in args.py, except inside
    the body of an ``if`` whose test reads ``X`` with ``getattr``/``hasattr`` first, or after
    such a read in an ``and``."""
    try:
        tree = ast.parse(args_text)
    except SyntaxError:
        return set()
    reads: set[str] = set()

    def visit(node: ast.AST, guarded: frozenset[str]) -> None:
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "hf_config"
            and isinstance(node.ctx, ast.Load)
            and node.attr not in guarded
        ):
            reads.add(node.attr)
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            # ``hasattr(hf_config, "X") and hf_config.X``: later operands are guarded.
            inner = guarded
            for value in node.values:
                visit(value, inner)
                inner = inner | _guarded_attrs(value)
            return
        if isinstance(node, ast.If):
            visit(node.test, guarded)
            inner = guarded | _guarded_attrs(node.test)
            for statement in node.body:
                visit(statement, inner)
            for statement in node.orelse:
                visit(statement, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, frozenset())
    return reads


def _check_config_attrs(args_text: str, source: str, trust_remote_code: bool = False) -> PackageCheck:
    try:
        config = load_config(source, trust_remote_code)
    except Exception as e:
        return _check("config_attributes", False, f"cannot load the {source!r} config: {e}")
    lacking = sorted(a for a in _config_reads(args_text) if not hasattr(config, a))
    return _check(
        "config_attributes",
        not lacking,
        f"from_hf_config reads {lacking}, which {type(config).__name__} lacks" if lacking else type(config).__name__,
    )


# A model class that names TP among the parallelisms its parallelize refuses (the qwen3_5
# reference's hybrids): it has no TP plan to check.
_REFUSES_TP = re.compile(r"unsupported_parallelisms\b[^=]*=\s*\{[^}]*[\"']tp[\"']\s*:", re.S)


def _refuses_tp(model_text: str) -> bool:
    return _REFUSES_TP.search(model_text) is not None


def _check_tp_plan(model_text: str, parallelize_text: str) -> PackageCheck:
    """``use_local_output=False`` on wq/wk and SequenceParallel on q/k norm iff QK norm.

    Under multi-head latent attention (``wkv_a``) ``q_norm``/``kv_norm`` normalise the
    latents, which every TP rank holds whole: the plan replicates them.
    """
    if "self.wkv_a" in model_text:
        planned = all(f'"attention.{name}": ReplicateParallel()' in parallelize_text for name in ("wkv_a", "kv_norm"))
        return _check(
            "tp_plan_qk_norm",
            planned,
            "multi-head latent attention: latents replicated"
            if planned
            else "multi-head latent attention, but the TP plan does not replicate wkv_a/kv_norm (ReplicateParallel())",
        )
    has_qk_norm = "self.q_norm" in model_text
    plan_norm = '"attention.q_norm"' in parallelize_text or "'attention.q_norm'" in parallelize_text
    # Literally, or per block as the qwen3 reference decides it (``not has_qk_norm``).
    keeps_dtensor = any(f"use_local_output={value}" in parallelize_text for value in ("False", "not has_qk_norm"))
    if has_qk_norm and not (plan_norm and keeps_dtensor):
        return _check(
            "tp_plan_qk_norm",
            False,
            "the model has QK norm but the TP plan lacks use_local_output=False on wq/wk or "
            "SequenceParallel(sequence_dim=2) on q_norm/k_norm",
        )
    if not has_qk_norm and plan_norm:
        return _check("tp_plan_qk_norm", False, "the TP plan shards q_norm/k_norm, which the model does not have")
    return _check("tp_plan_qk_norm", True, "with QK norm" if has_qk_norm else "without QK norm")


def _check_tp_plan_modules(
    tree: StagedTree, model_name: str, sources: list[str], layout: PackageLayout
) -> PackageCheck:
    """Every TP plan key resolves to a module of the model it is applied to.

    torch's ``parallelize_module`` skips an unresolved key with a warning, so a plan entry
    for a module the model lacks (``attention.q_norm`` without QK norm) otherwise passes
    every stage.
    """
    try:
        trace = trace_tp_plan(tree, model_name, sources)
    except PlanTraceError as e:
        return _check(
            "tp_plan_modules",
            False,
            f"cannot build {layout.model_class} on the meta device and trace {layout.parallelize_fn}: {e}. "
            f"Fix {layout.model} / {layout.parallelize} until the package imports and builds.",
        )
    if trace.unmatched:
        listed = "; ".join(
            f"{e.level}-level plan entry {e.key!r} (applied to {e.applied_to}, traced on {e.probe}) matches no "
            f"module; {'the block' if e.level == 'layer' else 'it'} has {', '.join(e.children) or 'no children'}"
            for e in trace.unmatched
        )
        return _check(
            "tp_plan_modules",
            False,
            f"{listed}. Fix: re-run write_parallelize for this family, or remove the entry from {layout.parallelize} "
            "(or add the module to model.py if the family has it); torch skips such entries silently.",
        )
    detail = f"{trace.matched_keys} plan keys match modules, traced on {len(trace.probes)} models"
    if trace.skipped_probes:
        detail += f" (not traced: {'; '.join(trace.skipped_probes)})"
    return _check("tp_plan_modules", True, detail)


def _check_hand_edits(sources: dict[str, str | None], layout: PackageLayout) -> PackageCheck:
    """No ``# archon-port: hand edit needed: <feature>`` marker is left in the package."""
    left = [
        f"{layout.file(rel)}:{number} ({line.split(HAND_EDIT_MARKER, 1)[1].strip()})"
        for rel, text in sources.items()
        if text
        for number, line in enumerate(text.splitlines(), start=1)
        if HAND_EDIT_MARKER in line
    ]
    if left:
        return _check(
            "hand_edits_done",
            False,
            f"hand edits still marked as needed at {', '.join(left)}: write each feature there and remove "
            "its marker (see SKILL.md § Porting by hand)",
        )
    return _check("hand_edits_done", True)
