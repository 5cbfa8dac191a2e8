"""The one input every harness stage takes: which model type, how tiny, which seed."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ModelCase(BaseModel):
    """A model type to prove, as a tiny seeded instance.

    The harness is generic: everything model-specific comes from the Archon registry
    (``archon_models.get_model_spec(model_type)``) and from the transformers config
    class of ``model_type``, shrunk by ``skill.tiny_model``. A per-model test file is
    therefore a list of cases and one call per stage.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model_type: str = Field(description="HF model_type, registered in archon_models.")
    config_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Config attributes set on top of the tiny config (e.g. tie_word_embeddings).",
    )
    source: str | None = Field(
        default=None,
        description="A checkpoint folder whose own code (auto_map) defines the family; the HF side is built "
        "from it (and its weights are compared too). None: the installed transformers' config class.",
    )
    trust_remote_code: bool = Field(default=False, description="Run the source folder's configuration/modeling code.")
    seed: int = Field(default=0, description="Seeds the tiny weights and the random tokens.")
    doc_lens: tuple[int, ...] = Field(
        default=(7, 13, 4),
        description="Lengths of the packed documents used by the parity and checkpoint stages.",
    )
    name: str | None = Field(default=None, description="Test id; defaults to model_type.")

    @field_validator("model_type")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model_type is empty; pass the HF model_type, e.g. 'qwen3'.")
        return value

    @field_validator("doc_lens")
    @classmethod
    def _distinct_documents(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        # Documents of equal length can hide an off-by-one in the boundaries, and
        # fewer than three cannot show a middle document leaking both ways.
        if len(value) < 3 or len(set(value)) != len(value) or min(value) < 2:
            raise ValueError(
                f"doc_lens={value}: give at least three documents of different lengths, "
                "each of at least 2 tokens, e.g. (7, 13, 4)."
            )
        return value

    @property
    def id(self) -> str:
        """A readable pytest id."""
        return self.name or self.model_type
