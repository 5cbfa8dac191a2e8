"""Errors every face reports the same way, and the pointer to the hand-port playbook.

A step that fails because the engine has no edit for a feature, or because a file the
step needs is missing, is where an agent leaves the automatic path: the message then
ends with :data:`HAND_PORT_POINTER`, the section of SKILL.md that says what to write by
hand and how to prove it.
"""

from __future__ import annotations

HAND_PORT_SECTION = "Porting by hand"
HAND_PORT_POINTER = f"see SKILL.md § {HAND_PORT_SECTION}"


class UnsupportedFeatureError(ValueError):
    """The family has features no reference or edit reproduces; ``features`` names them."""

    def __init__(self, message: str, features: list[str]):
        super().__init__(message)
        self.features = list(features)


class WorkerFailedError(RuntimeError):
    """A child process a step ran (a divergence run, a trace) ended without its result.

    The message is one line: what failed and the child's last error line (its whole
    output is logged at debug level, not shown).
    """


def last_error_line(stderr: str, default: str = "the worker exited without a result") -> str:
    """The last non-empty line a child wrote to stderr: its exception, after the traceback."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else default


def points_to_hand_port(error: BaseException) -> bool:
    """Whether the way past ``error`` is the hand-port section (an unsupported feature, a missing
    file, or a message that names the section itself)."""
    return isinstance(error, UnsupportedFeatureError | FileNotFoundError) or HAND_PORT_POINTER in str(error)


def step_error_message(error: BaseException) -> str:
    """``str(error)``, ending with the hand-port pointer where that is the way past it."""
    message = str(error)
    if points_to_hand_port(error) and HAND_PORT_POINTER not in message:
        message = f"{message.rstrip()} ({HAND_PORT_POINTER})"
    return message
