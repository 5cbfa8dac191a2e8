"""Turn the engine's bad-input errors into one readable line and exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps

from pydantic import ValidationError

from skill.codemod.workspace import ConcurrentEditError
from skill.errors import WorkerFailedError, step_error_message
from skill.tools import ToolBusyError


def _message(error: BaseException) -> str:
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'input'}: {e['msg']}" for e in error.errors())
    return step_error_message(error)


def error_line(error: BaseException) -> str:
    """``archon-port: error: ...`` on one line."""
    return "archon-port: error: " + " ".join(_message(error).split()) + "\n"


def reports_bad_input(run: Callable[..., int]) -> Callable[..., int]:
    """Wrap a sub-command: ValueError (pydantic's included) and OSError (a missing file, a
    name too long for the file system, ...) print ``archon-port: error: ...`` on one line
    and return 2 instead of a traceback; an unsupported feature or a missing file also
    points to SKILL.md's hand-port section. A worker process that failed (a divergence
    run) is one line too, with exit status 1: the input was fine, the work failed."""

    @wraps(run)
    def wrapper(*args, **kwargs) -> int:
        try:
            return run(*args, **kwargs)
        except (ValueError, OSError, ToolBusyError, ConcurrentEditError) as error:
            sys.stderr.write(error_line(error))
            return 2
        except WorkerFailedError as error:
            sys.stderr.write(error_line(error))
            return 1

    return wrapper
