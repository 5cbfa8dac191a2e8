"""Step 2: copy a reference package under a new name with every identifier renamed."""

from __future__ import annotations

import logging

from pydantic import Field, field_validator

from skill.analysis.reference import REFERENCES as _REFERENCE_TYPES
from skill.codemod import ModelNames, StagedTree, format_python, validate_model_name
from skill.codemod.cst import Document, rename_identifiers, set_docstring
from skill.porting.common import PackageLayout, PackageRequest, StepResult, staged, write_if_changed

logger = logging.getLogger(__name__)

# The hand-written packages every port is copied from: never written over by a step.
REFERENCES = tuple(_REFERENCE_TYPES)
# How a reference's prose names its family, where that is not its class-name prefix.
DISPLAY_NAMES = {"deepseek_v3": "DeepSeek-V3", "qwen3_5": "Qwen3.5"}
# A reference whose classes are named otherwise than its package's camel case (AReaL's
# Qwen3_5Model, not Qwen35Model).
CLASS_PREFIXES = {"qwen3_5": "Qwen3_5"}


def refuse_reference(model_name: str) -> None:
    """Raise ``ValueError`` when ``model_name`` is a reference package (overwrite or not)."""
    if model_name in REFERENCES:
        raise ValueError(
            f"archon_models/{model_name}/ is a hand-written reference package that every port is copied from; "
            "it is never replaced, --overwrite included. Pick another package name (--name / model_name)."
        )


class CopyReferenceRequest(PackageRequest):
    reference: str = Field(
        description=(
            "reference package to copy: 'qwen2' (dense, a QK norm included: an edit adds it), 'qwen3' (MoE), "
            "'deepseek_v3' (MLA) or 'qwen3_5' (Gated DeltaNet layers beside attention, a hybrid); the analysis "
            "names it as `reference`"
        )
    )
    model_types: list[str] = Field(
        default_factory=list, description="HF model_type strings the package handles (default: [model_name])"
    )
    overwrite: bool = Field(default=False, description="replace an existing package of that name")

    @field_validator("reference")
    @classmethod
    def _valid_reference(cls, value: str) -> str:
        return validate_model_name(value)


class CopyReferenceResult(StepResult):
    package_dir: str
    reference: str
    files: list[str] = Field(description="files of the new package")


def copy_reference(request: CopyReferenceRequest) -> CopyReferenceResult:
    """Copy a reference package (qwen2, qwen3 or deepseek_v3) to archon_models/<model_name>/, renaming
    every identifier and module path (Qwen2Model -> MistralModel, parallelize_qwen2 ->
    parallelize_mistral, QWEN2_SPEC -> MISTRAL_SPEC). Refuses an existing, different
    package unless overwrite is set; an identical one is left as it is."""
    with staged(request.workspace) as tree:
        return apply_copy_reference(tree, request)


def renamed_reference_files(tree: StagedTree, reference: str, model_name: str) -> dict[str, str]:
    """The reference's ``.py`` files, renamed, keyed by their path in the new package."""
    source_dir = f"archon_models/{reference}"
    files = [f for f in tree.list_files(source_dir) if f.endswith(".py")]
    if not files:
        raise FileNotFoundError(
            f"reference package {source_dir}/ not found or empty; references are {', '.join(REFERENCES)}"
        )
    old, new = ModelNames.from_name(reference), ModelNames.from_name(model_name)
    if reference in CLASS_PREFIXES:
        old = old.model_copy(update={"camel": CLASS_PREFIXES[reference]})
    pairs = old.rename_pairs(new)
    if reference in DISPLAY_NAMES:
        # Prose names the reference's family as its authors write it ("DeepSeek-V3").
        pairs.append((DISPLAY_NAMES[reference], new.camel))
    target_dir = PackageLayout(names=new).package_dir
    result: dict[str, Document] = {}
    for path in files:
        text = tree.read_text(path) or ""
        result[target_dir + path[len(source_dir) :]] = rename_identifiers(Document(text), pairs)
    # The reference's package docstring describes the reference; the copy gets its own.
    init = f"{target_dir}/__init__.py"
    if init in result:
        result[init] = set_docstring(
            result[init], None, f"The {new.camel} Archon package: model, args and state-dict adapter of the family."
        )
    # Renamed identifiers change line lengths: the copy is formatted as it will be written.
    return {path: format_python(doc.code, path) for path, doc in result.items()}


def apply_copy_reference(tree: StagedTree, request: CopyReferenceRequest) -> CopyReferenceResult:
    layout = PackageLayout.for_name(request.model_name)
    refuse_reference(request.model_name)
    if request.model_name == request.reference:
        raise ValueError(f"model_name {request.model_name!r} is the reference itself; pick the new family's name.")
    new_files = renamed_reference_files(tree, request.reference, request.model_name)
    existing = tree.list_files(layout.package_dir)
    existing_py = {f: tree.read_text(f) for f in existing if f.endswith(".py")}
    if existing and not request.overwrite:
        if existing_py == new_files and len(existing) == len(existing_py):
            logger.info("%s already holds the renamed %s reference", layout.package_dir, request.reference)
            return CopyReferenceResult(
                package_dir=layout.package_dir, reference=request.reference, files=sorted(new_files)
            )
        raise FileExistsError(
            f"{layout.package_dir}/ already exists and differs from a fresh copy of {request.reference}; "
            "pass overwrite=True (CLI: --overwrite) to replace it, or pick another model name."
        )
    changed: list[str] = []
    for path in existing:
        if path not in new_files:
            tree.delete(path)
            changed.append(path)
    for path, text in sorted(new_files.items()):
        write_if_changed(tree, path, text, changed)
    logger.info("copied %s -> %s (%d files)", request.reference, layout.package_dir, len(new_files))
    return CopyReferenceResult(
        package_dir=layout.package_dir,
        reference=request.reference,
        files=sorted(new_files),
        changed_files=sorted(changed),
    )
