"""The unit every feature axis emits, and how the two remote-code files are put together.

A :class:`Piece` is some module-level code of ``modeling_<name>.py`` (classes and
helpers, written with the placeholder ``PREFIX`` for the family's class prefix), the
imports that code needs, and the config fields it reads with their defaults. Pieces are
emitted by one function per axis (``norms``, ``positions``, ``attention``, ``mla``,
``feedforward``, ``moe``, ``blocks``, ``model``) and joined here in dependency order.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

PLACEHOLDER = "PREFIX"


@dataclass(frozen=True)
class ConfigField:
    """One ``__init__`` argument of the config class: its name and default value."""

    name: str
    default: Any
    doc: str = ""


@dataclass
class Piece:
    code: str = ""
    imports: set[str] = field(default_factory=set)
    fields: list[ConfigField] = field(default_factory=list)
    # (class name, statements on ``module`` and ``std``) for the model's ``_init_weights``:
    # parameters no default initialiser knows (sinks, 3D experts, a router weight).
    inits: list[tuple[str, str]] = field(default_factory=list)

    def __add__(self, other: Piece) -> Piece:
        code = "\n\n\n".join(part for part in (self.code.strip("\n"), other.code.strip("\n")) if part)
        return Piece(code, self.imports | other.imports, [*self.fields, *other.fields], [*self.inits, *other.inits])


def block(text: str) -> str:
    """``text`` dedented, without leading/trailing blank lines."""
    return textwrap.dedent(text).strip("\n")


def indent(text: str, levels: int) -> str:
    return textwrap.indent(text, "    " * levels)


def lines(*parts: str | None) -> str:
    """Join the non-empty parts (each already dedented), one per line."""
    return "\n".join(part for part in parts if part)


# Import lines in the order a formatter would sort them.
IMPORT_ORDER = (
    "import math",
    "from typing import ClassVar",
    "",
    "import torch",
    "import torch.nn.functional as F",
    "from torch import nn",
    "from transformers import GenerationMixin, PreTrainedModel",
    "from transformers import initialization as init",
    "from transformers.activations import ACT2FN",
    "from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast",
    "from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS",
)


def formatted(text: str) -> str:
    """``text`` through ``ruff format`` (line length 120), as an author's formatter leaves it."""
    try:
        import ruff

        command = [ruff.find_ruff_bin()]
    except (ImportError, AttributeError, FileNotFoundError):
        command = [sys.executable, "-m", "ruff"]
    command += ["format", "--isolated", "--line-length", "120", "-"]
    proc = subprocess.run(command, input=text, capture_output=True, text=True, check=False, timeout=60)
    if proc.returncode != 0:
        raise ValueError(f"ruff format refused the generated code: {proc.stderr.strip()}")
    return proc.stdout


def modeling_source(name: str, camel: str, docstring: str, piece: Piece) -> str:
    """The whole ``modeling_<name>.py``."""
    wanted = piece.imports | {"import torch", "from torch import nn"}
    head = []
    for line in IMPORT_ORDER:
        if line == "" and head and head[-1] != "":
            head.append("")
        elif line in wanted:
            head.append(line)
    head += ["", f"from .configuration_{name} import {camel}Config"]
    body = piece.code.replace(PLACEHOLDER, camel)
    return formatted(f'"""{docstring}"""\n\n' + "\n".join(head) + "\n\n\n" + body.rstrip() + "\n")


def configuration_source(name: str, camel: str, docstring: str, fields: list[ConfigField], super_kwargs: dict) -> str:
    """The whole ``configuration_<name>.py``: one ``PretrainedConfig`` whose defaults are the family's."""
    seen: dict[str, ConfigField] = {}
    for item in fields:
        if item.name in seen and seen[item.name].default != item.default:
            raise ValueError(f"config field {item.name} emitted twice with different defaults")
        seen.setdefault(item.name, item)
    args, body = [], []
    for item in seen.values():
        if isinstance(item.default, (dict, list)):
            # A mutable default is built in __init__ from None, as HF config classes do.
            args.append(f"{item.name}=None,")
            body.append(f"self.{item.name} = {item.name} if {item.name} is not None else {item.default!r}")
        else:
            args.append(f"{item.name}={item.default!r},")
            body.append(f"self.{item.name} = {item.name}")
    for key, value in super_kwargs.items():
        args.append(f"{key}={value!r},")
    passed = "".join(f"{key}={key}, " for key in super_kwargs)
    text = f'''"""{docstring}"""

from typing import ClassVar

from transformers import PretrainedConfig


class {camel}Config(PretrainedConfig):
    model_type = "{name}"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(
        self,
{indent(chr(10).join(args), 2)}
        **kwargs,
    ):
{indent(chr(10).join(body), 2)}
        super().__init__({passed}**kwargs)


__all__ = ["{camel}Config"]
'''
    return formatted(text)
