"""Shared files under concurrent calls: two new packages registered at once both land their
import lines; a model_type claimed by two packages at once goes to one of them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from skill import tools
from skill.codemod.workspace import StagedTree, Workspace
from skill.porting.register_spec import ARCHON_INIT, import_line_for, registered_types


def _copy(workspace: Path, *names: str) -> None:
    for name in names:
        tools.invoke("copy_reference", {"model_name": name, "reference": "qwen2"}, workspace=workspace)


def _register_together(workspace: Path, requests: list[dict]) -> list[Exception | None]:
    """Run register_spec calls in threads that all finish staging before any commits."""
    barrier = threading.Barrier(len(requests), timeout=60)
    real_commit = StagedTree.commit

    def commit_after_everyone_staged(tree: StagedTree) -> list[str]:
        barrier.wait()
        return real_commit(tree)

    outcomes: list[Exception | None] = [None] * len(requests)

    def call(index: int) -> None:
        try:
            tools.invoke("register_spec", requests[index], workspace=workspace, lock_timeout=30)
        except Exception as e:  # collected and asserted on below
            outcomes[index] = e
            barrier.abort()

    StagedTree.commit = commit_after_everyone_staged
    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        StagedTree.commit = real_commit
    return outcomes


def test_two_new_packages_registered_at_once_both_land_their_import_lines(workspace: Path):
    _copy(workspace, "alpha", "beta")
    outcomes = _register_together(
        workspace,
        [{"model_name": "alpha", "model_types": ["alpha_lm"]}, {"model_name": "beta", "model_types": ["beta_lm"]}],
    )
    assert outcomes == [None, None]
    registry = (workspace / ARCHON_INIT).read_text()
    assert import_line_for("alpha") in registry and import_line_for("beta") in registry
    owners = registered_types(StagedTree(Workspace(workspace)))
    assert owners["alpha_lm"] == "alpha" and owners["beta_lm"] == "beta"


def test_a_model_type_claimed_by_two_packages_at_once_goes_to_one(workspace: Path):
    _copy(workspace, "alpha", "beta")
    outcomes = _register_together(
        workspace,
        [{"model_name": "alpha", "model_types": ["shared_lm"]}, {"model_name": "beta", "model_types": ["shared_lm"]}],
    )
    refused = [e for e in outcomes if e is not None]
    assert len(refused) == 1 and isinstance(refused[0], ValueError), outcomes
    assert "already registered by another package" in str(refused[0])
    winner = "beta" if outcomes[0] is not None else "alpha"
    loser = "alpha" if winner == "beta" else "beta"
    registry = (workspace / ARCHON_INIT).read_text()
    assert import_line_for(winner) in registry and import_line_for(loser) not in registry
    assert registered_types(StagedTree(Workspace(workspace)))["shared_lm"] == winner
    assert "shared_lm" not in (workspace / f"archon_models/{loser}/spec.py").read_text()


@pytest.mark.parametrize("order", [("alpha", "beta"), ("beta", "alpha")])
def test_a_registry_edit_staged_before_another_commit_is_rebased(workspace: Path, order):
    _copy(workspace, "alpha", "beta")
    from skill.porting.register_spec import RegisterSpecRequest, apply_register_spec

    trees = {}
    for name in order:
        trees[name] = StagedTree(Workspace(workspace))
        apply_register_spec(
            trees[name], RegisterSpecRequest(model_name=name, model_types=[f"{name}_lm"], workspace=workspace)
        )
    for name in order:
        trees[name].commit()
    registry = (workspace / ARCHON_INIT).read_text()
    assert import_line_for("alpha") in registry and import_line_for("beta") in registry
    # The lines stay sorted whichever call committed first.
    assert registry.index(import_line_for("alpha")) < registry.index(import_line_for("beta"))
