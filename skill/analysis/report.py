"""The analyser's input and output models (JSON-serialisable, stable order)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from skill.features import Checklist, FeatureDelta, HandEditPlace, is_empty

UNMAPPED = "unmapped"


class AnalyzeInput(BaseModel):
    """What to analyse.

    ``source`` is a model_type of the installed transformers (``"mistral"``), a folder
    with a ``config.json`` (optionally safetensors weights and remote-code
    ``modeling_*.py``), or a path to a ``config.json``. Nothing is downloaded.
    """

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="model_type, checkpoint folder, or config.json path")
    trust_remote_code: bool = Field(
        False,
        description="execute the folder's configuration_*.py / modeling_*.py (read them first); transformers "
        "imports them through its modules cache (HF_MODULES_CACHE), the one place outside a temp dir it writes",
    )


class ConfigField(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    value: Any = Field(description="the config's value (JSON)")
    archon_field: str = Field(UNMAPPED, description="the Archon args field it maps to, or 'unmapped'")


class KeyShape(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str
    shape: list[int]


class CheckpointKeys(BaseModel):
    """Keys and shapes as ``save_pretrained`` writes them (tiny instance), by part."""

    layer_prefix: str = Field(description="key prefix of layer 0, e.g. 'model.layers.0.'")
    top_level: list[KeyShape] = Field(description="keys outside the layer stack")
    layer0: list[KeyShape] = Field(description="keys of layer 0")
    n_keys: int = Field(description="all keys of the tiny checkpoint")
    tiny_sizes: dict[str, int] = Field(description="sizes of the tiny config the shapes come from")
    module_map: dict[str, str] = Field(
        default_factory=dict,
        description="HF module ({} for the layer index) -> Archon module, found by structure; block norms and MoE "
        "blocks are named elsewhere",
    )
    fused_modules: dict[str, list[str]] = Field(
        default_factory=dict, description="HF module that stacks several Archon projections -> those, in order"
    )
    from_files: list[KeyShape] = Field(
        default_factory=list, description="layer-0 and top-level keys of the folder's own safetensors, if any"
    )
    top_modules: dict[str, str] = Field(
        default_factory=dict,
        description="top-level module path -> Archon module (tok_embeddings, norm, output), from the module tree",
    )
    ignored_unexpected: list[str] = Field(
        default_factory=list,
        # Left out of the serialised report while empty: the reports of families without one read as before.
        exclude_if=is_empty,
        description="checkpoint keys ({} for each index) transformers' load drops where the model has no "
        "parameter for them (the family's _keys_to_ignore_on_load_unexpected, after its conversion mapping): "
        "held by some layers only, so a released checkpoint's copies on the other layers are dropped",
    )
    load_ignore_patterns: list[str] = Field(
        default_factory=list,
        # Left out of the serialised report while empty: the reports of families without one read as before.
        exclude_if=is_empty,
        description="the family's _keys_to_ignore_on_load_unexpected (regular expressions, the model instance's, "
        "its submodels' included): a checkpoint key that matches one and that the model has no parameter for is "
        "dropped by transformers' load without a word (legacy buffers such as GPT-NeoX's attention.bias, "
        "multi-token-prediction modules)",
    )


class ArchitectureReport(BaseModel):
    """Step 1 of the playbook: everything a port needs to know about a family."""

    model_type: str
    config_class: str
    source_kind: str = Field(description="model_type, folder or config_file")
    variant_types: list[str] = Field(description="model types one package should cover (dense/_moe, text)")
    config_fields: list[ConfigField]
    checklist: Checklist
    checkpoint: CheckpointKeys
    reference: str = Field(description="nearest hand-written reference: qwen2 or qwen3")
    deltas: list[FeatureDelta] = Field(description="features that differ from the reference, in Feature order")
    unsupported: list[str] = Field(description="features no reference or edit covers yet, named plainly")
    hand_edit_places: dict[str, HandEditPlace] = Field(
        default_factory=dict,
        # Left out of the serialised report while empty: the reports (and recorded sessions) of
        # families without one read as before.
        exclude_if=is_empty,
        description="an unsupported feature (its name after 'unsupported: ') -> where its hand edit goes in the "
        "Archon module contract, measured on the HF model; a feature missing here is placed by its name",
    )
    evidence: list[str] = Field(default_factory=list, description="how detections were made, where sources disagree")
    seconds: float = Field(0.0, json_schema_extra={"volatile": True}, description="analysis time after imports")

    def checklist_rows(self) -> list[tuple[str, str, str]]:
        """(section, item, value) rows for a readable table."""
        rows: list[tuple[str, str, str]] = []
        data = self.checklist.model_dump(mode="json")
        for section in ("attention", "ffn", "moe", "positions", "norm", "scalars"):
            values = data.get(section)
            if values is None:
                rows.append((section, "-", "none"))
                continue
            for item, value in values.items():
                rows.append((section, item, _short(value)))
        for name in data.get("other", []):
            rows.append(("other", "-", name))
        return rows


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        text = ", ".join(str(v) for v in value)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(value)
