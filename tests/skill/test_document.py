"""A Document is one parse of a file: edits rebuild its tree, its text is printed when read.

The text a document prints is libcst's own printing of its tree (``Module.code``), byte for
byte, after any chain of edits, while printing only the top-level statements that changed;
``replace_text`` edits the text as ``str.replace`` does; and a port's model edits parse
``model.py`` once and never print the whole module.
"""

from __future__ import annotations

import random
from pathlib import Path

import libcst as cst
import pytest

from skill.codemod import document
from skill.codemod.cst import Document, replace_function, replace_text
from skill.codemod.document import replace_node
from skill.porting.model_edits import EditContext, apply_model_edits
from skill.porting.plan import plan_for

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    [
        *(REPO / "archon_models").glob("*/model/*.py"),
        *(REPO / "archon_models").glob("*/infra/parallelize.py"),
        *(REPO / "skill/codemod").glob("*.py"),
    ]
)
SAMPLE = [path for path in SOURCES if path.parts[-3] in ("qwen2", "qwen3", "deepseek_v3", "gemma2", "gpt_oss")]


@pytest.mark.parametrize("path", SAMPLE, ids=lambda p: "/".join(p.parts[-3:]))
def test_a_document_read_and_not_edited_is_its_text(path: Path) -> None:
    text = path.read_text()
    doc = Document(text)
    assert doc.code == text
    assert doc.with_module(doc.module) is doc


def _statements(node: cst.CSTNode) -> list[cst.BaseStatement]:
    """Statements at any depth (a class's methods, a method's body lines)."""
    found: list[cst.BaseStatement] = []

    class _Collect(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if isinstance(n, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                found.append(n)
            return True

    node.visit(_Collect())
    return found


def _random_edit(rng: random.Random, doc: Document, donors: list[cst.BaseStatement]) -> Document:
    """One edit of the kind the engine makes: a top-level statement replaced, inserted,
    removed or moved, or a statement inside one replaced or dropped."""
    body = list(doc.module.body)
    kind = rng.choice(["replace", "insert", "remove", "move", "nested", "nested"])
    index = rng.randrange(len(body))
    if kind == "replace":
        body[index] = rng.choice(donors)
    elif kind == "insert":
        body.insert(index, rng.choice(donors))
    elif kind == "remove" and len(body) > 1:
        body.pop(index)
    elif kind == "move":
        body.insert(rng.randrange(len(body)), body.pop(index))
    else:
        inner = [s for s in _statements(body[index]) if s is not body[index] and isinstance(s, cst.SimpleStatementLine)]
        if inner:
            old = rng.choice(inner)
            new = old.with_changes(leading_lines=[cst.EmptyLine(comment=cst.Comment("# edited"))])
            return doc.replaced(old, new)
    return doc.with_body(body)


@pytest.mark.parametrize("seed", range(6))
def test_printing_after_any_chain_of_edits_is_libcst_printing(seed: int) -> None:
    rng = random.Random(seed)
    path = rng.choice(SOURCES)
    doc = Document(path.read_text())
    donors = [s for other in rng.sample(SOURCES, 4) for s in cst.parse_module(other.read_text()).body]
    for _ in range(25):
        doc = _random_edit(rng, doc, donors)
        if rng.random() < 0.5:  # read between some edits only: the memo spans unread versions
            assert doc.code == doc.module.code


def test_printing_an_edited_document_prints_only_the_statements_that_changed(monkeypatch) -> None:
    doc = Document((REPO / "archon_models/qwen3/model/model.py").read_text())
    doc.code  # noqa: B018  (read once: nothing printed yet, the text is the source)
    printed: list[cst.CSTNode] = []
    code_for_node = cst.Module.code_for_node

    def spy(self: cst.Module, node: cst.CSTNode) -> str:
        printed.append(node)
        return code_for_node(self, node)

    monkeypatch.setattr(cst.Module, "code_for_node", spy)
    before = doc.code
    assert printed == []
    edited = replace_function(doc, "Attention", "init_weights", "def init_weights(self, init_std: float):\n    pass\n")
    top_level = [node for node in printed if node in doc.module.body]
    printed.clear()
    first = edited.code
    assert first != before
    # Every statement printed once (nothing was memoised yet), then only the changed class.
    assert len([n for n in printed if n in edited.module.body]) == len(edited.module.body)
    again = replace_function(
        edited, "Attention", "init_weights", "def init_weights(self, init_std: float):\n    return None\n"
    )
    printed.clear()
    assert again.code.count("return None") >= 1
    changed = [n for n in printed if n in again.module.body]
    assert [n.name.value for n in changed if isinstance(n, cst.ClassDef)] == ["Attention"] and len(changed) == 1
    assert top_level == []


def test_replace_node_rebuilds_only_the_ancestors() -> None:
    module = cst.parse_module((REPO / "archon_models/qwen2/model/model.py").read_text())
    classes = [s for s in module.body if isinstance(s, cst.ClassDef)]
    method = next(s for s in classes[-1].body.body if isinstance(s, cst.FunctionDef))
    new = replace_node(module, method, method.with_changes(name=cst.Name("renamed")))
    assert isinstance(new, cst.Module)
    kept = [a is b for a, b in zip(module.body, new.body, strict=True)]
    assert kept.count(False) == 1 and new.body[module.body.index(classes[-1])] is not classes[-1]


@pytest.mark.parametrize("seed", range(8))
def test_replace_text_edits_the_source_as_str_replace_does(seed: int) -> None:
    rng = random.Random(seed)
    path = rng.choice(SAMPLE)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    comments = [line for line in lines if line.strip().startswith("#")]
    names = sorted({word for line in lines for word in line.split() if word.isidentifier() and len(word) > 3})
    old, new = rng.choice(
        [
            (rng.choice(comments), "# replaced comment\n") if comments else ("import", "import"),
            (f" {rng.choice(names)}", f" {rng.choice(names)}"),
            ("".join(lines[3:5]), ""),  # two lines, possibly across two statements
            ("\n\n\n", "\n\n\n# between\n"),
        ]
    )
    count = rng.choice([-1, 1, 2])
    expected = text.replace(old, new, count)
    try:
        cst.parse_module(expected)
    except cst.ParserSyntaxError:
        pytest.skip("this replacement makes no valid module")
    doc = Document(text)
    edited = replace_text(doc, old, new, count)
    assert edited.code == expected
    assert edited.module.code == expected


def test_a_port_parses_model_py_once_and_never_prints_the_whole_module(monkeypatch) -> None:
    """The seven edits of a qwen3 copy (statement matching, guards, docstrings, pruned
    imports) run on one tree: libcst parses the file once and never prints all of it."""
    text = (REPO / "archon_models/qwen3/model/model.py").read_text()
    whole_parses: list[int] = []
    parse_module = cst.parse_module

    def counting_parse(source: str, *args, **kwargs) -> cst.Module:
        if "class Qwen3Model(" in source:  # the model file (snippets and statements are parsed too)
            whole_parses.append(len(source))
        return parse_module(source, *args, **kwargs)

    whole_prints: list[int] = []
    module_code = cst.Module.code

    def counting_code(self: cst.Module) -> str:
        code = module_code.fget(self)  # type: ignore[attr-defined]
        whole_prints.append(len(code))
        return code

    plan = plan_for("llama").model_copy(
        update={
            "qk_norm": "none",
            "clip_qkv_field": "clip_qkv",
            "attn_sinks": True,
            "output_gate": "sigmoid_per_head",
            "output_gate_bias": False,
            "block": "sandwich",
            "moe": False,
            "reference": "qwen3",
        }
    )
    names = [
        "remove_qk_norm",
        "projection_bias",
        "clip_qkv",
        "attention_sinks",
        "output_gate",
        "sandwich_norm",
        "dense_layers",
    ]
    ctx = EditContext(camel="Toy", model_class="Qwen3Model", profile=plan)
    monkeypatch.setattr(document.cst, "parse_module", counting_parse)
    monkeypatch.setattr(cst.Module, "code", property(counting_code))
    edited = apply_model_edits(text, ctx, names)
    assert "self.sinks = nn.Parameter" in edited and "self.wg = nn.Linear" in edited
    assert whole_parses == [len(text)]
    assert whole_prints == []
