"""Replay compares results as structures and normalises what belongs to the run (issue 20).

An agent's session held a stage-5 run that failed with gloo's ``Connection closed by peer
[127.0.0.1]:35534``; its replay stopped there ("expected ...:35534, got ...:4254") though
every file matched. The messages below are real ones, from stage-5 runs of a package whose
pipeline split dropped its embedding norm (before the fix of that, issue 20 item 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from skill import session as sessions
from skill import tools
from skill.replay import ReplayInput, replay_session
from skill.replay_compare import compare_call, first_difference, normalise_volatile
from skill.tools import invoke

# Two runs of the same failing stage 5: every difference between them is the run's.
RUN_A = (
    "rank 0: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:35534. This is typically caused by a remote worker crashing. (at "
    "<workspace>/archon_models/embrms/model/model.py:274); rank 1: RuntimeError: [/__w/pytorch/pytorch/"
    "third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation "
    "to complete (pid 51234, after 61.84s)"
)
RUN_B = (
    RUN_A.replace("35534", "4254").replace("51234", "51871").replace("61.84s", "60.2s").replace("60000ms", "30000ms")
)


def _stage_result(detail: str) -> dict:
    """A run_test_stage result as a session stores it (volatile fields already left out)."""
    check = {"name": "raised (cp=2)", "passed": False, "detail": detail}
    return {
        "stage": 5,
        "passed": False,
        "tests": [{"test": "test_stage5[embrms]", "outcome": "failed", "checks": [check], "message": detail[:500]}],
    }


def test_endpoints_pids_and_durations_are_normalised():
    assert normalise_volatile(RUN_A) == normalise_volatile(RUN_B)
    normal = normalise_volatile(RUN_A)
    assert "[127.0.0.1]" not in normal and "<endpoint>" in normal and "pid <pid>" in normal
    assert "after <duration>" in normal and "waiting <duration> for recv" in normal
    # What the port decides stays: the file, the line, the exception, the rank.
    assert "model.py:274" in normal and "rank 1: RuntimeError" in normal
    assert normalise_volatile("at 0x7f53551528b0 on 2026-12-04T10:00:00Z") == "at <address> on <time>"
    # Numbers that are not durations are not touched.
    assert normalise_volatile("22 tensors, layers.1, fp32s, 3 stages") == "22 tensors, layers.1, fp32s, 3 stages"


def test_two_runs_of_a_failed_stage_compare_equal_and_a_real_difference_does_not():
    assert first_difference(_stage_result(RUN_A), _stage_result(RUN_B)) is None
    other_line = first_difference(_stage_result(RUN_A), _stage_result(RUN_A.replace("model.py:274", "model.py:275")))
    assert other_line is not None and other_line.startswith("result.tests[0].checks[0].detail: expected")
    other_error = RUN_A.replace("rank 0: RuntimeError", "rank 0: TypeError")
    assert first_difference(_stage_result(RUN_A), _stage_result(other_error)) is not None
    # Floats are recorded to 4 significant digits; the next rounding step is the same value.
    assert first_difference({"x": 1.234}, {"x": 1.235}) is None
    assert first_difference({"x": 1.234}, {"x": 1.3}) == "result.x: expected 1.234, got 1.3"
    assert first_difference({"passed": True}, {"passed": 1}) is not None


def _call(result: dict | None = None, error: sessions.ErrorInfo | None = None) -> sessions.CallRecord:
    return sessions.CallRecord(
        seq=3,
        tool="run_test_stage",
        arguments={"model_name": "embrms", "stage": 5},
        ok=error is None,
        result=result,
        result_digest=None if result is None else sessions.digest(result),
        error=error,
        engine_version="0",
    )


def test_a_recorded_call_with_raw_run_values_matches_its_replay():
    """A session recorded before this normalisation holds the raw text (digest of it): the
    digests differ, the structures match."""
    recorded, replayed = _call(_stage_result(RUN_A)), _call(_stage_result(RUN_B))
    assert recorded.result_digest != replayed.result_digest
    assert compare_call(recorded, replayed) is None
    failed = _call(error=sessions.ErrorInfo(type="WorkerFailure", message=RUN_A))
    assert compare_call(failed, _call(error=sessions.ErrorInfo(type="WorkerFailure", message=RUN_B))) is None
    other = compare_call(failed, _call(error=sessions.ErrorInfo(type="TimeoutError", message=RUN_B)))
    assert other is not None and other.kind == "error"


def test_a_session_whose_distributed_run_failed_replays(workspace: Path):
    """Recorded and replayed for real: each run of the tool reports another port, pid and
    time, as a failed gloo run does, both as a result and as the call's error."""
    path = workspace / "sessions" / "peer_lost.jsonl"
    with sessions.recording(path, workspace, close=True):
        invoke("toy_peer_lost", {"model_name": "embrms"}, workspace=workspace)
        with contextlib.suppress(RuntimeError):
            invoke("toy_peer_lost", {"model_name": "embrms", "fail": True}, workspace=workspace)
    calls = [r for r in sessions.read_session(path) if isinstance(r, sessions.CallRecord)]
    assert "[127.0.0.1]" not in path.read_text(), "recorded with the run's endpoint"
    assert "<endpoint>" in calls[0].result["detail"] and not calls[1].ok and "<pid>" in calls[1].error.message
    report = replay_session(ReplayInput(session=path, source=workspace))
    assert report.ok, report.describe()

    # A session recorded before the normalisation: the raw text, and the digest of it.
    lines = path.read_text().splitlines()
    raw = (
        "rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:35534 "
        "(peer pid 4242, exit code 0, after 0.017s)"
    )
    record = json.loads(lines[1])
    record["result"]["detail"] = raw
    record["result_digest"] = sessions.digest(record["result"])
    error = json.loads(lines[2])
    error["error"]["message"] = raw
    lines[1], lines[2] = json.dumps(record), json.dumps(error)
    old = workspace / "sessions" / "peer_lost_raw.jsonl"
    old.write_text("\n".join(lines) + "\n")
    report = replay_session(ReplayInput(session=old, source=workspace))
    assert report.ok, report.describe()


@pytest.mark.slow
def test_a_session_with_a_failed_stage5_run_replays(tmp_path: Path):
    """A real failed distributed run, recorded and replayed: bloom's spec handed back to
    pipeline_llm by hand (as an agent porting by hand might leave it), then stage 5 on its
    untied case, where pipeline parallelism runs and the split refuses the embedding norm."""
    from tests.skill.test_port_rope import REPO, _workspace

    root = _workspace(tmp_path)
    shutil.copy(REPO / "tests/archon/test_bloom.py", root / "tests/archon/test_bloom.py")
    session = tmp_path / "bloom_failed_stage.jsonl"
    spec = root / "archon_models/bloom/spec.py"
    with sessions.recording(session, root, close=True):
        text = spec.read_text()
        text = text.replace("pipelining_fn=pipeline_bloom", "pipelining_fn=pipeline_llm")
        text = text.replace(
            "from archon_models.model_spec import ModelSpec, register_model_spec\n",
            "from archon_models.model_spec import ModelSpec, register_model_spec\n"
            "from archon_models.pipeline_parallel import pipeline_llm\n",
        )
        spec.write_text(text)
        untied = {"model_name": "bloom", "stage": 5, "config_overrides": {"tie_word_embeddings": False}}
        invoke("run_test_stage", untied, workspace=root)
    records = sessions.read_session(session)
    assert [r.kind for r in records] == ["session", "edit", "call", "close"]
    call = records[2]
    assert isinstance(call, sessions.CallRecord) and call.ok and call.result is not None
    assert call.result["passed"] is False
    checks = {c["name"]: c for t in call.result["tests"] for c in t["checks"]}
    raised = checks["raised (pp=2)"]
    assert raised["detail"].startswith("ranks 0,1: ValueError: BloomModel has modules no pipeline stage lists")
    assert checks["gradients (cp=2)"]["passed"], "the pp failure leaked into cp"

    # The hand edit of spec.py is code the session brings: replayed only when trusted.
    report = replay_session(ReplayInput(session=session, source=root, trust_remote_code=True))
    assert report.ok, report.describe()
    assert (report.calls, report.edits) == (1, 1)


def _toy_session_with_a_hand_edit(workspace: Path) -> tuple[Path, Path]:
    """A session in which a tool writes a file, a hand edit appends to it, and a second call runs."""
    path = workspace / "sessions" / "toy_hand_port.jsonl"
    note = workspace / "archon_models" / "toy" / "NOTES.txt"
    generated = "generated by engine v1\n" + "".join(f"line {i}\n" for i in range(6))
    with sessions.recording(path, workspace, close=True):
        invoke("toy_rewrite_note", {"model_name": "toy", "content": generated}, workspace=workspace)
        note.write_text(note.read_text() + "hand edit\n")
        invoke("toy_append_note", {"model_name": "toy", "text": "after"}, workspace=workspace)
    return path, note


def _engine_writes(monkeypatch: pytest.MonkeyPatch, old: str, new: str) -> None:
    """The toy step writes other text from now on, as an engine change alters a generated file."""
    from tests.mcp import toy_steps

    def rewrite_note(request: toy_steps.RewriteRequest) -> toy_steps.AppendNoteResult:
        """Replace archon_models/<model_name>/NOTES.txt, as the changed engine writes it."""
        return toy_steps.rewrite_note(request.model_copy(update={"content": request.content.replace(old, new)}))

    tools.load_tools()  # resolves the registry once; the changed step replaces its entry there
    changed = dataclasses.replace(tools.load_tools()["toy_rewrite_note"], function=rewrite_note)
    monkeypatch.setitem(tools._resolved, "toy_rewrite_note", changed)


def test_rerecord_takes_an_engine_change_and_keeps_the_hand_edit(workspace: Path, monkeypatch: pytest.MonkeyPatch):
    """A hand port's session cannot be re-recorded by its script (an agent made its hand edit): after an
    engine change altered what a call writes (a header), replay fails; replay --rerecord re-runs the
    calls, re-applies the hand edit, replaces the session and writes the files it created."""
    path, note = _toy_session_with_a_hand_edit(workspace)
    _engine_writes(monkeypatch, "engine v1", "engine v2")
    stale = replay_session(ReplayInput(session=path, source=workspace))
    assert not stale.ok and stale.mismatch is not None and stale.mismatch.kind == "files"
    assert "engine v1" in note.read_text(), "a failed replay wrote into the repository"

    report = replay_session(ReplayInput(session=path, source=workspace, rerecord=True))
    assert report.ok, report.describe()
    assert (report.calls, report.edits) == (2, 1) and report.taken, report.describe()
    assert report.written == ["archon_models/toy/NOTES.txt"]
    assert note.read_text().startswith("generated by engine v2\n")
    assert note.read_text().endswith("line 5\nhand edit\nbegin after\nend after\n")
    records = sessions.read_session(path)
    assert [r.kind for r in records] == ["session", "call", "edit", "call", "close"]
    assert records[-1].patch == records[2].patch and "+hand edit" in records[-1].patch
    again = replay_session(ReplayInput(session=path, source=workspace))
    assert again.ok, again.describe()


def test_rerecord_stops_where_the_hand_edit_no_longer_applies(workspace: Path, monkeypatch: pytest.MonkeyPatch):
    """An engine change under the hand edit's own lines: the hand edit must be made again, by a person;
    re-recording stops there and changes neither the session nor the repository."""
    path, note = _toy_session_with_a_hand_edit(workspace)
    before_session, before_note = path.read_bytes(), note.read_bytes()
    _engine_writes(monkeypatch, "line 5\n", "line five\n")
    report = replay_session(ReplayInput(session=path, source=workspace, rerecord=True))
    assert not report.ok and report.mismatch is not None
    assert report.mismatch.kind == "outcome" and "does not apply" in report.mismatch.detail, report.describe()
    assert report.written == []
    assert path.read_bytes() == before_session and note.read_bytes() == before_note


def _engine_refuses_the_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy step fails, as an engine before a fix refuses what a session asks."""

    def rewrite_note(request: object) -> object:
        """Replace archon_models/<model_name>/NOTES.txt; this engine cannot."""
        raise ValueError("this engine cannot write the note")

    tools.load_tools()
    refusing = dataclasses.replace(tools.load_tools()["toy_rewrite_note"], function=rewrite_note)
    monkeypatch.setitem(tools._resolved, "toy_rewrite_note", refusing)


def _toy_session_with_a_failed_call(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A call that failed on the engine it was recorded with, then one that succeeded."""
    path = workspace / "sessions" / "toy_fixed.jsonl"
    with monkeypatch.context() as patched:
        _engine_refuses_the_note(patched)
        with sessions.recording(path, workspace, close=True):
            with pytest.raises(ValueError, match="cannot write the note"):
                invoke("toy_rewrite_note", {"model_name": "toy", "content": "a note\n"}, workspace=workspace)
            invoke("toy_append_note", {"model_name": "toy", "text": "after"}, workspace=workspace)
    return path


def test_rerecord_takes_a_call_an_engine_fix_lets_succeed(workspace: Path, monkeypatch: pytest.MonkeyPatch):
    """Issue 20: an agent's first-try session records a call that failed; an engine fix lets it
    succeed. A plain replay stops there (the session no longer says what the engine does); a
    re-record takes it, and the new session records the call as succeeding."""
    path = _toy_session_with_a_failed_call(workspace, monkeypatch)
    assert [r.ok for r in sessions.read_session(path) if isinstance(r, sessions.CallRecord)] == [False, True]

    stale = replay_session(ReplayInput(session=path, source=workspace))
    assert not stale.ok and stale.mismatch is not None and stale.mismatch.kind == "fixed", stale.describe()

    report = replay_session(ReplayInput(session=path, source=workspace, rerecord=True))
    assert report.ok, report.describe()
    assert [m.kind for m in report.taken][:1] == ["fixed"]
    assert [r.ok for r in sessions.read_session(path) if isinstance(r, sessions.CallRecord)] == [True, True]
    again = replay_session(ReplayInput(session=path, source=workspace))
    assert again.ok, again.describe()


def test_rerecord_stops_where_a_call_that_succeeded_now_fails(workspace: Path, monkeypatch: pytest.MonkeyPatch):
    """The other way round is a regression, never taken: the session and the repository stay."""
    path, note = _toy_session_with_a_hand_edit(workspace)
    before_session, before_note = path.read_bytes(), note.read_bytes()
    _engine_refuses_the_note(monkeypatch)
    report = replay_session(ReplayInput(session=path, source=workspace, rerecord=True))
    assert not report.ok and report.mismatch is not None and report.mismatch.kind == "outcome", report.describe()
    assert "replay failed" in report.mismatch.detail
    assert path.read_bytes() == before_session and note.read_bytes() == before_note
