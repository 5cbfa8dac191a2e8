"""A session file is untrusted: replay never touches a path outside its scratch copy,
and runs remote code only when the person replaying asks for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skill import session as sessions
from skill.replay import ReplayInput, UnsafeSessionError, replay_session
from skill.session import (
    CallRecord,
    EditRecord,
    FileContent,
    SessionHeader,
    unified_diff,
)

REPO = Path(__file__).resolve().parents[2]


def _write_session(path: Path, *records) -> Path:
    header = SessionHeader(
        session_id="crafted", engine_version=sessions.engine_version(), created="2026-01-01T00:00:00Z"
    )
    path.write_text("".join(r.model_dump_json() + "\n" for r in (header, *records)), encoding="utf-8")
    return path


def _edit(**fields) -> EditRecord:
    return EditRecord(seq=1, **{"patch": "", "files": {}, **fields})


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside every workspace that a crafted session aims at."""
    target = tmp_path / "outside" / "victim.txt"
    target.parent.mkdir()
    target.write_text("precious\n")
    return target


def _escapes(victim: Path, depth: int) -> str:
    return "../" * depth + "outside/victim.txt"


CRAFTED = {
    "base_absolute": lambda v: _edit(base={str(v): FileContent(text="pwned\n")}),
    "base_deleting_outside": lambda v: _edit(base={str(v): None}),
    "base_dotdot": lambda v: _edit(base={_escapes(v, 12): FileContent(text="pwned\n")}),
    "patch_header_dotdot": lambda v: _edit(
        patch=unified_diff("x", b"precious\n", b"pwned\n").replace("b/x", "b/" + _escapes(v, 12))
    ),
    "patch_header_absolute": lambda v: _edit(
        patch=unified_diff("x", b"precious\n", None).replace("diff --git a/x b/x", f"diff --git a/x b/{v}")
    ),
    "binary_dotdot": lambda v: _edit(binary={_escapes(v, 12): FileContent(b64="cHduZWQK")}),
    "binary_absolute": lambda v: _edit(binary={str(v): FileContent(b64="cHduZWQK")}),
    "call_base_absolute": lambda v: CallRecord(
        seq=1,
        tool="toy_read_note",
        arguments={"model_name": "x", "note": "README.md"},
        ok=True,
        engine_version="x",
        base={str(v): FileContent(text="pwned\n")},
    ),
}


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_a_path_leaving_the_workspace_fails_replay_and_touches_nothing(tmp_path: Path, victim: Path, kind: str):
    session = _write_session(tmp_path / "crafted.jsonl", CRAFTED[kind](victim))
    with pytest.raises(UnsafeSessionError, match=r"(edit|call) #1") as caught:
        replay_session(ReplayInput(session=session, source=REPO))
    assert "\n" not in str(caught.value)
    assert victim.read_text() == "precious\n"


def test_a_symlink_in_the_copied_repository_does_not_lead_a_patch_outside(tmp_path: Path, victim: Path):
    from tests.mcp.conftest import make_workspace

    source = make_workspace(tmp_path / "ws")
    (source / "archon_models" / "link").symlink_to(victim.parent, target_is_directory=True)
    patch = unified_diff("archon_models/link/victim.txt", b"precious\n", b"pwned\n")
    session = _write_session(tmp_path / "crafted.jsonl", _edit(patch=patch))
    with pytest.raises(UnsafeSessionError, match=r"edit #1: .*outside the workspace"):
        replay_session(ReplayInput(session=session, source=source))
    assert victim.read_text() == "precious\n"


def test_remote_code_runs_only_when_the_replayer_allows_it(tmp_path: Path):
    call = CallRecord(
        seq=1,
        tool="analyze_hf_model",
        arguments={"source": "ckpt", "trust_remote_code": True},
        ok=True,
        engine_version="x",
    )
    session = _write_session(tmp_path / "remote.jsonl", call)
    with pytest.raises(UnsafeSessionError, match=r"call #1 \(analyze_hf_model\).*--trust-remote-code"):
        replay_session(ReplayInput(session=session, source=REPO))
    # Allowed by the person replaying, the session goes on to the call (which then fails to
    # find its folder here: a mismatch, not a refusal).
    report = replay_session(ReplayInput(session=session, source=REPO, trust_remote_code=True))
    assert not report.ok and report.mismatch.seq == 1


def test_the_cli_refuses_with_one_line_and_exit_2(tmp_path: Path, victim: Path):
    session = _write_session(tmp_path / "crafted.jsonl", CRAFTED["patch_header_dotdot"](victim))
    proc = subprocess.run(
        [sys.executable, "-m", "skill.cli", "replay", str(session)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "edit #1" in proc.stderr, proc.stderr
    assert victim.read_text() == "precious\n"
    assert json.loads(session.read_text().splitlines()[0])["kind"] == "session"
