"""End to end: a client that knows only SKILL.md and the tool list ports a family over stdio,
and the sessions that produced the committed families replay."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from skill import session as sessions
from skill.replay import ReplayInput, _check_call, replay_session
from tests.mcp.conftest import REPO, make_project
from tests.mcp.scripted_client import SESSIONS, port_over_stdio, ported_families

COMMITTED = sorted(SESSIONS.glob("*.jsonl"))
E2E_FAMILY = "llama"


@pytest.mark.slow
def test_a_skill_md_client_ports_a_family_over_stdio(tmp_path: Path):
    """The server as a subprocess; the client reads SKILL.md, lists tools, analyses, ports
    llama into a project without it and runs stage 1. Its session equals the committed one."""
    root = make_project(tmp_path / "repo", without=(E2E_FAMILY,))
    session = tmp_path / "e2e.jsonl"
    transcript = anyio.run(lambda: port_over_stdio(root, E2E_FAMILY, session=session, stages=[1]))
    assert transcript.passed, transcript.failed_at
    tools_called = [tool for tool, *_ in transcript.calls]
    assert tools_called[0] == "analyze_hf_model" and tools_called[-1] == "run_test_stage"
    stage = transcript.calls[-1][2]
    assert stage["passed"] and stage["stage"] == 1
    # The port is the committed package, byte for byte.
    for path in sorted((REPO / "archon_models" / E2E_FAMILY).rglob("*.py")):
        rel = path.relative_to(REPO)
        assert (root / rel).read_bytes() == path.read_bytes(), rel
    # The recorded session is the committed session (steps 1-9), plus the stage-1 call.
    recorded = [r for r in sessions.read_session(session) if isinstance(r, sessions.CallRecord)]
    assert recorded[-1].tool == "run_test_stage" and "tests/archon/test_llama.py" in recorded[-1].files
    recorded = recorded[:-1]
    committed_path = SESSIONS / f"{E2E_FAMILY}.jsonl"
    committed = [r for r in sessions.read_session(committed_path) if isinstance(r, sessions.CallRecord)]
    assert [(r.tool, r.arguments) for r in recorded] == [(r.tool, r.arguments) for r in committed]
    for old, new in zip(committed, recorded, strict=True):
        mismatch = _check_call(old, new)
        assert mismatch is None, f"{committed_path.name}: {mismatch}"


@pytest.mark.slow
@pytest.mark.parametrize("session", [p for p in COMMITTED if p.stem != E2E_FAMILY], ids=lambda p: p.stem)
def test_committed_sessions_replay(session: Path):
    report = replay_session(ReplayInput(session=session, source=REPO))
    assert report.ok, (
        f"{report.describe()}\nIf the engine's output changed on purpose, re-record: "
        f"python -m tests.mcp.scripted_client --refresh {session.stem}"
    )
    assert report.calls >= 9  # analyze_hf_model ... check_package (plus a recopy the engine asked for)


def test_committed_sessions_are_closed_and_portable():
    missing = sorted(set(ported_families()) - {p.stem for p in COMMITTED})
    assert not missing, (
        f"ported families without a session in tests/mcp/sessions/: {missing}; "
        "record them with `python -m tests.mcp.scripted_client --refresh`"
    )
    for path in COMMITTED:
        records = sessions.read_session(path)
        assert isinstance(records[-1], sessions.CloseRecord), f"{path.name} was not closed"
        text = path.read_text()
        assert "/tmp/" not in text and str(REPO) not in text, f"{path.name} holds a machine-specific path"
        calls = [json.loads(line) for line in text.splitlines() if '"kind":"call"' in line]
        assert calls[-1]["tool"] == "check_package" and calls[-1]["result"]["passed"], path.name


def test_the_hand_port_sessions_record_their_hand_edit():
    """A family that keeps an unsupported feature: the session takes SKILL.md's "Porting by
    hand" path, and the hand edit sits, as a patch, between the tools' writes and the stages."""
    from tests.mcp.hand_port_client import HAND_PORTS

    for family, hand_port in HAND_PORTS.items():
        path = SESSIONS / f"{family}.jsonl"
        assert path in COMMITTED, (
            f"{family}: no committed session; python -m tests.mcp.scripted_client --refresh {family}"
        )
        records = sessions.read_session(path)
        kinds = [(r.kind, getattr(r, "tool", None)) for r in records[1:]]
        edits = [i for i, (kind, _) in enumerate(kinds) if kind == "edit"]
        assert len(edits) == 1, f"{path.name}: expected the hand edit as one edit record, got {len(edits)}"
        before, after = [tool for _, tool in kinds[: edits[0]]], [tool for _, tool in kinds[edits[0] + 1 :]]
        assert before[-1] == "register_spec" and after[0] == "run_test_stage" and after[-2] == "check_package"
        calls = {r.tool: r for r in records if isinstance(r, sessions.CallRecord)}
        assert calls["edit_model"].arguments.get("allow_unsupported") is True
        assert calls["edit_model"].result["skipped_features"] == hand_port.features
        overrides = [r for r in records if isinstance(r, sessions.CallRecord) and r.arguments.get("config_overrides")]
        assert sorted(r.arguments["stage"] for r in overrides) == [1, 2, 3, 4, 5, 6]
        assert all(
            r.result["passed"] for r in records if isinstance(r, sessions.CallRecord) and r.tool == "run_test_stage"
        )
        patched = sessions.patch_paths(records[-1].patch)
        assert sorted(set(patched)) == sorted({edit.path for edit in hand_port.edits})
        # The package says how it is rebuilt: by replaying this session, not by `add`.
        for file in sorted((REPO / "archon_models" / family).rglob("*.py")):
            header = file.read_text().splitlines()[1:3]
            assert header[0].startswith("# Hand edits for: ")
            assert header[1] == f"#   archon-port replay --keep tests/mcp/sessions/{path.name}"
