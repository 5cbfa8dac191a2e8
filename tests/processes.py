"""Waiting on processes in the tests that kill, cancel or time out a child."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_for(predicate: Callable[[], object], timeout: float = 15.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; its last value, as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def process_gone(pid: int) -> bool:
    """The process no longer runs: it does not exist, or it is a zombie.

    Its ``/proc`` entry is read directly, not after a ``kill(pid, 0)`` probe: a zombie reaped
    between the probe and the read would otherwise make the read fail instead of answer.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
