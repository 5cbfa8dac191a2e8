"""A libcst scan of a family's modeling source, for facts the config and modules hide.

Some decisions live only in code: whether the QK norm runs before RoPE, whether the
rotation pairs halves or adjacent dimensions, whether the router scores with a sigmoid
and renormalises its top-k weights, whether ALiBi biases are built. The scan parses the
file once and answers those questions from function and class bodies, by what the code
calls, never by the family's name.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

logger = logging.getLogger(__name__)

_ROTARY_CALL = re.compile(r"rotary|(^|_)rope(_|$)")
_ROUTER_CLASS = re.compile(r"(Router|Gate|TopK|Moe|MoE|Experts|Sparse)", re.IGNORECASE)


@dataclass
class _Definition:
    name: str
    code: str
    calls: list[str] = field(default_factory=list)  # callee names in source order (body only)


@dataclass
class SourceFacts:
    """What the scan of one modeling file found."""

    path: str
    functions: dict[str, _Definition] = field(default_factory=dict)
    classes: dict[str, dict[str, _Definition]] = field(default_factory=dict)  # class -> method -> def

    def class_code(self, class_name: str) -> str:
        return "\n".join(d.code for d in self.classes.get(class_name, {}).values())

    def reads_config(self, field_name: str) -> bool:
        """Whether a method of the modeling file reads ``config.<field_name>``."""
        pattern = re.compile(rf"config\.{re.escape(field_name)}\b")
        return any(pattern.search(d.code) for methods in self.classes.values() for d in methods.values())

    def indexes_config_by_layer(self, field_name: str) -> bool:
        """Whether a method reads ``config.<field_name>[layer_idx]`` (one value per layer)."""
        pattern = re.compile(rf"config\.{re.escape(field_name)}\[\s*(self\.)?layer_id(x)?\s*\]")
        return any(pattern.search(d.code) for methods in self.classes.values() for d in methods.values())

    def rotary_interleaved(self) -> bool:
        """Whether the rotary helpers pair adjacent dimensions (``x[..., ::2]``, repeat_interleave)."""
        for name, definition in self.functions.items():
            if name.startswith(("rotate", "apply_rotary", "apply_rope")) and re.search(
                r"::\s*2\]|repeat_interleave|view_as_complex", definition.code
            ):
                return True
        return False

    def qk_norm_before_rope(self, attention_class: str, q_norm_attr: str) -> bool | None:
        """Order of the QK-norm call and the rotary call in the attention forward.

        ``None`` when either call is absent from ``forward`` (the placement cannot be read).
        """
        forward = self.classes.get(attention_class, {}).get("forward")
        if forward is None:
            return None
        norm_index = next((i for i, c in enumerate(forward.calls) if c.endswith(q_norm_attr)), None)
        rope_index = next(
            (i for i, c in enumerate(forward.calls) if "rotary" in c.lower() or "rope" in c.lower()), None
        )
        if norm_index is None or rope_index is None:
            return None
        return norm_index < rope_index

    def applies_rotary(self, class_name: str) -> bool:
        """Whether a class's methods call a rotary helper (``apply_rotary_pos_emb``, ``rope(...)``):
        attention that rotates queries and keys itself, without a separate rotary module."""
        return any(
            _ROTARY_CALL.search(call.lower().rsplit(".", 1)[-1])
            for definition in self.classes.get(class_name, {}).values()
            for call in definition.calls
        )

    def router_code(self) -> str:
        return "\n".join(self.class_code(name) for name in self.classes if _ROUTER_CLASS.search(name))

    def router_scoring(self) -> str | None:
        """``"sigmoid"`` or ``"softmax"`` by what the router/MoE classes call; ``None`` if neither."""
        code = self.router_code()
        has_sigmoid = bool(re.search(r"\bsigmoid\(", code))
        has_softmax = bool(re.search(r"\bsoftmax\(", code))
        if has_sigmoid and not has_softmax:
            return "sigmoid"
        if has_softmax and not has_sigmoid:
            return "softmax"
        if has_sigmoid and has_softmax:
            # Both appear (e.g. a config switch); the config field decides, say "softmax".
            return "softmax"
        return None

    def router_sparse_mixer(self) -> bool:
        """Whether the router selects experts one after another by masked softmaxes (sparse mixer).

        A top-level function the router classes call that masks the scores twice
        (``masked_fill``), takes two softmaxes and removes the first pick with a ``scatter``
        of ``-inf`` before choosing the second: top-1, then top-1 of the rest.
        """
        called = {
            c.rsplit(".", 1)[-1]
            for name in self.classes
            if _ROUTER_CLASS.search(name)
            for d in self.classes[name].values()
            for c in d.calls
        }
        for name in called & set(self.functions):
            code = self.functions[name].code
            if (
                len(re.findall(r"\bsoftmax\(", code)) >= 2
                and len(re.findall(r"\bmasked_fill\(", code)) >= 2
                and re.search(r"\bscatter\([^)]*-inf", code, re.DOTALL)
            ):
                return True
        return False

    def experts_clamped_glu(self) -> bool:
        """Whether an experts class clamps its gate/up activations and gates by a sigmoid
        (``gate.clamp(max=limit) * sigmoid(alpha * gate) * (up + 1)``, gpt-oss) rather than
        calling an activation function."""
        code = "\n".join(self.class_code(name) for name in self.classes if "Experts" in name)
        return bool(re.search(r"\.clamp\(", code) and re.search(r"\bsigmoid\(", code))

    def clamped_glu_fields(self, class_name: str | None = None) -> dict[str, str]:
        """The config fields a clamped-GLU experts class (or the class ``class_name``, such as
        a dense MLP computing the same gate inline) reads for its constants:
        ``{"limit": field}`` for the attribute its ``.clamp(`` calls take, ``{"alpha": field}``
        for the one that scales the ``sigmoid(`` argument (``self.x = config.field`` in
        ``__init__``); empty where the class sets neither from the config."""
        names = [class_name] if class_name is not None else [name for name in self.classes if "Experts" in name]
        code = "\n".join(self.class_code(name) for name in names)
        assigned = dict(re.findall(r"self\.(\w+)\s*=\s*config\.(\w+)", code))
        fields: dict[str, str] = {}
        for attr, field_name in assigned.items():
            used = rf"self\.{re.escape(attr)}\b"
            if re.search(rf"\.clamp\([^)]*{used}", code):
                fields["limit"] = field_name
            elif re.search(rf"\bsigmoid\([^)]*{used}", code):
                fields["alpha"] = field_name
        return fields

    def router_renormalises(self) -> bool:
        """Whether the router divides its top-k weights by their sum (unconditionally or by a flag)."""
        return bool(re.search(r"/=?\s*\(?[\w.]*\.?sum\(|/=?\s*[\w.]*denominator", self.router_code()))

    def mentions(self, word: str) -> bool:
        word = word.lower()
        return any(word in name.lower() for name in self.functions) or any(
            word in name.lower() for name in self.classes
        )


_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")


def _definition(module: cst.Module, node: cst.FunctionDef) -> _Definition:
    code = module.code_for_node(node)
    body = code.split(":", 1)[1] if ":" in code else code  # calls in the body, not the signature
    return _Definition(node.name.value, code, [m.group(1) for m in _CALL.finditer(body)])


def _collect(module: cst.Module) -> tuple[dict[str, _Definition], dict[str, dict[str, _Definition]]]:
    """Top-level functions and the methods of top-level classes (the layout of modeling files)."""
    functions: dict[str, _Definition] = {}
    classes: dict[str, dict[str, _Definition]] = {}
    for statement in module.body:
        if isinstance(statement, cst.FunctionDef):
            functions[statement.name.value] = _definition(module, statement)
        elif isinstance(statement, cst.ClassDef):
            methods = classes.setdefault(statement.name.value, {})
            body = statement.body.body if isinstance(statement.body, cst.IndentedBlock) else ()
            for member in body:
                if isinstance(member, cst.FunctionDef):
                    methods[member.name.value] = _definition(module, member)
    return functions, classes


@functools.lru_cache(maxsize=64)
def scan_file(path: str) -> SourceFacts:
    """Parse one Python file (cached by path)."""
    module = cst.parse_module(Path(path).read_text(encoding="utf-8"))
    functions, classes = _collect(module)
    return SourceFacts(path, functions, classes)


def scan_model_source(model: object) -> SourceFacts | None:
    """Scan the file defining ``model``'s class; ``None`` when it has no readable source."""
    try:
        path = inspect.getsourcefile(type(model))
    except TypeError:
        return None
    if path is None or not Path(path).is_file():
        return None
    return scan_file(path)
