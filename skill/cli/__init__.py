"""The ``archon-port`` command line: argument handling only, the work is in the engine.

Every tool of the registry is a command (the MCP server serves the same list): the
hand-written ones below, and a generated one for each other tool
(:mod:`skill.cli.tool_command`). ``serve`` and ``replay`` are the CLI's own.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from skill import __version__
from skill.cli.tool_command import CommandParser, ToolSubParsers, add_generated_command
from skill.console import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    INTERRUPTED_LINE,
    add_verbose_option,
    configure_logging,
    error_line,
    interrupted,
    sigterm_unwinds,
)
from skill.tools import tool_entries

# The hand-written commands of registry tools: one module each under skill/cli/, naming its
# tool (``TOOL``) and defining ``register(subparsers)``, which adds the command through
# skill.cli.tool_command.add_tool_command (its options are the tool's input fields) and sets
# ``func`` (``func(args) -> int`` returns the exit status). Every other tool gets a generated command.
TOOL_COMMAND_MODULES: tuple[str, ...] = ("analyze", "add", "check", "stage", "diverge", "export")
# The CLI's own commands, which run no tool.
OWN_COMMAND_MODULES: tuple[str, ...] = ("serve", "replay")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
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
    modules = [importlib.import_module(f"skill.cli.{name}") for name in TOOL_COMMAND_MODULES]
    hand_written = {module.TOOL: module for module in modules}
    for entry in tool_entries():  # in playbook order, as the MCP server lists them
        module = hand_written.pop(entry.name, None)
        if module is not None:
            module.register(subparsers)
        else:
            add_generated_command(subparsers, entry.name)
    if hand_written:
        raise ValueError(f"commands {sorted(m.__name__ for m in hand_written.values())} name tools the registry lacks")
    for name in OWN_COMMAND_MODULES:
        importlib.import_module(f"skill.cli.{name}").register(subparsers)
    return parser


def sub_commands(parser: argparse.ArgumentParser) -> ToolSubParsers:
    """The sub-commands of a parser :func:`build_parser` made."""
    for action in parser._actions:
        if isinstance(action, ToolSubParsers):
            return action
    raise ValueError("the parser has no archon-port sub-commands")


def command_tools(parser: argparse.ArgumentParser | None = None) -> dict[str, str | None]:
    """Every command and the registry tool it runs (None: the CLI's own, ``serve`` and ``replay``)."""
    commands = sub_commands(parser or build_parser())
    return {name: (commands.commands[name].tool if name in commands.commands else None) for name in commands.choices}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        with sigterm_unwinds():
            if args.record:
                from skill.session import recording

                with recording(args.record, getattr(args, "workspace", None)):
                    return int(args.func(args) or 0)
            return int(args.func(args) or 0)
    except (ValueError, OSError) as error:  # bad input found outside a sub-command (a corrupt --record file)
        sys.stderr.write(error_line(error))
        return EXIT_BAD_INPUT
    except BaseException as error:
        if not interrupted(error):
            raise
        sys.stderr.write(INTERRUPTED_LINE)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
