"""Registry tools as ``archon-port`` commands: one command per tool, hand-written or generated.

The MCP face and the CLI iterate the same registry (:func:`skill.tools.tool_entries`). A tool
with a hand-written command (``analyze``, ``add``, ``check``, ``stage``, ``diverge``,
``export``: a report, a table, an override syntax) registers it with
:func:`add_tool_command`, restyling a few fields; every other tool gets a generated command
named after it (``copy_reference`` -> ``copy-reference``). Either way the options come from
the tool's input model (:mod:`skill.cli.tool_options`) and the call goes through
:func:`run_tool`, so a new registry entry is a new command and no command defines what a
tool takes a second time.

A command's options are added only when it is chosen: resolving a tool imports its step
module (torch, transformers), which ``archon-port --help``, ``serve`` and ``replay`` should
not pay for every step.

A generated command prints the result (a readable summary, ``--json`` for the model) and
exits 0, or 1 when the step's own result says ``passed: false``; bad input is one line
naming the problem and the option, and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel

from skill.cli.render import render_result
from skill.cli.tool_options import FieldOption, add_field_arguments, call_arguments, describe_problems, flags_of
from skill.codemod.workspace import Workspace
from skill.console import EXIT_BAD_INPUT, reports_bad_input
from skill.tools import InvalidArgumentsError, ToolEntry, get_tool, invoke, tool_entries

PROG = "archon-port"
EXIT_STATUSES = (
    "Exit status: 0 done; 1 the step ran and its result says passed: false; 2 bad input (one line naming "
    "the problem and the option)."
)
WORKSPACE_HELP = "project root holding archon_models/ (default: the project holding the current directory)"


@dataclass(frozen=True)
class ToolCommand:
    """A command that runs registry tool ``tool``, with the fields ``styles`` restyles."""

    name: str
    tool: str
    styles: Mapping[str, FieldOption] = field(default_factory=dict)

    @property
    def prog(self) -> str:
        return f"{PROG} {self.name}"


def command_name(tool: str) -> str:
    """The generated command of a tool: its name with dashes (``copy_reference`` -> ``copy-reference``)."""
    return tool.replace("_", "-")


class CommandParser(argparse.ArgumentParser):
    """``archon-port``'s parsers: a usage error is one line naming the fix, and exit 2."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", ToolSubParsers)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{PROG}: error: {' '.join(message.split())}; see '{self.prog} --help'\n")


class ToolSubParsers(argparse._SubParsersAction):
    """The sub-commands; a tool command's options are added when it is chosen (or listed)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.commands: dict[str, ToolCommand] = {}
        self._pending: dict[str, Callable[[], None]] = {}

    def defer(self, command: ToolCommand, populate: Callable[[], None]) -> None:
        self.commands[command.name] = command
        self._pending[command.name] = populate

    def populate(self, name: str) -> None:
        """Add the options of command ``name`` now (once)."""
        pending = self._pending.pop(name, None)
        if pending is not None:
            pending()

    def populate_all(self) -> None:
        for name in list(self._pending):
            self.populate(name)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values:
            self.populate(values[0])
        super().__call__(parser, namespace, values, option_string)


def _entry(tool: str) -> ToolEntry:
    for entry in tool_entries():
        if entry.name == tool:
            return entry
    raise ValueError(f"no registry tool {tool!r} for a command; registered: {[e.name for e in tool_entries()]}")


def add_tool_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    tool: str,
    run: Callable[[argparse.Namespace], int],
    *,
    styles: Mapping[str, FieldOption] | None = None,
    help: str | None = None,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Add command ``name`` running registry tool ``tool``; its options are the tool's input fields.

    ``help`` is its line in ``archon-port --help`` (default: the entry's title), ``description``
    its own help's text (default: the tool's description). The returned parser takes options
    that are not fields (``analyze --list``).
    """
    if not isinstance(subparsers, ToolSubParsers):
        raise TypeError("tool commands go on the sub-parsers of skill.cli.build_parser()")
    if tool in {c.tool for c in subparsers.commands.values()}:
        raise ValueError(f"tool {tool!r} already has a command; a tool has exactly one")
    entry = _entry(tool)
    command = ToolCommand(name=name, tool=tool, styles=dict(styles or {}))
    title = entry.title or tool
    parser = subparsers.add_parser(
        name, help=help or title[:1].lower() + title[1:], description=description, epilog=EXIT_STATUSES
    )
    parser.set_defaults(func=run, cli_command=command)

    def populate() -> None:
        resolved = get_tool(tool)
        if parser.description is None:
            parser.description = f"{resolved.description} (The {tool} tool of the MCP server.)"
        add_field_arguments(parser, resolved, command.styles)
        if "workspace" not in resolved.input_model.model_fields:
            parser.add_argument("--workspace", metavar="DIR", help=WORKSPACE_HELP)
        parser.add_argument("--json", action="store_true", help="print the result model as JSON")

    subparsers.defer(command, populate)
    return parser


ResultT = TypeVar("ResultT", bound=BaseModel)


class CommandInputError(ValueError):
    """Arguments the step refused, named by the options the person typed."""


def run_tool(args: argparse.Namespace, result_type: type[ResultT]) -> ResultT:
    """Run the tool of the parsed command ``args`` as the person at the keyboard (the paths they
    name are theirs to choose), recorded when ``--record`` is on; its result as ``result_type``."""
    command: ToolCommand = args.cli_command
    tool = get_tool(command.tool)
    workspace = Workspace(getattr(args, "workspace", None))
    try:
        result = invoke(
            tool.name,
            call_arguments(args, tool, workspace.root),
            workspace=workspace,
            # The person at the keyboard vouches for the paths they type: export's AReaL tree and
            # Python, a source folder anywhere on disk. The MCP face and replay never do
            # (skill.tools.prepare_request), whichever command or tool it is.
            allow_external=True,
            confine_sources=False,
        )
    except InvalidArgumentsError as error:
        problems = describe_problems(error.problems, flags_of(tool, command.styles))
        raise CommandInputError(f"{problems}. See '{command.prog} --help'.") from error
    if not isinstance(result, result_type):
        raise TypeError(f"tool {tool.name!r} returned {type(result).__name__}, not {result_type.__name__}")
    return result


def step_failed(result: BaseModel) -> bool:
    """Whether the step ran and its result says it did not pass (``passed: false``)."""
    return getattr(result, "passed", None) is False


def print_result(args: argparse.Namespace, result: BaseModel, render: Callable[[BaseModel], str]) -> None:
    """``--json``: the result model; else ``render``'s text."""
    sys.stdout.write((result.model_dump_json(indent=2) if args.json else render(result)) + "\n")


@reports_bad_input
def run_generated(args: argparse.Namespace) -> int:
    """A generated command: run the tool, print its result, 1 when it did not pass."""
    result = run_tool(args, BaseModel)
    print_result(args, result, render_result)
    return 1 if step_failed(result) else 0


def add_generated_command(subparsers: argparse._SubParsersAction, tool: str) -> None:
    """The generated command of registry tool ``tool`` (one without a hand-written command)."""
    name = command_name(tool)
    if name in subparsers.choices:
        raise ValueError(f"tool {tool!r} would be command {name!r}, which another command already is")
    add_tool_command(subparsers, name, tool, run_generated)
