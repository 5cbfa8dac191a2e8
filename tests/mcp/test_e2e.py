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
from tests.mcp.scripted_client import SESSIONS, add_source, port_over_stdio, ported_families

COMMITTED = sorted(SESSIONS.glob("*.jsonl"))
E2E_FAMILY = "llama"
# Replayed in the default run (a replay costs 5-20 worker-seconds): gpt_oss (qwen3 reference, MoE,
# sinks). test_a_skill_md_client_ports_a_family_over_stdio records llama's session (the qwen2
# reference) again over stdio and compares it call for call with the committed one, and the
# default run regenerates llama, gpt_oss, minicpm3 (deepseek_v3 reference, MLA) and gemma2
# (soft-capped, windowed flex attention) byte for byte (tests/skill/test_regenerate.py). Every
# other committed session replays under the `replay` marker, which .ci/run runs as its own step.
REPRESENTATIVE = {"gpt_oss"}


def _replay_param(session: Path):
    return pytest.param(session, id=session.stem, marks=() if session.stem in REPRESENTATIVE else pytest.mark.replay)


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
@pytest.mark.parametrize("session", [_replay_param(p) for p in COMMITTED if p.stem != E2E_FAMILY])
def test_committed_sessions_replay(session: Path):
    # A committed session is this repository's own reviewed input: a hand port's edit is the
    # committed package's code, which the stage tests import anyway. So it may run here.
    report = replay_session(ReplayInput(session=session, source=REPO, trust_remote_code=True))
    hand_port = any(isinstance(r, sessions.EditRecord) for r in sessions.read_session(session))
    assert report.ok, f"{report.describe()}\nIf the engine's output changed on purpose, re-record: " + (
        f"python -m skill.cli replay --rerecord --trust-remote-code {session.relative_to(REPO)} (a hand "
        "port: its session holds edits outside the tools; where a hand edit no longer applies, follow "
        "SKILL.md § Porting by hand again)"
        if hand_port
        else f"python -m tests.mcp.scripted_client --refresh {session.stem}"
    )
    assert report.calls >= 9  # analyze_hf_model ... check_package (plus a recopy the engine asked for)


def test_representative_sessions_are_committed():
    """The default run's replays exist: a renamed or removed session must not leave it with none."""
    assert {p.stem for p in COMMITTED} >= REPRESENTATIVE


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


def test_a_session_is_recorded_from_the_source_the_package_header_names():
    # The package of model_type "openai-gpt" is openai_gpt (a hyphen is no Python name): its
    # session ports the model_type, and SKILL.md names the package after it again.
    assert add_source("openai_gpt") == "openai-gpt"
    assert add_source("llama") == "llama"
