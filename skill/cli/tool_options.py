"""A step's pydantic input model as command-line options, and a parsed command line back as arguments.

Every field of the input model is an option, typed and documented from the field itself, so
a command takes exactly what the tool takes over MCP:

- the first required field (``model_name`` for a package step, ``source`` for the analysis)
  is positional; every other field is ``--field-name``, required when the field is;
- ``bool``: ``--flag`` sets it; a field whose default is true is ``--no-flag``;
- ``int``, ``float``, ``str``, a path: one value of that type; a ``Literal`` or ``Enum``: its choices;
- a list: repeat the option, one item each, or give a JSON array (``'[]'`` is the empty list);
- a dict: repeat ``KEY=VALUE``; ``VALUE`` is read as JSON when that is a valid value of the
  dict's value type (``8.0``, ``null``, ``'{"factor": 2.0}'``), else as text;
- anything else: JSON when valid, else text;
- ``workspace``: ``--workspace DIR`` (default: the project holding the current directory); it
  chooses the workspace of the call and is never an argument of its own.

An option left out is left out of the arguments, so the step's own default applies (and the
recorded call holds what the person typed). A hand-written command restyles a field with
:class:`FieldOption` (another flag, positional or not, its own parser) without redefining it.
Paths a person types are relative to the current directory and are made absolute here (the
engine resolves a relative path from the workspace root, as an MCP client means it).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typing_extensions
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from skill.tools import Tool, looks_like_path

WORKSPACE_FIELD = "workspace"
# Names the CLI keeps on the parsed namespace for itself; no input field may take one.
RESERVED_DESTS = frozenset({"command", "func", "json", "verbose", "record", "version", "help", "cli_command"})


@dataclass(frozen=True)
class FieldOption:
    """How a hand-written command shows one field, where the generic rule does not suit it.

    ``flag``: the option string instead of ``--field-name`` (``--name``, ``--override``);
    ``positional``: a positional argument (``optional``: it may be left out);
    ``parse``: turns the one string given into the field's whole value (``--stages 1,2,3``);
    ``metavar`` and ``help`` replace the generated ones.
    """

    flag: str | None = None
    positional: bool = False
    optional: bool = False
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    help: str | None = None


# --- reading an annotation --------------------------------------------------------------


def _strip(annotation: Any) -> Any:
    """The annotation without ``Annotated`` metadata and type aliases."""
    while True:
        if isinstance(annotation, typing_extensions.TypeAliasType):
            annotation = annotation.__value__
        elif typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        else:
            return annotation


def _unwrap(annotation: Any) -> Any:
    """The annotation without metadata, aliases and ``None`` in a union (``str | None`` is ``str``)."""
    annotation = _strip(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return annotation


def _is_path(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, os.PathLike)


def _scalar_type(annotation: Any) -> Callable[[str], Any] | None:
    """What reads one value of an ``int``/``float``/``str`` field (a path is a string here), else None."""
    if annotation in (int, float, str):
        return typing.cast(Callable[[str], Any], annotation)
    if _is_path(annotation):
        return str
    return None


def _choices(annotation: Any) -> list[Any] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [member.value for member in annotation]
    return None


def _value_parser(annotation: Any) -> Callable[[str], Any]:
    """One command-line string as a value of ``annotation``: its JSON when that is a valid
    value, else the text when that is; otherwise an error naming what the type wants."""
    if _strip(annotation) is str:
        return str
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)

    def parse(raw: str) -> Any:
        try:
            candidates = [json.loads(raw), raw]
        except json.JSONDecodeError:
            candidates = [raw]
        problem = ""
        for candidate in candidates:
            try:
                adapter.validate_python(candidate)
            except ValidationError as error:
                problem = problem or error.errors()[0]["msg"]
                continue
            return candidate
        raise argparse.ArgumentTypeError(f"invalid value {raw!r}: {problem}")

    return parse


# --- the actions that build a list or a dict from repeated options ----------------------


@dataclass(frozen=True)
class _Items:
    """A JSON array given for a list option: its items, not one item."""

    items: list[Any]


def _list_item_parser(item_annotation: Any) -> Callable[[str], Any]:
    parse_item = _value_parser(item_annotation)

    def parse(raw: str) -> Any:
        if raw.lstrip().startswith("["):
            try:
                decoded = json.loads(raw)
            except json.JSONDecodeError:
                decoded = None
            if isinstance(decoded, list):
                return _Items(decoded)
        return parse_item(raw)

    return parse


class _ExtendList(argparse.Action):
    """Each occurrence adds one item (or a JSON array's items) to the list."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = list(getattr(namespace, self.dest, None) or [])
        current.extend(values.items if isinstance(values, _Items) else [values])
        setattr(namespace, self.dest, current)


def _key_value_parser(value_annotation: Any) -> Callable[[str], tuple[str, Any]]:
    parse_value = _value_parser(value_annotation)

    def parse(raw: str) -> tuple[str, Any]:
        key, sep, value = raw.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{raw!r}: write KEY=VALUE")
        return key.strip(), parse_value(value)

    return parse


class _SetItems(argparse.Action):
    """Each ``KEY=VALUE`` occurrence sets one entry of the dict."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = dict(getattr(namespace, self.dest, None) or {})
        key, value = values
        current[key] = value
        setattr(namespace, self.dest, current)


# --- fields as options ---------------------------------------------------------------------


def option_flag(name: str, info: FieldInfo, style: FieldOption | None = None) -> str:
    """The option string of a field: the hand-written one, else ``--field-name`` (``--no-...``
    for a flag that turns a true default off)."""
    if style is not None and style.flag is not None:
        return style.flag
    dashed = name.replace("_", "-")
    if _unwrap(info.annotation) is bool and info.default is True:
        return f"--no-{dashed}"
    return f"--{dashed}"


def positional_field(tool: Tool) -> str | None:
    """The field a generated command takes as its positional argument: the first required one,
    when it holds a single value (a step on a package: ``model_name``)."""
    for name, info in tool.input_model.model_fields.items():
        if name != WORKSPACE_FIELD and info.is_required():
            annotation = _unwrap(info.annotation)
            return name if _scalar_type(annotation) is not None or _choices(annotation) else None
    return None


def _positionals(tool: Tool, styles: Mapping[str, FieldOption]) -> list[str]:
    """The positional fields: the hand-written ones when a command names any, else the generic one."""
    chosen = [name for name, style in styles.items() if style.positional]
    if chosen:
        return [name for name in tool.input_model.model_fields if name in chosen]
    generic = positional_field(tool)
    return [generic] if generic is not None else []


def _shown_default(info: FieldInfo) -> Any:
    if info.is_required():
        return None
    default = info.get_default(call_default_factory=True)
    return None if default in (None, False, True, "", [], {}) else default


def _help(info: FieldInfo, style: FieldOption | None, extra: str = "") -> str:
    text = (style.help if style is not None and style.help else None) or info.description or ""
    notes = [extra] if extra else []
    default = _shown_default(info)
    if default is not None and not (style is not None and style.help):
        notes.append(f"default: {default}")
    if notes:
        text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes)
    return text.replace("%", "%%")


def add_field_arguments(
    parser: argparse.ArgumentParser, tool: Tool, styles: Mapping[str, FieldOption] | None = None
) -> None:
    """Add one option (or positional) per input field of ``tool`` to ``parser``.

    ``styles`` restyles fields by name (hand-written commands); a generated command passes none.
    """
    styles = dict(styles or {})
    fields = tool.input_model.model_fields
    unknown = sorted(set(styles) - set(fields))
    if unknown:
        raise ValueError(f"the command of {tool.name} restyles {unknown}, not fields of {tool.input_model.__name__}")
    clash = sorted(set(fields) & RESERVED_DESTS)
    if clash:
        raise ValueError(
            f"{tool.name}: input fields {clash} clash with the CLI's own options; rename them in "
            f"{tool.input_model.__name__}"
        )
    positionals = _positionals(tool, styles)
    for name, info in fields.items():
        style = styles.get(name)
        if name == WORKSPACE_FIELD:
            parser.add_argument("--workspace", metavar="DIR", help=_help(info, style))
        elif name in positionals:
            _add_positional(parser, name, info, style)
        else:
            _add_option(parser, name, info, style)


def _add_positional(parser: argparse.ArgumentParser, name: str, info: FieldInfo, style: FieldOption | None) -> None:
    annotation = _unwrap(info.annotation)
    kwargs: dict[str, Any] = {
        "default": argparse.SUPPRESS,
        "metavar": (style.metavar if style is not None else None) or name,
        "help": _help(info, style),
    }
    if style is not None and style.optional:
        kwargs["nargs"] = "?"
    if style is not None and style.parse is not None:
        kwargs["type"] = style.parse
    elif (choices := _choices(annotation)) is not None:
        kwargs["choices"] = choices
    else:
        kwargs["type"] = _scalar_type(annotation) or _value_parser(info.annotation)
    parser.add_argument(name, **kwargs)


def _add_option(parser: argparse.ArgumentParser, name: str, info: FieldInfo, style: FieldOption | None) -> None:
    annotation = _unwrap(info.annotation)
    origin = typing.get_origin(annotation)
    metavar = style.metavar if style is not None else None
    options: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": name}
    if style is not None and style.parse is not None:
        options.update(type=style.parse, metavar=metavar or name.upper(), help=_help(info, style))
    elif annotation is bool:
        turns_off = info.default is True
        extra = "on unless this flag is given" if turns_off and not (style is not None and style.help) else ""
        options.update(action="store_false" if turns_off else "store_true", help=_help(info, style, extra))
    elif origin in (list, tuple, set, frozenset):
        item = (typing.get_args(annotation) or (Any,))[0]
        options.update(
            action=_ExtendList,
            type=_list_item_parser(item),
            metavar=metavar or name.upper(),
            help=_help(info, style, "repeat it, one item each, or give a JSON array"),
        )
    elif origin is dict:
        value = (typing.get_args(annotation) or (str, Any))[1]
        options.update(
            action=_SetItems,
            type=_key_value_parser(value),
            metavar=metavar or "KEY=VALUE",
            help=_help(info, style, "repeat it; VALUE is read as JSON when it parses, else as text"),
        )
    elif (choices := _choices(annotation)) is not None:
        options.update(choices=choices, help=_help(info, style))
    else:
        options.update(
            type=_scalar_type(annotation) or _value_parser(info.annotation),
            metavar=metavar or name.upper(),
            help=_help(info, style),
        )
    if info.is_required() and annotation is not bool:
        options["required"] = True
    parser.add_argument(option_flag(name, info, style), **options)


# --- a parsed command line as the step's arguments ----------------------------------------


def call_arguments(args: argparse.Namespace, tool: Tool, root: Path) -> dict[str, Any]:
    """The arguments the person gave, by field name, as an MCP client would send them.

    A path they typed is read from the current directory (a model_type such as ``mistral``
    stays a name): relative to the workspace ``root`` when it lies inside it, so a recorded
    call replays in a copy of the workspace, else absolute.
    """
    arguments: dict[str, Any] = {}
    path_like = {*tool.entry.path_fields, *tool.entry.external_paths, *tool.entry.program_paths}
    for name, info in tool.input_model.model_fields.items():
        if name == WORKSPACE_FIELD or not hasattr(args, name):
            continue
        value = getattr(args, name)
        names_a_path = _is_path(_unwrap(info.annotation)) or (
            name in path_like and isinstance(value, str) and (looks_like_path(value) or Path(value).exists())
        )
        if names_a_path and isinstance(value, str) and value:
            value = _as_typed(value, root)
        arguments[name] = value
    return arguments


def _as_typed(value: str, root: Path) -> str:
    """A path typed at the shell: relative to ``root`` when inside it, else absolute."""
    path = Path(os.path.abspath(os.path.expanduser(value)))
    try:
        return path.relative_to(root).as_posix() or "."
    except ValueError:
        return str(path)


def flags_of(tool: Tool, styles: Mapping[str, FieldOption] | None = None) -> dict[str, str]:
    """Each field as the person types it: ``--reference``, or the positional's name."""
    styles = dict(styles or {})
    positionals = _positionals(tool, styles)
    flags: dict[str, str] = {}
    for name, info in tool.input_model.model_fields.items():
        style = styles.get(name)
        if name in positionals:
            flags[name] = (style.metavar if style is not None else None) or name
        else:
            flags[name] = option_flag(name, info, style)
    return flags


def describe_problems(problems: Sequence[tuple[str, str]], flags: Mapping[str, str]) -> str:
    """``--flag (field): problem; ...`` for the fields a step's validation refused (pydantic's
    ``Value error, `` prefix dropped: the engine's message is the whole story)."""
    parts = []
    for field, problem in problems:
        problem = problem.removeprefix("Value error, ").rstrip(".")
        flag = flags.get(field.split(".", 1)[0])
        parts.append(f"{flag} ({field}): {problem}" if flag and flag != field else f"{field}: {problem}")
    return "; ".join(parts)
