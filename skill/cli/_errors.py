"""Turn the engine's bad-input errors into one readable line and exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps

from pydantic import ValidationError

from skill.errors import step_error_message


def _message(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'input'}: {e['msg']}" for e in error.errors())
    return step_error_message(error)


def reports_bad_input(run: Callable[..., int]) -> Callable[..., int]:
    """Wrap a sub-command: ValueError (pydantic's included), FileNotFoundError and
    FileExistsError print ``archon-port: error: ...`` and return 2 instead of a traceback; an
    unsupported feature or a missing file also points to SKILL.md's hand-port section."""

    @wraps(run)
    def wrapper(*args, **kwargs) -> int:
        try:
            return run(*args, **kwargs)
        except (ValueError, FileNotFoundError, FileExistsError) as error:
            sys.stderr.write(f"archon-port: error: {_message(error)}\n")
            return 2

    return wrapper
