"""Waiting on processes in the tests that kill, cancel or time out a child."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 15.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; its last value, as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def process_gone(pid: int) -> bool:
    """The process no longer runs: it does not exist, or it is a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
