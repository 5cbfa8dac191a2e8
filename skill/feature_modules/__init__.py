"""The feature modules (:mod:`skill.feature_modules.base`): each ports one feature, whole.

Adding one: write ``skill/feature_modules/<feature>.py`` (a :class:`FeatureModule` subclass)
and its tests, and list an instance here. Its fact's detector keys the fact it measured
(``NamedFact``) with the module's ``claims``; every other step reads this registry.
"""

from __future__ import annotations

from typing import Any

from skill.feature_modules.base import FeatureModule
from skill.feature_modules.constant_norm_eps import ConstantNormEps
from skill.feature_modules.vaswani_positions import VaswaniPositions
from skill.features import NamedFact

FEATURE_MODULES: tuple[FeatureModule, ...] = (ConstantNormEps(), VaswaniPositions())

MODULES_BY_NAME: dict[str, FeatureModule] = {module.name: module for module in FEATURE_MODULES}


def claim_facts(other: list[str], facts: dict[str, NamedFact]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The ``other`` features no module ports, and each porting module's name -> its value.

    A module ports the one fact of its key a family has; two facts of one key, or a fact the
    module's ``read`` declines, stay in ``other`` (refused by name, as without the module)."""
    ported: dict[str, dict[str, Any]] = {}
    claimed: set[str] = set()
    for module in FEATURE_MODULES:
        mine = [text for text in dict.fromkeys(other) if text in facts and facts[text].key == module.claims]
        if len(mine) != 1:
            continue
        value = module.read(facts[mine[0]])
        if value is not None:
            ported[module.name] = value
            claimed.add(mine[0])
    return [text for text in other if text not in claimed], ported
