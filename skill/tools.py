"""The registry of engine steps: the one list every face of archon-port iterates.

The MCP server exposes each entry as a tool, the CLI's ``--record`` records calls made
through :func:`invoke`, and ``archon-port replay`` re-runs recorded calls by name. An
entry is one declarative line (:class:`ToolEntry`) naming the step function by import
path; the input and result models and the description are read from the function
itself, so the schema an agent sees is exactly the one the engine validates.

A step is ``def step(request: SomeInput) -> SomeResult``: one positional parameter
annotated with a pydantic model, a pydantic return annotation, and a docstring whose
first paragraph tells an agent what the step does and when to use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import importlib
import inspect
import logging
import os
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from skill.codemod import journal
from skill.codemod.workspace import Workspace, WorkspaceError, cancellable

logger = logging.getLogger(__name__)

DEFAULT_LOCK_TIMEOUT_S = 300.0
# The lock every package-level call shares and a call on a not-yet-named package holds
# exclusively; no package name can start with an underscore.
WORKSPACE_LOCK = "_workspace"


def state_dir(workspace: Workspace, *parts: str) -> Path:
    """``<workspace>/.archon-port/<parts>``, created (see :meth:`Workspace.state_dir`)."""
    return workspace.state_dir(*parts)


class ToolEntry(BaseModel):
    """One registry line: which function is the step and how it behaves.

    The annotations map one to one onto MCP's tool hints: ``read_only`` (changes no
    file), ``destructive`` (may overwrite or delete what is there), ``idempotent``
    (a second identical call changes nothing).
    """

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="tool name, also the recorded name")
    target: str = Field(description="'module.path:function' of the step")
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = True
    package_field: str | None = Field(
        default=None,
        description="input field naming the archon_models package the call reads or changes; "
        "calls on one package are serialised by a shared/exclusive lock",
    )
    path_fields: tuple[str, ...] = Field(
        default=(),
        description="str input fields that may hold a filesystem path; confined to the workspace "
        "when their value names an existing path or looks like one",
    )
    external_paths: tuple[str, ...] = Field(
        default=(),
        description="Path input fields naming a tree outside the workspace that the caller asks the step "
        "to work on (export's AReaL checkout); resolved to absolute paths and left unconfined only when "
        "the face vouches for its caller (the CLI: the person at the keyboard), confined like every other "
        "path otherwise (an MCP client, a replayed session file)",
    )
    program_paths: tuple[str, ...] = Field(
        default=(),
        description="Path input fields naming a program the step runs (export's python); taken only when "
        "the face vouches for its caller (the CLI), refused from an MCP client or a session file: no "
        "confinement makes running a program a client chose safe",
    )
    long_running: bool = Field(default=False, description="the server reports progress while it runs")
    title: str | None = Field(
        default=None,
        description="a few words for people: the MCP tool's title and the CLI command's line in "
        "`archon-port --help` (read without importing the step)",
    )

    @field_validator("target")
    @classmethod
    def _check_target(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if not sep or not module or not attr.isidentifier():
            raise ValueError(f"target {value!r} must look like 'package.module:function'")
        return value


# The engine's steps, in playbook order. One line per step; ENGINE and ANALYZER add
# their own lines here as their functions land.
TOOL_ENTRIES: tuple[ToolEntry, ...] = (
    ToolEntry(
        name="analyze_hf_model",
        title="Analyse a HuggingFace model family",
        target="skill.analysis.analyze:analyze_hf_model",
        read_only=True,
        path_fields=("source",),
    ),
    ToolEntry(
        name="copy_reference",
        title="Copy the nearest reference package",
        target="skill.porting.copy_reference:copy_reference",
        destructive=True,
        package_field="model_name",
    ),
    ToolEntry(
        name="edit_args",
        title="Write the args dataclass and from_hf_config",
        target="skill.porting.edit_args:edit_args",
        package_field="model_name",
        path_fields=("source",),
    ),
    ToolEntry(
        name="edit_model",
        title="Apply the feature edits to model.py",
        target="skill.porting.edit_model:edit_model",
        package_field="model_name",
        path_fields=("source",),
    ),
    ToolEntry(
        name="set_rope",
        title="Write or re-export the RoPE",
        target="skill.porting.set_rope:set_rope",
        package_field="model_name",
        path_fields=("source",),
    ),
    ToolEntry(
        name="edit_adapter_map",
        title="Derive or edit the state-dict adapter map",
        target="skill.porting.edit_adapter_map:edit_adapter_map",
        destructive=True,
        package_field="model_name",
        path_fields=("source",),
    ),
    ToolEntry(
        name="write_parallelize",
        title="Write the TP/EP parallelize plan",
        target="skill.porting.write_parallelize:write_parallelize",
        package_field="model_name",
        path_fields=("source",),
    ),
    ToolEntry(
        name="register_spec",
        title="Write spec.py and register the package",
        target="skill.porting.register_spec:register_spec",
        package_field="model_name",
    ),
    ToolEntry(
        name="check_package",
        title="Check for the guide's common mistakes",
        target="skill.porting.check_package:check_package",
        read_only=True,
        package_field="model_name",
        path_fields=("source",),
    ),
    ToolEntry(
        name="run_test_stage",
        title="Run one test stage",
        target="skill.porting.run_test_stage:run_test_stage",
        package_field="model_name",
        long_running=True,
    ),
    ToolEntry(
        name="port_model",
        title="Port a family end to end",
        target="skill.porting.port_model:port_model",
        destructive=True,
        package_field="model_name",
        path_fields=("source",),
        long_running=True,
    ),
    ToolEntry(
        name="locate_divergence",
        title="Find the first module that differs from HF",
        target="skill.porting.locate_divergence:locate_divergence",
        read_only=True,
        package_field="model_name",
        long_running=True,
    ),
    ToolEntry(
        name="export_to_areal",
        title="Export a package into AReaL and prove it there",
        target="skill.areal.export:export_to_areal",
        destructive=True,
        package_field="model_name",
        external_paths=("areal",),
        program_paths=("python",),
        long_running=True,
    ),
)


@dataclass(frozen=True)
class Tool:
    """A registry entry resolved to its function and pydantic models."""

    entry: ToolEntry
    function: Callable[[BaseModel], BaseModel]
    input_model: type[BaseModel]
    result_model: type[BaseModel]
    description: str

    @property
    def name(self) -> str:
        return self.entry.name

    def package_of(self, request: BaseModel) -> str | None:
        """The archon_models package this call reads or changes, if the entry names one."""
        field = self.entry.package_field
        if field is None:
            return None
        value = getattr(request, field, None)
        return str(value) if value else None


class ToolRegistryError(ValueError):
    """A registry entry whose target cannot be a step (bad signature, missing module)."""


class ToolBusyError(RuntimeError):
    """Another call holds the package this call needs; raised after waiting ``timeout``."""


class InvalidArgumentsError(ValueError):
    """Arguments that do not validate against a step's input model.

    ``problems`` lists ``(field path, message)`` for each offending field, so a face can
    show them one by one; the message names them all.
    """

    def __init__(self, tool: str, problems: list[tuple[str, str]]):
        self.tool = tool
        self.problems = problems
        listed = "; ".join(f"{field}: {problem}" for field, problem in problems)
        super().__init__(f"invalid arguments for {tool}: {listed}. See the tool's input schema.")


def resolve_entry(entry: ToolEntry) -> Tool:
    """Import an entry's function and read its input/result models from the annotations."""
    module_name, _, attr = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ToolRegistryError(f"tool {entry.name!r}: cannot import {module_name!r} ({e})") from e
    function = getattr(module, attr, None)
    if not callable(function):
        raise ToolRegistryError(f"tool {entry.name!r}: {module_name!r} has no function {attr!r}")
    try:
        hints = typing.get_type_hints(function)
    except Exception as e:  # unresolvable forward references are a bug in the step module
        raise ToolRegistryError(f"tool {entry.name!r}: cannot resolve annotations of {entry.target} ({e})") from e
    params = [p for p in inspect.signature(function).parameters.values() if p.default is inspect.Parameter.empty]
    if len(params) != 1:
        raise ToolRegistryError(
            f"tool {entry.name!r}: {entry.target} must take exactly one required parameter "
            f"(its pydantic input model), found {[p.name for p in params]}"
        )

    def model_class(role: str, model: object) -> type[BaseModel]:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ToolRegistryError(
                f"tool {entry.name!r}: the {role} annotation of {entry.target} must be a pydantic "
                f"BaseModel subclass, found {model!r}"
            )
        return model

    input_model = model_class("input", hints.get(params[0].name))
    result_model = model_class("return", hints.get("return"))
    for field in (entry.package_field, *entry.path_fields, *entry.external_paths, *entry.program_paths):
        if field is not None and field not in input_model.model_fields:
            raise ToolRegistryError(
                f"tool {entry.name!r}: field {field!r} named in the registry is not a field of "
                f"{input_model.__name__} ({sorted(input_model.model_fields)})"
            )
    description = inspect.cleandoc(function.__doc__ or "").split("\n\n")[0].replace("\n", " ").strip()
    if not description:
        raise ToolRegistryError(f"tool {entry.name!r}: {entry.target} needs a docstring (the tool description)")
    return Tool(entry, function, input_model, result_model, description)


class ResultSink(Protocol):
    """What a recorder's ``record_call`` yields: the step's result is handed back through it."""

    def set_result(self, result: BaseModel) -> None: ...


class CallRecorder(Protocol):
    """Where :func:`invoke` records a call: :class:`skill.session.SessionRecorder`, which
    builds on this module (so this module names the interface, not the class)."""

    @property
    def workspace(self) -> Workspace: ...

    def record_call(
        self, tool: Tool, arguments: Mapping[str, Any] | BaseModel
    ) -> contextlib.AbstractContextManager[ResultSink]: ...


_active_recorder: contextvars.ContextVar[CallRecorder | None] = contextvars.ContextVar(
    "archon_port_session", default=None
)


def active_recorder() -> CallRecorder | None:
    """The recorder :func:`invoke` records into when the call names none."""
    return _active_recorder.get()


@contextlib.contextmanager
def recording_into(recorder: CallRecorder) -> Iterator[None]:
    """Make ``recorder`` the active one for the calls inside the block."""
    token = _active_recorder.set(recorder)
    try:
        yield
    finally:
        _active_recorder.reset(token)


ResultT = TypeVar("ResultT", bound=BaseModel)


def invoke_as(
    result_type: type[ResultT], name: str, arguments: Mapping[str, Any] | BaseModel, **options: Any
) -> ResultT:
    """:func:`invoke`, typed: the result of step ``name`` as ``result_type`` (the step's
    return annotation; a ``TypeError`` if the registry maps ``name`` elsewhere)."""
    result = invoke(name, arguments, **options)
    if not isinstance(result, result_type):
        raise TypeError(f"tool {name!r} returned {type(result).__name__}, not {result_type.__name__}")
    return result


_registry_lock = threading.Lock()
_extra_entries: dict[str, ToolEntry] = {}
_resolved: dict[str, Tool] | None = None


def register_tool(entry: ToolEntry) -> Tool:
    """Add a step at run time (plugins, tests); its name must not be taken."""
    global _resolved
    tool = resolve_entry(entry)
    with _registry_lock:
        taken = {e.name for e in TOOL_ENTRIES} | set(_extra_entries)
        if entry.name in taken:
            raise ValueError(f"tool {entry.name!r} is already registered; pick another name")
        _extra_entries[entry.name] = entry
        if _resolved is not None:
            _resolved[entry.name] = tool
    return tool


def unregister_tool(name: str) -> None:
    """Remove a step added with :func:`register_tool` (the built-in lines stay)."""
    global _resolved
    with _registry_lock:
        if name not in _extra_entries:
            raise KeyError(f"tool {name!r} was not added with register_tool")
        del _extra_entries[name]
        if _resolved is not None:
            _resolved.pop(name, None)


def tool_entries() -> tuple[ToolEntry, ...]:
    """Every registered entry, in playbook order, the run-time ones last; nothing is imported
    (the CLI names its commands from these and resolves only the one it runs)."""
    with _registry_lock:
        return (*TOOL_ENTRIES, *_extra_entries.values())


def load_tools() -> dict[str, Tool]:
    """Every registered step by name, in playbook order (imports the engine on first use)."""
    global _resolved
    with _registry_lock:
        if _resolved is None:
            names = [e.name for e in TOOL_ENTRIES]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ToolRegistryError(f"TOOL_ENTRIES names {duplicates} more than once")
            resolved = {e.name: resolve_entry(e) for e in TOOL_ENTRIES}
            resolved.update({name: resolve_entry(e) for name, e in _extra_entries.items()})
            _resolved = resolved
        return dict(_resolved)


def get_tool(name: str) -> Tool:
    """The step called ``name``; ``KeyError`` lists the available ones."""
    tools = load_tools()
    if name not in tools:
        raise KeyError(f"unknown tool {name!r}; available: {', '.join(tools) or '(none)'}")
    return tools[name]


# --- requests: validation and workspace confinement ------------------------------------


def _annotation_is_path(annotation: Any) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, type):
        return issubclass(annotation, os.PathLike)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return any(_annotation_is_path(arg) for arg in typing.get_args(annotation))
    return False


def looks_like_path(value: str) -> bool:
    """Whether a value of a ``path_fields`` field names a path rather than a name (``mistral``)."""
    return os.sep in value or "/" in value or value.startswith((".", "~")) or value.endswith(".json")


def _confine(workspace: Workspace, field: str, value: str | os.PathLike) -> Path:
    """``value`` as an absolute path inside the workspace; relative values resolve from its root."""
    raw = os.path.expanduser(os.fspath(value))
    path = Path(raw)
    target = (path if path.is_absolute() else workspace.root / path).resolve()
    if not _inside(workspace, target):
        raise WorkspaceError(
            f"{field}={os.fspath(value)!r} is outside the workspace {workspace.root}; refused. "
            "Copy it into the workspace first."
        )
    if target.is_dir() and target != workspace.root:
        for link in _links_leaving(workspace, target):
            raise WorkspaceError(
                f"{field}={os.fspath(value)!r}: {link.relative_to(workspace.root)} is a symbolic link to "
                f"{link.resolve()}, outside the workspace {workspace.root}; refused. "
                "Copy the file in instead of linking it."
            )
    return target


def _inside(workspace: Workspace, path: Path) -> bool:
    return path == workspace.root or workspace.root in path.parents


def _links_leaving(workspace: Workspace, folder: Path) -> Iterator[Path]:
    """Symbolic links under ``folder`` (a source folder the engine will read) that resolve outside."""
    for directory, dirnames, filenames in os.walk(folder):
        for name in (*dirnames, *filenames):
            path = Path(directory, name)
            if path.is_symlink() and not _inside(workspace, path.resolve()):
                yield path


def prepare_request(
    tool: Tool,
    arguments: Mapping[str, Any] | BaseModel,
    workspace: Workspace,
    *,
    allow_external: bool = False,
    confine_sources: bool = True,
) -> BaseModel:
    """Validate ``arguments`` into the tool's input model, confined to ``workspace``.

    The ``workspace`` field, when the step has one, is set to the workspace root (a
    caller-given one must lie inside it). ``Path`` fields and the entry's
    ``path_fields`` are resolved to absolute paths inside the workspace; anything
    outside raises :class:`WorkspaceError`. With ``allow_external`` (the CLI) the entry's
    ``external_paths`` and ``program_paths`` are made absolute (relative ones from the
    workspace root) but not confined, and their symlinks are kept; without it the
    ``external_paths`` are confined like the rest and a set ``program_paths`` field is
    refused. ``confine_sources=False`` (the CLI: the person at the keyboard names the path)
    leaves the entry's ``path_fields`` (a family's source folder) unconfined too; the MCP
    server and replay always confine them.
    """
    data = arguments.model_dump() if isinstance(arguments, BaseModel) else dict(arguments)
    fields = tool.input_model.model_fields
    for name, info in fields.items():
        value = data.get(name)
        if name == "workspace":
            if value is not None:
                _confine(workspace, name, value)
            data[name] = workspace.root
        elif value is not None and name in tool.entry.program_paths and not allow_external:
            raise WorkspaceError(
                f"{name}={os.fspath(value)!r} names a program to run; only a person at the command line may "
                f"choose one (--{name}), not an MCP client or a session file. Leave it unset for the default."
            )
        elif value is not None and allow_external and name in (*tool.entry.external_paths, *tool.entry.program_paths):
            # Absolute, but symlinks kept: a venv's bin/python is a link that must stay the venv's.
            data[name] = Path(os.path.abspath(workspace.root / os.path.expanduser(os.fspath(value))))
        elif value is not None and _annotation_is_path(info.annotation):
            data[name] = _confine(workspace, name, value)
        elif name in tool.entry.path_fields and isinstance(value, str):
            candidate = Path(os.path.expanduser(value))
            if looks_like_path(value) or (workspace.root / candidate).exists() or candidate.is_absolute():
                if confine_sources:
                    data[name] = str(_confine(workspace, name, value))
                else:
                    data[name] = os.path.abspath(workspace.root / candidate)
    return tool.input_model.model_validate(data)


# --- package locks ------------------------------------------------------------------


class LockHolder(BaseModel):
    """Who holds a package lock: written beside the lock while held, removed on release."""

    tool: str
    pid: int
    process_start: str | None = Field(default=None, description="the process's start time, against pid reuse")
    exclusive: bool
    since: str

    def alive(self) -> bool:
        """Whether the recorded process still runs (the same process, not a reused pid)."""
        if self.process_start is not None:
            return _process_start(self.pid) == self.process_start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def describe(self) -> str:
        return f"{self.tool} (pid {self.pid}, {'changing' if self.exclusive else 'reading'} it since {self.since})"


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _live_holders(holders_dir: Path) -> list[LockHolder]:
    """The holders recorded in ``holders_dir`` whose process is alive; stale records are removed."""
    live: list[LockHolder] = []
    for path in sorted(holders_dir.glob("*.json")):
        try:
            holder = LockHolder.model_validate_json(path.read_bytes())
        except (OSError, ValueError):
            continue  # being written or removed right now
        if holder.alive():
            live.append(holder)
        else:
            logger.info("removing the stale lock record of %s", holder.describe())
            path.unlink(missing_ok=True)
    return live


@contextlib.contextmanager
def package_lock(
    workspace: Workspace,
    package: str,
    *,
    exclusive: bool,
    holder: str,
    timeout: float = DEFAULT_LOCK_TIMEOUT_S,
) -> Iterator[None]:
    """Hold ``package``'s lock: shared for reads, exclusive for changes.

    The lock is an ``flock`` on ``.archon-port/locks/<package>.lock``, so it also
    serialises calls from different processes (two servers, a server and the CLI), and
    the kernel releases it when its process dies. Each holder records itself in
    ``<package>.holders/`` while it holds the lock. A call that cannot get it within
    ``timeout`` seconds raises :class:`ToolBusyError` naming the live holders (records
    of processes that are gone are dropped); ``timeout=0`` refuses at once.
    """
    locks = state_dir(workspace, "locks")
    holders_dir = locks / f"{package}.holders"
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(locks / f"{package}.lock", "a+", encoding="utf-8") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle.fileno(), mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    live = _live_holders(holders_dir) if holders_dir.is_dir() else []
                    current = ", ".join(h.describe() for h in live) or "another call"
                    what = "the workspace" if package == WORKSPACE_LOCK else f"package {package!r}"
                    raise ToolBusyError(
                        f"{what} is busy: {current} holds it (waited {timeout:g} s). Retry when that call has finished."
                    ) from None
                time.sleep(0.02)
        record = holders_dir / f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}.json"
        try:
            holders_dir.mkdir(exist_ok=True)
            me = LockHolder(
                tool=holder,
                pid=os.getpid(),
                process_start=_process_start(os.getpid()),
                exclusive=exclusive,
                since=time.strftime("%H:%M:%S"),
            )
            record.write_text(me.model_dump_json(), encoding="utf-8")
            yield
        finally:
            record.unlink(missing_ok=True)
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# --- progress: the engine's log records of the running call ----------------------------


class _ThreadProgressHandler(logging.Handler):
    """Forwards log records emitted on one thread to a progress callback."""

    def __init__(self, thread_id: int, callback: Callable[[str], None]):
        super().__init__(level=logging.INFO)
        self.thread_id = thread_id
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread_id:
            return
        try:
            self.callback(record.getMessage())
        except Exception:  # a client that went away must not fail the step
            logger.debug("progress callback failed", exc_info=True)


_PROGRESS_LOGGERS = ("skill", "archon_models")
_level_lock = threading.Lock()
_level_users = 0
_saved_levels: dict[str, int] = {}


@contextlib.contextmanager
def _info_enabled() -> Iterator[None]:
    """Let the engine's INFO records through while any call forwards progress.

    A logger drops records below its effective level before any handler sees them,
    so the engine loggers are lowered to INFO for the duration (and restored after
    the last forwarding call ends).
    """
    global _level_users
    with _level_lock:
        if _level_users == 0:
            for name in _PROGRESS_LOGGERS:
                target = logging.getLogger(name)
                if target.getEffectiveLevel() > logging.INFO:
                    _saved_levels[name] = target.level
                    target.setLevel(logging.INFO)
        _level_users += 1
    try:
        yield
    finally:
        with _level_lock:
            _level_users -= 1
            if _level_users == 0:
                for name, level in _saved_levels.items():
                    logging.getLogger(name).setLevel(level)
                _saved_levels.clear()


@contextlib.contextmanager
def _forward_progress(callback: Callable[[str], None] | None) -> Iterator[None]:
    if callback is None:
        yield
        return
    handler = _ThreadProgressHandler(threading.get_ident(), callback)
    targets = [logging.getLogger(name) for name in _PROGRESS_LOGGERS]
    with _info_enabled():
        for target in targets:
            target.addHandler(handler)
        try:
            yield
        finally:
            for target in targets:
                target.removeHandler(handler)


# --- the one way a face runs a step -------------------------------------------------------


def invoke(
    name: str,
    arguments: Mapping[str, Any] | BaseModel,
    *,
    workspace: str | os.PathLike | Workspace | None = None,
    session: CallRecorder | None = None,
    progress: Callable[[str], None] | None = None,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    cancel: threading.Event | None = None,
    allow_external: bool = False,
    confine_sources: bool = True,
) -> BaseModel:
    """Run step ``name`` inside ``workspace`` and return its result model.

    Rolls back what a killed call left half-written, validates and confines the
    arguments, takes the package lock the entry names, and, when a session is recording
    (``session`` or the active one), appends the call to it. Once ``cancel`` is set the
    step's commit refuses to write (:class:`~skill.codemod.workspace.CallCancelledError`).
    Engine errors propagate unchanged (after being recorded). ``allow_external``: the
    caller vouches for the entry's ``external_paths``; ``confine_sources=False``: for its
    ``path_fields`` too (see :func:`prepare_request`).
    """
    tool = get_tool(name)
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    recorder = session if session is not None else active_recorder()
    if recorder is not None and recorder.workspace.root != ws.root:
        raise WorkspaceError(
            f"the recording session belongs to workspace {recorder.workspace.root}, not {ws.root}; "
            "record each workspace in its own session"
        )
    journal.recover(ws)
    try:
        request = prepare_request(tool, arguments, ws, allow_external=allow_external, confine_sources=confine_sources)
    except ValidationError as e:
        problems = [(".".join(str(p) for p in err["loc"]) or "(arguments)", err["msg"]) for err in e.errors()]
        raise InvalidArgumentsError(tool.name, problems) from e
    package = tool.package_of(request)
    with contextlib.ExitStack() as stack:
        if tool.entry.package_field is not None:
            # A step that names no package yet (port_model before it reads the config's
            # model_type) may touch any: it holds the whole workspace, every other call shares it.
            whole = package is None and not tool.entry.read_only
            stack.enter_context(
                package_lock(ws, WORKSPACE_LOCK, exclusive=whole, holder=tool.name, timeout=lock_timeout)
            )
        if package is not None:
            stack.enter_context(
                package_lock(ws, package, exclusive=not tool.entry.read_only, holder=tool.name, timeout=lock_timeout)
            )
        stack.enter_context(_forward_progress(progress))
        stack.enter_context(cancellable(cancel))
        if recorder is None:
            return tool.function(request)
        with recorder.record_call(tool, arguments) as call:
            result = tool.function(request)
            call.set_result(result)
        return result
