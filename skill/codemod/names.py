"""Model-name validation and the identifier spellings derived from a name."""

from __future__ import annotations

import keyword
import re

from pydantic import BaseModel

# Names already taken by archon_models' shared modules; a package may not shadow them.
RESERVED_NAMES = frozenset(
    {
        "activation_checkpoint",
        "attention",
        "base",
        "compile",
        "expert_parallel",
        "model_spec",
        "moe",
        "moe_weight_converter",
        "parallel_dims",
        "pipeline_parallel",
        "ulysses",
        "utils",
        "tests",
    }
)

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
# Longest package name: its files (``test_<name>.py``, ``<name>_spec``) must fit the
# 255-byte file-name limit of common file systems with room to spare.
MAX_NAME_LENGTH = 100


def validate_model_name(name: str) -> str:
    """Return ``name`` if it can be a package directly under ``archon_models/``.

    Raises ``ValueError`` naming the problem and the fix otherwise: the name must be
    a lowercase Python identifier (no path separators, no dots), not a keyword and not
    one of archon_models' shared modules.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("Model name is empty; pass a lowercase identifier such as 'mistral'.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"Model name is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}. Pick a shorter name."
        )
    if "/" in name or "\\" in name or name.startswith(".") or ".." in name:
        raise ValueError(
            f"Model name {name!r} would leave archon_models/; pass a bare package name "
            "such as 'mistral' (no path separators or dots)."
        )
    if not _NAME_RE.match(name) or not name.isidentifier():
        suggestion = re.sub(r"[^a-z0-9_]", "_", name.lower()).strip("_") or "my_model"
        if suggestion[0].isdigit():
            suggestion = f"m_{suggestion}"
        raise ValueError(
            f"Model name {name!r} is not a lowercase Python identifier "
            f"(letters, digits, underscores, starting with a letter); try {suggestion!r}."
        )
    if keyword.iskeyword(name):
        raise ValueError(f"Model name {name!r} is a Python keyword; pick another, e.g. {name + '_model'!r}.")
    if name in RESERVED_NAMES:
        raise ValueError(
            f"Model name {name!r} is a shared module of archon_models; pick another, e.g. {name + '_model'!r}."
        )
    return name


class ModelNames(BaseModel):
    """The spellings of one model name used in identifiers.

    ``mistral`` gives package ``mistral``, class prefix ``Mistral`` (``MistralModel``)
    and constant prefix ``MISTRAL`` (``MISTRAL_SPEC``).
    """

    package: str
    camel: str
    upper: str

    @classmethod
    def from_name(cls, name: str) -> ModelNames:
        name = validate_model_name(name)
        camel = "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)
        return cls(package=name, camel=camel, upper=name.upper())

    def rename_pairs(self, new: ModelNames) -> list[tuple[str, str]]:
        """(old, new) substring pairs that turn this name's identifiers into ``new``'s."""
        return [(self.camel, new.camel), (self.upper, new.upper), (self.package, new.package)]
