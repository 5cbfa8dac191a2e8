"""What every command-line entry point of archon-port shares.

Both faces start from a shell: ``archon-port`` (:mod:`skill.cli`) and ``python -m
mcp_server``. They log to stderr the same way, unwind on SIGTERM as on Ctrl-C, end an
interrupt with one line and exit 130, and turn bad input into one line and exit 2. That
behaviour lives here, in the engine, so neither face imports the other.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from functools import wraps
from types import FrameType

from pydantic import ValidationError

from skill.codemod.workspace import ConcurrentEditError
from skill.errors import WorkerFailedError, step_error_message
from skill.tools import ToolBusyError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
INTERRUPTED_LINE = "archon-port: interrupted (an interrupted write is rolled back)\n"


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")


def configure_logging(verbose: bool) -> None:
    """Log to stderr (stdout carries results, or the MCP stdio stream)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_TERMINATED)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises ``SystemExit`` so cleanup (rollback, child processes) runs as on Ctrl-C."""
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave signals to it
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(error: BaseException) -> bool:
    """Whether ``error`` is Ctrl-C (also inside an exception group, as anyio's task groups raise it)."""
    if isinstance(error, KeyboardInterrupt):
        return True
    return isinstance(error, BaseExceptionGroup) and error.subgroup(KeyboardInterrupt) is not None


def _message(error: BaseException) -> str:
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'input'}: {e['msg']}" for e in error.errors())
    return step_error_message(error)


def error_line(error: BaseException | str) -> str:
    """``archon-port: error: ...`` on one line."""
    text = error if isinstance(error, str) else _message(error)
    return "archon-port: error: " + " ".join(text.split()) + "\n"


def reports_bad_input(run: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command: ValueError (pydantic's included) and OSError (a missing file, a
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
            return EXIT_BAD_INPUT
        except WorkerFailedError as error:
            sys.stderr.write(error_line(error))
            return 1

    return wrapper
