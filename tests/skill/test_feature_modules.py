"""The feature-module registry (skill.feature_modules): how a module claims the fact it ports,
and what stays refused by name."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

import skill.feature_modules as registry
from skill.feature_modules.base import FeatureModule
from skill.features import NamedFact


class _Toy(FeatureModule):
    name = "toy"
    title = "a toy feature"
    description = "nothing"
    claims = "toy_fact"
    declined: ClassVar[set[str]] = set()

    def read(self, fact: NamedFact) -> dict[str, Any] | None:
        return None if fact.data.get("kind") in self.declined else {"kind": fact.data.get("kind")}

    def edit_model(self, text, value, ctx):  # type: ignore[no-untyped-def]
        return text

    def describe(self, value: dict[str, Any]) -> str:
        return "a toy"


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> _Toy:
    module = _Toy()
    monkeypatch.setattr(registry, "FEATURE_MODULES", (module,))
    return module


def test_a_module_claims_the_one_fact_of_its_key(toy: _Toy) -> None:
    facts = {"a toy fact": NamedFact(key="toy_fact", data={"kind": "x"}), "other": NamedFact(key="else")}
    other, ported = registry.claim_facts(["a toy fact", "other", "unkeyed"], facts)
    assert other == ["other", "unkeyed"]
    assert ported == {"toy": {"kind": "x"}}


def test_a_fact_the_module_declines_stays_refused(toy: _Toy) -> None:
    toy.declined = {"y"}
    other, ported = registry.claim_facts(["a toy fact"], {"a toy fact": NamedFact(key="toy_fact", data={"kind": "y"})})
    assert other == ["a toy fact"] and ported == {}


def test_two_facts_of_one_key_stay_refused(toy: _Toy) -> None:
    facts = {name: NamedFact(key="toy_fact", data={"kind": name}) for name in ("one", "two")}
    other, ported = registry.claim_facts(["one", "two"], facts)
    assert other == ["one", "two"] and ported == {}


def test_the_registry_names_each_module_once_and_each_claim_once() -> None:
    names = [module.name for module in registry.FEATURE_MODULES]
    claims = [module.claims for module in registry.FEATURE_MODULES]
    assert len(set(names)) == len(names) and len(set(claims)) == len(claims)
    assert {module.name: module for module in registry.FEATURE_MODULES} == registry.MODULES_BY_NAME
