"""How a replayed tool call is compared with its recording.

A call's result and error are compared as structures (JSON trees: dicts key by key, lists
item by item), not as digests of their text, and every string on both sides is normalised
first: what belongs to the run rather than to the port reads the same in any run. That is
the host:port a collective connected to (gloo's ``Connection closed by peer
[127.0.0.1]:35534``), process ids, object addresses, clock times and durations written
into messages, on top of what recording already normalises (the workspace path, temporary
paths, fields marked volatile, floats to four significant digits). A session in which a
distributed run failed therefore replays when everything the port decides matches.

The recording applies the same normalisation (:func:`skill.session.normalise_text`), so
a result's digest is stable too; sessions recorded before keep their raw text and are
normalised here, on both sides, when compared.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from skill.session import CallRecord, ErrorInfo

# (pattern, replacement), applied in order. Each names run-specific text, not port facts.
_VOLATILE: tuple[tuple[re.Pattern[str], str], ...] = (
    # An endpoint: gloo's "[127.0.0.1]:35534", "127.0.0.1:4254", "localhost:29500", "[::1]:80".
    (re.compile(r"\[[0-9A-Fa-f.:]+\]:\d+|\b(?:\d{1,3}\.){3}\d{1,3}:\d+|\blocalhost:\d+"), "<endpoint>"),
    # A process id: "pid 4242", "pid=4242", "pid: 4242".
    (re.compile(r"\b(pid)([ =:]+)\d+\b", re.IGNORECASE), r"\1\2<pid>"),
    # An object's address in a repr: "at 0x7f53551528b0".
    (re.compile(r"\b0x[0-9a-f]{6,}\b"), "<address>"),
    # A clock time: "2026-12-04T10:00:00Z", "2026-12-04 10:00:00.123".
    (re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:\.\d+)?Z?\b"), "<time>"),
    # A duration: "3.2s", "60000ms", "12.5 s", "1.2 seconds".
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|sec|secs|seconds)\b"), "<duration>"),
)
# Floats are rounded to four significant digits when recorded; a value that lands on
# the other side of a rounding step in another run is still the same value.
_FLOAT_REL_TOL = 1e-3


def normalise_volatile(text: str) -> str:
    """``text`` with endpoints, process ids, addresses, clock times and durations replaced
    by placeholders (``<endpoint>``, ``<pid>``, ``<address>``, ``<time>``, ``<duration>``)."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def first_difference(expected: Any, actual: Any, where: str = "result") -> str | None:
    """The JSON path of the first structural difference between two plain values (dicts,
    lists, strings, numbers, booleans, None) after normalising their strings, with both
    values; ``None`` when they match."""
    if isinstance(expected, str) and isinstance(actual, str):
        if normalise_volatile(expected) == normalise_volatile(actual):
            return None
        return f"{where}: expected {expected!r}, got {actual!r}"
    if _is_number(expected) and _is_number(actual):
        if expected == actual or math.isclose(expected, actual, rel_tol=_FLOAT_REL_TOL):
            return None
        return f"{where}: expected {expected!r}, got {actual!r}"
    if type(expected) is not type(actual):
        return f"{where}: expected {expected!r}, got {actual!r}"
    if isinstance(expected, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                return f"{where}.{key}: missing (expected {expected[key]!r})"
            if key not in expected:
                return f"{where}.{key}: unexpected {actual[key]!r}"
            found = first_difference(expected[key], actual[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        for index, (a, b) in enumerate(zip(expected, actual, strict=False)):
            found = first_difference(a, b, f"{where}[{index}]")
            if found:
                return found
        if len(expected) != len(actual):
            return f"{where}: expected {len(expected)} items, got {len(actual)}"
        return None
    return None if expected == actual else f"{where}: expected {expected!r}, got {actual!r}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class CallDifference(BaseModel):
    """Where a replayed call differs from its recording."""

    kind: str  # "outcome", "fixed", "error", "result" or "files"
    detail: str


def compare_files(expected: dict[str, str | None], actual: dict[str, str | None]) -> str | None:
    """The first file whose content hash differs (``None``: deleted), or ``None``."""
    for rel in sorted(set(expected) | set(actual)):
        if rel not in actual:
            return f"{rel}: the recording changed it (to {expected[rel]}), the replay did not"
        if rel not in expected:
            return f"{rel}: the replay changed it (to {actual[rel]}), the recording did not"
        got = actual[rel]
        if expected[rel] != got:
            state = "deleted" if got is None else f"sha256 {got[:12]}"
            return f"{rel}: expected sha256 {str(expected[rel])[:12]}, got {state}"
    return None


def compare_call(recorded: CallRecord, replayed: CallRecord) -> CallDifference | None:
    """The first difference between a recorded call and its replay: outcome, error (type,
    and message normalised), result (structurally; by digest when the recording kept only
    the digest), files."""
    if recorded.ok != replayed.ok:
        if recorded.ok:
            return CallDifference(kind="outcome", detail=f"recorded success, replay failed: {replayed.error}")
        # An engine fix: a plain replay stops on it, a re-record takes it (the session then
        # records the call as succeeding).
        return CallDifference(kind="fixed", detail=f"recorded failure ({recorded.error}), replay succeeded")
    if not recorded.ok:
        error = _compare_errors(recorded.error, replayed.error)
        if error:
            return CallDifference(kind="error", detail=error)
    if recorded.result_digest != replayed.result_digest:
        if recorded.result is None or replayed.result is None:
            # Only the digest was kept (a large result): nothing to compare but the digests.
            return CallDifference(kind="result", detail=f"digest {recorded.result_digest} != {replayed.result_digest}")
        found = first_difference(recorded.result, replayed.result)
        if found:
            return CallDifference(kind="result", detail=found)
    files = compare_files(recorded.files, replayed.files)
    if files:
        return CallDifference(kind="files", detail=files)
    return None


def _compare_errors(expected: ErrorInfo | None, actual: ErrorInfo | None) -> str | None:
    if expected is None or actual is None:
        return None if expected is actual else f"expected {expected}, got {actual}"
    if expected.type != actual.type or normalise_volatile(expected.message) != normalise_volatile(actual.message):
        return f"expected {expected}, got {actual}"
    return None


__all__ = ["CallDifference", "compare_call", "compare_files", "first_difference", "normalise_volatile"]
