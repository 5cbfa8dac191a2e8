"""The ``archon-port`` command line: argument handling only, the work is in the engine."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from skill import __version__

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if args.record:
        from skill.session import recording

        with recording(args.record, getattr(args, "workspace", None)):
            return int(args.func(args) or 0)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
