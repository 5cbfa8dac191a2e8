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
    return EditRecord(**{"seq": 1, "patch": "", "files": {}, **fields})


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


# --- code a session brings: its starting state and its hand edits -------------------------------------


def _marker_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'a').write('ran\\n')\n"


def _call(tool: str, arguments: dict, base: dict | None = None, seq: int = 1) -> CallRecord:
    return CallRecord(seq=seq, tool=tool, arguments=arguments, ok=True, engine_version="x", base=base or {})


def _remote_case(marker: Path) -> dict:
    folder = "tests/composition/evilfam"
    generated = (REPO / "tests/archon/test_llama.py").read_text()
    start = generated.index("CASES = [")
    end = generated.index("\n]\n", start) + 3
    remote = f'CASES = [ModelCase(model_type="llama", source="{folder}", trust_remote_code=True)]\n'
    case = generated[:start] + remote + generated[end:]
    config = {"model_type": "llama", "auto_map": {"AutoConfig": "configuration_evilfam.EvilConfig"}}
    configuration = (
        _marker_code(marker)
        + "from transformers import LlamaConfig\n\n\nclass EvilConfig(LlamaConfig):\n    model_type = 'llama'\n"
    )
    return {
        "tests/archon/test_llama.py": FileContent(text=case),
        f"{folder}/config.json": FileContent(text=json.dumps(config)),
        f"{folder}/configuration_evilfam.py": FileContent(text=configuration),
    }


def _latin1_module(marker: Path) -> bytes:
    return b"# -*- coding: latin-1 -*-\n" + _marker_code(marker).encode() + b"# \xff\n"


BRINGS_CODE = {
    # The only call is a read-only divergence run; the test file it reads is the session's.
    "test_file_base": lambda m: [
        _call(
            "locate_divergence",
            {"model_name": "llama"},
            {"tests/archon/test_llama.py": FileContent(text=_marker_code(m) + "CASES = []\n")},
        )
    ],
    "package_module_base": lambda m: [
        _call(
            "locate_divergence",
            {"model_name": "llama"},
            {"archon_models/llama/model/rope.py": FileContent(text=_marker_code(m))},
        )
    ],
    "registry_base": lambda m: [
        _call(
            "check_package",
            {"model_name": "llama"},
            {
                "archon_models/__init__.py": FileContent(
                    text=(REPO / "archon_models/__init__.py").read_text() + _marker_code(m)
                )
            },
        )
    ],
    "remote_code_case": lambda m: [_call("run_test_stage", {"model_name": "llama", "stage": 1}, _remote_case(m))],
    "hand_edit_conftest": lambda m: [
        _edit(patch=unified_diff("conftest.py", None, _marker_code(m).encode())),
        _call("run_test_stage", {"model_name": "llama", "stage": 1}, seq=2),
    ],
    "binary_module": lambda m: [
        # Not UTF-8, so a binary entry; still Python (its coding line says latin-1).
        _edit(binary={"archon_models/llama/model/rope.py": FileContent.of(_latin1_module(m))}),
        _call("locate_divergence", {"model_name": "llama"}, seq=2),
    ],
}


@pytest.mark.parametrize("kind", sorted(BRINGS_CODE))
def test_code_a_session_brings_runs_only_with_the_flag(tmp_path: Path, kind: str):
    marker = tmp_path / "session-code-ran"
    session = _write_session(tmp_path / "crafted.jsonl", *BRINGS_CODE[kind](marker))
    with pytest.raises(UnsafeSessionError, match=r"^(call|edit) #\d .*writes .*--trust-remote-code") as refused:
        replay_session(ReplayInput(session=session, source=REPO))
    assert "\n" not in str(refused.value)
    assert not marker.exists()


def test_data_and_the_registry_s_import_lines_need_no_flag(tmp_path: Path):
    registry = (REPO / "archon_models/__init__.py").read_text()
    fewer = "".join(line for line in registry.splitlines(keepends=True) if "llama import spec" not in line)
    records = [
        _call(
            "toy_read_note",
            {"model_name": "x", "note": "README.md"},
            {
                "archon_models/__init__.py": FileContent(text=fewer),  # a session that started before llama
                "archon_models/llama/spec.py": None,  # absent at the start: nothing to run
                "notes/plan.md": FileContent(text="# plan\n"),
                "README.md": FileContent(text=(REPO / "README.md").read_text()),  # as the copy has it
            },
        ),
        _edit(seq=2, patch=unified_diff("notes/plan.md", b"# plan\n", b"# plan, edited\n")),
    ]
    session = _write_session(tmp_path / "data.jsonl", *records)
    report = replay_session(ReplayInput(session=session, source=REPO))
    assert report.calls == 1  # it ran (and then differs from the crafted record: no refusal)


def test_with_the_flag_the_session_s_code_is_replayed(tmp_path: Path):
    marker = tmp_path / "session-code-ran"
    base = {"archon_models/notes_helper.py": FileContent(text=_marker_code(marker))}
    session = _write_session(tmp_path / "trusted.jsonl", _call("toy_read_note", {"model_name": "x", "note": "x"}, base))
    report = replay_session(ReplayInput(session=session, source=REPO, trust_remote_code=True))
    assert report.calls == 1


def test_the_committed_sessions_bring_no_code_but_a_hand_port_s_edit_of_its_own_package(tmp_path: Path):
    """A committed session replays without --trust-remote-code, except a hand port's: its hand
    edit is code, and must be the only code it brings, inside its own package (which the stage
    tests import anyway). Every committed family ports with the tools today (bitnet, axk1 and
    gpt_neox_japanese were hand ports until their edits existed): a hand port's session is
    recorded here, as one is, and vetted the same way."""
    from skill.codemod.workspace import Workspace
    from skill.replay import vet_session
    from skill.session import EditRecord, SessionRecorder, patch_writes, read_session

    def vet(path: Path) -> bool:
        records = read_session(path)
        edits = [r for r in records if isinstance(r, EditRecord)]
        vet_session([r for r in records if not isinstance(r, EditRecord)], trust_remote_code=False, source=REPO)
        if edits:
            with pytest.raises(UnsafeSessionError, match=r"a hand edit|edit #\d+ writes"):
                vet_session(records, trust_remote_code=False, source=REPO)
        for record in edits:
            for rel in patch_writes(record.patch):
                assert rel.startswith(f"archon_models/{path.stem}/"), f"{path.name}: its hand edit writes {rel}"
        return bool(edits)

    for path in sorted((REPO / "tests/mcp/sessions").glob("*.jsonl")):
        vet(path)
    root = tmp_path / "ws"
    model = root / "archon_models" / "demo" / "model" / "model.py"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_text('"""Demo."""\n\n\ndef forward(x):\n    return x\n')
    session = tmp_path / "demo.jsonl"
    recorder = SessionRecorder(session, Workspace(root))
    model.write_text('"""Demo."""\n\n\ndef forward(x):\n    return 2 * x\n')
    recorder.close()
    assert vet(session)


def test_the_cli_refuses_a_session_bringing_code_with_one_line_and_exit_2(tmp_path: Path):
    marker = tmp_path / "session-code-ran"
    session = _write_session(tmp_path / "crafted.jsonl", *BRINGS_CODE["test_file_base"](marker))
    proc = subprocess.run(
        [sys.executable, "-m", "skill.cli", "replay", str(session)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "call #1 (locate_divergence) writes tests/archon/test_llama.py" in proc.stderr
    assert not marker.exists()
