"""What a feature module is: one feature the engine ports, owned by one module.

A detector that measures a fact outside the fixed vocabulary names it (an ``other`` entry of
the checklist, so the family is refused by name) and keys it with what it measured
(:class:`skill.features.NamedFact`). A feature module claims facts of one key and ports
them: it reads the value the port needs off the measured data (``read``), says on which
references its edit applies (``references``), edits the copied ``model.py`` (``edit_model``),
names the feature in the package's docstring (``describe``) and sets the config the stage
tests need for the feature to show (``test_overrides``).

The registry (:data:`skill.feature_modules.FEATURE_MODULES`) is the one list of them: the
analysis, the reference deltas, the plan, ``edit_model`` and the stage-test file read it, so a
new feature is its module, its tests and a line in the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from skill.features import EDITABLE_REFERENCES

if TYPE_CHECKING:
    from skill.codemod.document import Document
    from skill.features import NamedFact
    from skill.porting.model_edits import EditContext


class FeatureModule(ABC):
    """One feature: the fact it ports, its value, its code edit, its prose and its test config."""

    name: ClassVar[str]  # the edit's name, as plans, package headers and ``edit_model`` name it
    title: ClassVar[str]  # how the reference deltas name the feature
    description: ClassVar[str]  # what the edit writes, for the edit catalogue
    claims: ClassVar[str]  # the NamedFact key it ports
    references: ClassVar[tuple[str, ...]] = EDITABLE_REFERENCES

    @abstractmethod
    def read(self, fact: NamedFact) -> dict[str, Any] | None:
        """The value the port needs, read off the measured fact (JSON); ``None`` when the fact
        holds something this module does not port, which then stays refused by name."""

    @abstractmethod
    def edit_model(self, text: Document, value: dict[str, Any], ctx: EditContext) -> Document:
        """The copied reference's ``model.py`` with the feature written in (idempotent)."""

    @abstractmethod
    def describe(self, value: dict[str, Any]) -> str:
        """The feature as the package's one-line docstring lists it ("block norms with ...")."""

    def test_overrides(self, value: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """Config fields the stage tests set so the feature shows, and the comment saying why."""
        return {}, None
