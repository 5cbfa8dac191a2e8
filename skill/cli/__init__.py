"""The ``archon-port`` command line: argument handling only, the work is in the engine."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import signal
import sys
from collections.abc import Iterator

from skill import __version__
from skill.cli._errors import error_line

# One module per sub-command under skill/cli/, each defining
# ``register(subparsers) -> None`` that adds its parser and sets ``func``
# (``func(args) -> int`` returns the exit status).
COMMAND_MODULES: tuple[str, ...] = ("serve", "replay", "analyze", "add", "check", "stage", "diverge", "export")


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")


def configure_logging(verbose: bool) -> None:
    """Log to stderr (stdout carries results, or the MCP stdio stream)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="archon-port",
        description="Port a HuggingFace decoder-only architecture into Archon and prove it correct.",
    )
    parser.add_argument("--version", action="version", version=f"archon-port {__version__}")
    add_verbose_option(parser)
    parser.add_argument(
        "--record",
        metavar="SESSION",
        help="append every tool call this command makes to the session file SESSION (JSON Lines); "
        "check it later with `archon-port replay SESSION`",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"skill.cli.{name}").register(subparsers)
    return parser


EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def _terminate(signum, frame) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        with sigterm_unwinds():
            if args.record:
                from skill.session import recording

                with recording(args.record, getattr(args, "workspace", None)):
                    return int(args.func(args) or 0)
            return int(args.func(args) or 0)
    except (ValueError, OSError) as error:  # bad input found outside a sub-command (a corrupt --record file)
        sys.stderr.write(error_line(error))
        return 2
    except BaseException as error:
        if not interrupted(error):
            raise
        sys.stderr.write("archon-port: interrupted (an interrupted write is rolled back)\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
