"""The process helpers the kill/cancel/timeout tests rely on answer for every state a child passes through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import process_gone, wait_for


def test_a_running_process_is_not_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_gone(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_zombie_and_a_reaped_process_are_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    # not waited on yet: once it exits it stays a zombie
    assert wait_for(lambda: process_gone(proc.pid))
    proc.wait()
    assert process_gone(proc.pid)


def test_a_process_reaped_while_being_read_is_gone(monkeypatch: pytest.MonkeyPatch):
    """The race CI hit: the ``/proc`` entry vanishes between finding the process and reading its state."""

    def vanished(self: Path, *args: object, **kwargs: object) -> str:
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "read_text", vanished)
    assert process_gone(1)
