"""The unified-diff text a session stores a hand edit as: splitting it into file sections and
reading hunk headers. Shared by the session (which writes and applies patches) and by
:mod:`skill.porting.hand_written` (which names what a patch changed); it imports neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterator


def split_lines(text: str) -> list[str]:
    """``text`` split after each ``\\n`` only (``str.splitlines`` also splits on \\f, \\x1c, ...)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


HUNK_RE = re.compile(r"^@@ -(?P<start>\d+)(?:,(?P<count>\d+))? \+(?P<new_start>\d+)(?:,\d+)? @@")


class PatchError(ValueError):
    """A patch that does not apply to the file it names."""


def patch_sections(patch: str) -> Iterator[tuple[str, list[str]]]:
    """Each file section of a patch: the path it names and its lines."""
    for chunk in re.split(r"^diff --git ", patch, flags=re.MULTILINE)[1:]:
        lines = split_lines(chunk)
        header = lines[0]
        if " b/" not in header:
            raise PatchError(f"malformed patch header {('diff --git ' + header).strip()!r}")
        yield header.split(" b/", 1)[1].strip(), lines
