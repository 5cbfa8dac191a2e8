"""Request/result bases and the package layout shared by every porting step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from skill.codemod import ModelNames, StagedTree, Workspace, format_python, transaction, validate_model_name

# Left by edit_args / edit_model (allow_unsupported=True) where a hand edit goes, followed by
# the feature's name; check_package fails while one is left.
HAND_EDIT_MARKER = "# archon-port: hand edit needed:"


class PackageRequest(BaseModel):
    """A request about one package ``archon_models/<model_name>/`` of a workspace."""

    model_config = ConfigDict(extra="forbid")

    model_name: str = Field(description="package name under archon_models/, e.g. 'mistral'")
    workspace: Path | None = Field(
        default=None, description="project root holding archon_models/ (default: the current project)"
    )

    @field_validator("model_name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        return validate_model_name(value)


class SourceRequest(PackageRequest):
    """A step that reads the family's analysis: the package plus the family's source."""

    source: str = Field(description="model_type, checkpoint folder or config.json path of the family")
    trust_remote_code: bool = Field(
        default=False,
        description="the source is a folder whose config.json has auto_map: run its configuration_*.py / "
        "modeling_*.py (read them first); refused otherwise",
    )


class StepResult(BaseModel):
    """What a step changed: workspace-relative paths whose content it wrote or removed."""

    changed_files: list[str] = Field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.changed_files)


class PackageLayout(BaseModel):
    """Workspace-relative paths of one model package and its test file."""

    names: ModelNames

    @classmethod
    def for_name(cls, model_name: str) -> PackageLayout:
        return cls(names=ModelNames.from_name(model_name))

    @property
    def package_dir(self) -> str:
        return f"archon_models/{self.names.package}"

    def file(self, relative: str) -> str:
        return f"{self.package_dir}/{relative}"

    @property
    def args(self) -> str:
        return self.file("model/args.py")

    @property
    def model(self) -> str:
        return self.file("model/model.py")

    @property
    def rope(self) -> str:
        return self.file("model/rope.py")

    @property
    def adapter(self) -> str:
        return self.file("model/state_dict_adapter.py")

    @property
    def parallelize(self) -> str:
        return self.file("infra/parallelize.py")

    @property
    def spec(self) -> str:
        return self.file("spec.py")

    @property
    def test_file(self) -> str:
        return f"tests/archon/test_{self.names.package}.py"

    @property
    def module(self) -> str:
        return f"archon_models.{self.names.package}"

    # Class and function names every package defines (the reference's, renamed).
    @property
    def model_class(self) -> str:
        return f"{self.names.camel}Model"

    @property
    def args_class(self) -> str:
        return f"{self.names.camel}ModelArgs"

    @property
    def adapter_class(self) -> str:
        return f"{self.names.camel}StateDictAdapter"

    @property
    def parallelize_fn(self) -> str:
        return f"parallelize_{self.names.package}"

    @property
    def pipelining_fn(self) -> str:
        """The pipelining function ``infra/parallelize.py`` defines for a model with modules
        of its own around the blocks (the spec's ``pipelining_fn``; else ``pipeline_llm``)."""
        return f"pipeline_{self.names.package}"

    @property
    def spec_constant(self) -> str:
        return f"{self.names.upper}_SPEC"


@contextlib.contextmanager
def staged(workspace: Path | None, tree: StagedTree | None = None) -> Iterator[StagedTree]:
    """Reuse the caller's staged tree, or open a transaction over ``workspace``."""
    if tree is not None:
        yield tree
        return
    with transaction(Workspace(workspace)) as new_tree:
        yield new_tree


def require_package(tree: StagedTree, layout: PackageLayout) -> None:
    """Raise ``FileNotFoundError`` naming the fix when the package does not exist (so no step
    creates files for a package nobody ported)."""
    if not tree.exists(layout.model):
        package = layout.names.package
        raise FileNotFoundError(
            f"{layout.package_dir}/ does not exist; port it first: `archon-port add <model_type> --name {package}` "
            f"(or copy_reference with model_name={package!r}). Nothing was written."
        )


def require_file(tree: StagedTree, path: str, hint: str) -> str:
    """The text of ``path`` or a ``FileNotFoundError`` that says which step creates it."""
    text = tree.read_text(path)
    if text is None:
        raise FileNotFoundError(f"{path} does not exist; {hint}")
    return text


def write_if_changed(tree: StagedTree, path: str, text: str, changed: list[str]) -> None:
    """Stage ``text`` at ``path`` (a Python file formatted as ``ruff format`` would, so
    generated code passes the same gates as hand-written code) and note the path when it
    differs from the staged state."""
    if path.endswith(".py"):
        text = format_python(text, path)
    if tree.read_text(path) != text:
        tree.write_text(path, text)
        if path not in changed:
            changed.append(path)
