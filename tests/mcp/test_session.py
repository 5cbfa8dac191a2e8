"""Sessions: one line per call, edits outside the tools as patches, replay in a fresh copy."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from skill import session as sessions
from skill.replay import ReplayInput, replay_session
from skill.tools import invoke


@pytest.mark.parametrize("seed", range(3))
def test_patches_roundtrip_every_kind_of_edit(tmp_path: Path, seed: int):
    rng = random.Random(seed)
    for trial in range(60):
        old_lines = [f"line {rng.randint(0, 5)}\n" for _ in range(rng.randint(0, 10))]
        new_lines = list(old_lines)
        for _ in range(rng.randint(0, 4)):
            op = rng.choice("aic")
            if op == "a":
                new_lines.insert(rng.randint(0, len(new_lines)), f"added {rng.randint(0, 9)}\n")
            elif op == "i" and new_lines:
                new_lines.pop(rng.randrange(len(new_lines)))
            elif new_lines:
                new_lines[rng.randrange(len(new_lines))] = "form\x0cfeed kept on one line\n"
        old, new = "".join(old_lines), "".join(new_lines)
        if rng.random() < 0.3:
            old = old.rstrip("\n")
        if rng.random() < 0.3:
            new = new.rstrip("\n")
        kind = rng.choice(["modify", "modify", "create", "delete"])
        old_bytes = None if kind == "create" else old.encode()
        new_bytes = None if kind == "delete" else new.encode()
        target = tmp_path / f"t{trial}" / "file.py"
        if old_bytes is not None:
            target.parent.mkdir(parents=True)
            target.write_bytes(old_bytes)
        patch = sessions.unified_diff(f"t{trial}/file.py", old_bytes, new_bytes)
        assert sessions.apply_patch(tmp_path, patch) == [f"t{trial}/file.py"]
        assert (target.read_bytes() if target.exists() else None) == new_bytes, patch


def test_patch_that_does_not_match_is_refused(tmp_path: Path):
    (tmp_path / "a.py").write_text("one\ntwo\n")
    patch = sessions.unified_diff("a.py", b"one\ntwo\n", b"one\nthree\n")
    (tmp_path / "a.py").write_text("one\nTWO\n")
    with pytest.raises(sessions.PatchError, match=re.escape("a.py")):
        sessions.apply_patch(tmp_path, patch)


def _replay_example(path: Path, workspace: Path):
    """Replay a session of :func:`_record_example`: its hand edit writes Python (hand.py), which a
    replay runs only when the person replaying trusts it (test_replay_confinement.py)."""
    return replay_session(ReplayInput(session=path, source=workspace, trust_remote_code=True))


def _record_example(workspace: Path) -> Path:
    path = workspace / "sessions" / "example.jsonl"
    with sessions.recording(path, workspace, close=True):
        invoke("toy_append_note", {"model_name": "mistral", "text": "first"}, workspace=workspace)
        # An edit by hand between two calls, and a new file.
        notes = workspace / "archon_models" / "mistral" / "NOTES.txt"
        notes.write_text(notes.read_text().replace("begin first", "begin FIRST (by hand)"))
        (workspace / "archon_models" / "mistral" / "hand.py").write_text("X = 1\n")
        invoke("toy_append_note", {"model_name": "mistral", "text": "second"}, workspace=workspace)
        with pytest.raises(ValueError, match="empty"):
            (workspace / "empty.txt").write_text("")
            invoke("toy_read_note", {"model_name": "mistral", "note": "empty.txt"}, workspace=workspace)
    return path


def test_a_session_records_calls_edits_and_the_closing_patch(workspace: Path):
    path = _record_example(workspace)
    records = sessions.read_session(path)
    kinds = [r.kind for r in records]
    assert kinds == ["session", "call", "edit", "call", "edit", "call", "close"]
    first, edit, second = records[1], records[2], records[3]
    assert first.tool == "toy_append_note" and first.ok
    assert first.arguments == {"model_name": "mistral", "text": "first"}
    assert list(first.files) == ["archon_models/mistral/NOTES.txt"]
    assert first.base == {"archon_models/mistral/NOTES.txt": None}
    assert first.engine_version == sessions.engine_version()
    # The result is normalised: workspace path replaced, volatile elapsed_s left out.
    assert first.result == {"path": "<workspace>/archon_models/mistral/NOTES.txt", "lines": 2}
    assert set(edit.files) == {"archon_models/mistral/NOTES.txt", "archon_models/mistral/hand.py"}
    assert "+begin FIRST (by hand)" in edit.patch and "+X = 1" in edit.patch
    assert second.ok and not second.base  # NOTES.txt already had its base recorded
    failed = records[5]
    assert not failed.ok and failed.error.type == "ValueError" and "empty" in failed.error.message
    assert records[-1].patch == "".join(r.patch for r in records if r.kind == "edit")
    assert records[-1].calls == 3 and records[-1].edits == 2


def test_replay_of_an_untouched_session_matches(workspace: Path):
    path = _record_example(workspace)
    report = _replay_example(path, workspace)
    assert report.ok, report.describe()
    assert (report.calls, report.edits, report.closed) == (3, 2, True)
    # Without the flag the hand edit's Python is refused before anything runs.
    with pytest.raises(ValueError, match=r"edit #2 writes archon_models/mistral/hand.py \(a hand edit\)"):
        replay_session(ReplayInput(session=path, source=workspace))


def _tamper(path: Path, seq: int, change) -> None:
    lines = path.read_text().splitlines()
    for index, line in enumerate(lines):
        record = json.loads(line)
        if record.get("seq") == seq:
            change(record)
            lines[index] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


def test_replay_names_the_first_differing_call_or_file(workspace: Path):
    path = _record_example(workspace)

    def other_hash(record):
        record["files"]["archon_models/mistral/NOTES.txt"] = "0" * 64

    _tamper(path, 3, other_hash)
    report = _replay_example(path, workspace)
    assert not report.ok
    assert (report.mismatch.seq, report.mismatch.tool, report.mismatch.kind) == (3, "toy_append_note", "files")
    assert "archon_models/mistral/NOTES.txt" in report.mismatch.detail
    assert "call #3 (toy_append_note)" in report.describe()

    def other_result(record):
        record["result"]["lines"] = 99
        record["result_digest"] = "sha256:0"

    _tamper(path, 1, other_result)
    report = _replay_example(path, workspace)
    assert report.mismatch.seq == 1 and report.mismatch.kind == "result"
    assert report.mismatch.detail == "result.lines: expected 99, got 2"


def test_a_session_records_the_transformers_version(workspace: Path):
    from importlib import metadata

    header = sessions.read_session(_record_example(workspace))[0]
    assert header.transformers == metadata.version("transformers")


def test_replay_on_another_transformers_says_so(workspace: Path):
    path = _record_example(workspace)
    installed = sessions.transformers_version()

    def recorded_elsewhere(record):
        record["transformers"] = "5.3.0" if installed != "5.3.0" else "5.23.0"

    _tamper_header(path, recorded_elsewhere)
    other = sessions.read_session(path)[0].transformers
    report = _replay_example(path, workspace)
    assert report.ok and (report.recorded_transformers, report.replay_transformers) == (other, installed)
    assert report.describe().endswith(f"(recorded with transformers {other}, replayed on {installed})")

    def other_result(record):
        record["result"]["lines"] = 99
        record["result_digest"] = "sha256:0"

    _tamper(path, 1, other_result)
    report = _replay_example(path, workspace)
    assert not report.ok and report.mismatch.seq == 1
    assert report.describe().startswith(f"replay FAILED: recorded with transformers {other}, this is {installed}: ")
    assert "call #1 (toy_append_note)" in report.describe() and "result.lines: expected 99, got 2" in report.describe()

    # An older session without the field: no claim about versions either way.
    _tamper_header(path, lambda record: record.pop("transformers"))
    report = _replay_example(path, workspace)
    assert report.recorded_transformers is None and report.describe().startswith("replay FAILED at call #1")


def _tamper_header(path: Path, change) -> None:
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    change(header)
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")


def test_a_session_continues_across_processes_and_refuses_after_close(workspace: Path):
    path = workspace / "cli.jsonl"
    with sessions.recording(path, workspace):
        invoke("toy_append_note", {"model_name": "llama", "text": "a"}, workspace=workspace)
    (workspace / "archon_models" / "llama" / "NOTES.txt").write_text("by hand\n")
    with sessions.recording(path, workspace, close=True):  # a second CLI invocation continues it
        invoke("toy_append_note", {"model_name": "llama", "text": "b"}, workspace=workspace)
    kinds = [r.kind for r in sessions.read_session(path)]
    assert kinds == ["session", "call", "edit", "call", "close"]
    with pytest.raises(ValueError, match="closed"):
        sessions.SessionRecorder(path, workspace)
    assert replay_session(ReplayInput(session=path, source=workspace)).ok


def test_replay_reports_a_call_that_cannot_run_any_more(workspace: Path):
    path = _record_example(workspace)
    _tamper(path, 1, lambda record: record.update(tool="no_longer_a_tool"))
    report = _replay_example(path, workspace)
    assert (report.mismatch.seq, report.mismatch.kind) == (1, "outcome")
    assert "did not run" in report.mismatch.detail and "unknown tool" in report.mismatch.detail


def test_virtual_environments_are_outside_the_session_state_and_the_replay_copy(tmp_path: Path):
    """A venv under any name (``.venv-areal/`` in CI holds ~16k files) is neither hashed into a
    session nor copied by a replay; a folder that only looks like one is kept."""
    from skill.replay import copy_repository

    root = tmp_path / "repo"
    (root / "archon_models").mkdir(parents=True)
    (root / "archon_models" / "x.py").write_text("x = 1\n")
    for venv in (".venv-areal", "envs/tf53"):
        (root / venv / "lib").mkdir(parents=True)
        (root / venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
        (root / venv / "lib" / "big.py").write_text("y = 2\n")
    (root / "notes" / "lib").mkdir(parents=True)
    (root / "notes" / "lib" / "kept.py").write_text("z = 3\n")

    tracked = list(sessions.iter_workspace_files(root))
    assert tracked == ["archon_models/x.py", "notes/lib/kept.py"]
    copy = copy_repository(root, tmp_path / "copy")
    copied = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file())
    assert copied == tracked


def test_a_field_its_model_leaves_out_is_left_out_of_the_record():
    """A report fact only some families have (``exclude_if``: absent when None, as MLA's
    latent_norm_eps_field) stays out of recorded results, so the sessions of the other
    families read as before; present, it is recorded. Before: recorded as null, and every
    MLA family's committed session failed to replay ('unexpected None')."""
    from skill.features import MLA

    assert "latent_norm_eps_field" not in sessions._plain(MLA(kv_lora_rank=8))
    assert sessions._plain(MLA(kv_lora_rank=8, latent_norm_eps_field="rms_norm_eps"))["latent_norm_eps_field"] == (
        "rms_norm_eps"
    )
