"""run_python_module: ``python -m`` runs forked from a warm interpreter behave like fresh ones.

A fresh interpreter is what the stage runs and the TP-plan trace rely on: the
workspace's modules are imported as they are on disk, never a copy imported before.
These tests hold the warm path to that, and to run_child's rules: the output and exit
status come back, and a timeout, a cancel or a killed caller leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from skill.codemod.workspace import CallCancelledError, cancellable
from skill.porting.child_process import WARM_CHILDREN_ENV, run_python_module
from tests.processes import process_gone, wait_for

REPO = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import helper
    print(json.dumps({
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "value": helper.VALUE,
        "env": os.environ.get("PROBE_VALUE"),
        "ppid": os.getppid(),
        "engine_loaded": sorted(m for m in ("skill", "archon_models", "tests") if m in sys.modules),
        "torch_loaded": "torch" in sys.modules,
        "path_head": sys.path[:2],
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper.py").write_text("VALUE = 1\n")
    return tmp_path


def _run(project: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(project / "lib"), **env}
    return run_python_module("probe", list(argv), cwd=project, env=full_env, timeout=120)


def test_a_warm_child_sees_its_paths_env_and_argv_and_imports_the_workspace_afresh(project: Path):
    first = _run(project, "--flag", "x", PROBE_VALUE="a")
    assert first.returncode == 0, first.stderr
    assert first.stderr.strip().endswith("to stderr")
    seen = json.loads(first.stdout)
    assert seen["argv"] == ["--flag", "x"] and seen["env"] == "a" and seen["value"] == 1
    assert seen["cwd"] == str(project.resolve())
    # python -m's order: the working directory, then PYTHONPATH.
    assert seen["path_head"] == [str(project.resolve()), str(project / "lib")]
    # Warm: torch is there already; fresh: nothing of the engine or the models is.
    assert seen["torch_loaded"] and seen["engine_loaded"] == []
    assert seen["ppid"] != os.getpid()

    # A module edited on disk between two runs is seen as edited.
    (project / "lib" / "helper.py").write_text("VALUE = 2\n")
    second = json.loads(_run(project, PROBE_VALUE="b").stdout)
    assert second["value"] == 2 and second["env"] == "b" and second["argv"] == []
    assert second["ppid"] == seen["ppid"], "each run started a new warm interpreter"


def test_exit_codes_and_tracebacks_come_back(project: Path):
    assert _run(project, PROBE_EXIT="3").returncode == 3
    (project / "boom.py").write_text("raise ValueError('boom in the child')\n")
    failed = run_python_module("boom", [], cwd=project, env=dict(os.environ), timeout=60)
    assert failed.returncode == 1 and "ValueError: boom in the child" in failed.stderr
    (project / "killed.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    killed = run_python_module("killed", [], cwd=project, env=dict(os.environ), timeout=60)
    assert killed.returncode == -signal.SIGKILL


def test_concurrent_runs_keep_their_own_output(project: Path):
    results: dict[str, subprocess.CompletedProcess[str]] = {}

    def run(tag: str) -> None:
        results[tag] = _run(project, tag, PROBE_VALUE=tag)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("one", "two", "three")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for tag, result in results.items():
        seen = json.loads(result.stdout)
        assert seen["argv"] == [tag] and seen["env"] == tag


SLEEPER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    time.sleep(120)
    """
)


def _sleeper_started(pid_file: Path) -> bool:
    return pid_file.is_file() and len(pid_file.read_text().split()) == 2


def _sleeper_pids(pid_file: Path) -> list[int]:
    # A loaded machine may take a while to start it; the wait ends as soon as it has.
    assert wait_for(lambda: _sleeper_started(pid_file), timeout=60), "never started"
    return [int(p) for p in pid_file.read_text().split()]


def _warm(tmp_path: Path) -> None:
    """Have the warm interpreter finish its imports, so a short timeout or an early
    cancel is spent on the run itself, not on starting the server."""
    (tmp_path / "noop.py").write_text("")
    assert run_python_module("noop", [], cwd=tmp_path, env=dict(os.environ), timeout=300).returncode == 0


def test_a_timeout_kills_the_child_and_what_it_started(tmp_path: Path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pid_file = tmp_path / "pids"
    _warm(tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        run_python_module("sleeper", [str(pid_file)], cwd=tmp_path, env=dict(os.environ), timeout=4)
    for pid in _sleeper_pids(pid_file):
        assert wait_for(lambda pid=pid: process_gone(pid)), f"{pid} still runs after the timeout"


def test_a_cancelled_call_kills_its_warm_child(tmp_path: Path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pid_file = tmp_path / "pids"
    _warm(tmp_path)
    event = threading.Event()

    def cancel_once_started() -> None:
        wait_for(lambda: _sleeper_started(pid_file), timeout=60)
        event.set()

    threading.Thread(target=cancel_once_started, daemon=True).start()
    with cancellable(event), pytest.raises(CallCancelledError):
        run_python_module("sleeper", [str(pid_file)], cwd=tmp_path, env=dict(os.environ), timeout=120)
    for pid in _sleeper_pids(pid_file):
        assert wait_for(lambda pid=pid: process_gone(pid)), f"{pid} still runs after the cancel"


def test_a_killed_caller_takes_the_warm_interpreter_and_its_children_along(tmp_path: Path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pid_file = tmp_path / "pids"
    caller = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from skill.porting.child_process import run_python_module
        cwd = Path({str(tmp_path)!r})
        run_python_module("sleeper", [{str(pid_file)!r}], cwd=cwd, env=dict(os.environ), timeout=300)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", caller], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    child, grandchild = _sleeper_pids(pid_file)
    zygote = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in (child, grandchild, zygote):
        assert wait_for(lambda pid=pid: process_gone(pid)), f"{pid} still runs after its caller was killed"


def test_a_call_given_up_before_the_server_started_its_child_leaves_no_process(tmp_path: Path):
    """The caller times out while its fresh server still imports torch: when the server
    gets to the request it finds nobody listening, and kills the child it just forked."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "noop.py").write_text("")
    pid_file = tmp_path / "pids"
    caller = textwrap.dedent(
        f"""
        import os, subprocess, sys
        from pathlib import Path
        from skill.porting.child_process import run_python_module
        cwd, env = Path({str(tmp_path)!r}), dict(os.environ)
        try:
            run_python_module("sleeper", [{str(pid_file)!r}], cwd=cwd, env=env, timeout=0.2)
        except subprocess.TimeoutExpired:
            print("timed out", flush=True)
        # served in order: once this returns, the server has handled the sleeper's request
        run_python_module("noop", [], cwd=cwd, env=env, timeout=300)
        print("served", flush=True)
        sys.stdin.read()  # alive until the test is done: its exit would stop every child anyway
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", caller],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "timed out\n"
        assert proc.stdout.readline() == "served\n"
        # Killed at once, it never wrote its pids; had it run, they would be there by now.
        if wait_for(lambda: _sleeper_started(pid_file), timeout=3):
            for pid in _sleeper_pids(pid_file):
                assert wait_for(lambda pid=pid: process_gone(pid)), f"{pid} runs for a caller that gave up"
    finally:
        proc.kill()
        proc.wait()


def test_warm_children_can_be_turned_off(project: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(WARM_CHILDREN_ENV, "0")
    seen = json.loads(_run(project).stdout)
    assert seen["ppid"] == os.getpid() and not seen["torch_loaded"]


def test_warm_up_starts_the_interpreter_the_next_run_forks_from(project: Path):
    from skill.porting import child_process

    child_process.warm_up()
    started = child_process._ZYGOTE._process
    assert started is not None and started.poll() is None
    child_process.warm_up()  # running already: the same one
    assert child_process._ZYGOTE._process is started
    assert json.loads(_run(project).stdout)["ppid"] == started.pid


def test_a_request_of_any_size_reaches_the_child(project: Path):
    """A request is framed, not one read of the socket: 100 KB of environment (a socket read
    took ~32 KB of it and the server died on half a JSON document at 19fb638)."""
    big = "v" * 100_000
    result = _run(project, PROBE_VALUE=big, OTHER_BIG="w" * 300_000)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["env"] == big
    assert "Traceback" not in result.stderr


def test_a_killed_warm_interpreter_takes_the_child_and_what_it_started_along(tmp_path: Path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pid_file = tmp_path / "pids"
    _warm(tmp_path)
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["result"] = run_python_module(
                "sleeper", [str(pid_file)], cwd=tmp_path, env=dict(os.environ), timeout=300
            )
        except BaseException as e:  # reported below
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    child, grandchild = _sleeper_pids(pid_file)
    zygote = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(zygote, signal.SIGKILL)
    thread.join(60)
    for pid in (child, grandchild):
        assert wait_for(lambda pid=pid: process_gone(pid)), f"{pid} still runs after the warm interpreter was killed"
    assert "error" not in outcome, outcome
    result = outcome["result"]
    assert isinstance(result, subprocess.CompletedProcess) and result.returncode == -signal.SIGKILL
    # The next run starts a new warm interpreter.
    (tmp_path / "noop.py").write_text("")
    assert run_python_module("noop", [], cwd=tmp_path, env=dict(os.environ), timeout=300).returncode == 0


def test_a_caller_killed_while_the_warm_interpreter_imports_takes_it_along_at_once():
    """Its imports take seconds; the server notices its caller's death during them, not after."""
    caller = textwrap.dedent(
        """
        import time
        from skill.porting import child_process
        child_process.warm_up()
        print(child_process._ZYGOTE._process.pid, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", caller],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    zygote = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_for(lambda: process_gone(zygote), timeout=3), "the warm interpreter went on importing for nobody"


def test_a_stage_runs_under_a_40_kb_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every stage run hands its environment to the warm interpreter: at 19fb638 one 40 KB
    variable made every stage fail with two raw tracebacks."""
    from skill.porting.run_test_stage import run_stage_subprocess

    (tmp_path / "tests" / "archon").mkdir(parents=True)
    (tmp_path / "tests" / "archon" / "test_tiny.py").write_text(
        "import os\nimport pytest\n\n\n@pytest.mark.stage1\ndef test_stage1_args():\n"
        "    assert len(os.environ['ARCHON_TEST_BIG']) == 40_000\n"
    )
    monkeypatch.setenv("ARCHON_TEST_BIG", "b" * 40_000)
    result = run_stage_subprocess(tmp_path, "tiny", 1, timeout_s=300)
    assert result.passed, result.output_tail
    assert [t.outcome for t in result.tests] == ["passed"]
