"""The incremental parse returns, for every text, the tree libcst's full parse returns.

``deep_equals`` compares every node and every piece of whitespace, so an edit that matches
nodes after an incremental parse sees exactly what it would see after a full one. The
texts are the repository's own modules (every reference and ported package, the engine)
under random statement-level and line-level edits, plus the cases where comment ownership
or the indentation unit could move.
"""

from __future__ import annotations

import random
from pathlib import Path

import libcst as cst
import pytest

from skill.codemod import parse_cache
from skill.codemod.cst import _parse

REPO = Path(__file__).resolve().parents[2]
# modules the size of those a port edits (an __init__ of three imports has no block to share)
SOURCES = sorted(
    path
    for path in [
        *(REPO / "archon_models").glob("*/model/*.py"),
        *(REPO / "archon_models").glob("*/*.py"),
        *(REPO / "skill").rglob("*.py"),
    ]
    if 80 <= path.read_text().count("\n") <= 800
)


@pytest.fixture(autouse=True)
def _fresh_cache():
    parse_cache.clear()
    yield
    parse_cache.clear()


def _assert_exact(text: str) -> cst.Module:
    """The incremental parse of ``text`` is libcst's; returns libcst's."""
    got = parse_cache.parse_module(text)
    want = cst.parse_module(text)
    # want.code, not text: libcst 1.0 drops an indented comment that ends a file
    assert got.code == want.code
    assert got.deep_equals(want), "the incremental parse built a different tree than libcst's parse"
    return want


def _pieces(module: cst.Module) -> tuple[str, list[str]]:
    """The code of the module's header and of each of its top-level statements."""
    header = "".join(module.code_for_node(line) for line in module.header)
    return header, [module.code_for_node(stmt) for stmt in module.body]


def _mutate(rng: random.Random, module: cst.Module, donors: list[str]) -> str:
    """One random edit of the kind the engine makes: a statement replaced, inserted,
    removed or moved, or a line added inside one, or a comment line between two."""
    header, pieces = _pieces(module)
    i = rng.randrange(len(pieces))
    kind = rng.choice(["replace", "insert", "remove", "line", "comment", "move"])
    if kind == "replace":
        pieces[i] = rng.choice(donors)
    elif kind == "insert":
        pieces.insert(i, rng.choice(donors))
    elif kind == "remove" and len(pieces) > 1:
        del pieces[i]
    elif kind == "move" and len(pieces) > 1:
        pieces.insert(rng.randrange(len(pieces)), pieces.pop(i))
    elif kind == "line":
        lines = pieces[i].splitlines(keepends=True)
        at = rng.randrange(len(lines))
        indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
        pieces[i] = "".join([*lines[: at + 1], f"{indent}edited_{rng.randrange(100)} = {at}\n", *lines[at + 1 :]])
    else:  # a comment line, at column 0 or indented, before or after a statement
        comment = rng.choice(["# note\n", "    # note\n", "\n", "\n# note\n\n"])
        pieces.insert(i + rng.randrange(2), comment)
    return header + "".join(pieces)


@pytest.mark.parametrize("seed", range(3))
def test_random_edits_of_the_repository_modules_parse_exactly(seed: int):
    rng = random.Random(seed)
    donors = [piece for path in rng.sample(SOURCES, 6) for piece in _pieces(cst.parse_module(path.read_text()))[1]]
    before = parse_cache.stats()
    for path in rng.sample(SOURCES, 6):
        module = _assert_exact(path.read_text())
        for _ in range(5):
            if not module.body:
                break
            candidate = _mutate(rng, module, donors)
            try:
                module = _assert_exact(candidate)
            except cst.ParserSyntaxError:
                continue  # not a module (an indented comment ended up where a block must start)
    assert parse_cache.stats().partial - before.partial >= 5, "too few texts were parsed incrementally"


CLASS_A = "import torch\n\n\nclass A:\n    x = 1\n"


@pytest.mark.parametrize(
    ("base", "edited"),
    [
        # an indented comment after the shared start belongs to its last class
        (CLASS_A + "\n\nclass B:\n    y = 2\n", CLASS_A + "    # about A\n\nclass B:\n    y = 2\n"),
        # an indented comment above a shared statement moves to the block that now ends above it
        (CLASS_A + "z = 1\n    # note\nw = 2\n", CLASS_A + "    # note\nw = 2\n"),
        (CLASS_A + "z = 1\n    # note\nw = 2\n", CLASS_A + "def f():\n    return 1\n    # note\nw = 2\n"),
        # comment lines at the end of the changed part belong to the next statement
        (CLASS_A + "z = 1\nw = 2\n", CLASS_A + "z = 3\n# about w\nw = 2\n"),
        # the shared start now ends the file
        (CLASS_A + "    # tail\nz = 1\n", CLASS_A + "    # tail\n"),
        # the changed part brings another indentation unit
        (CLASS_A + "z = 1\n", CLASS_A + "def f():\n\treturn 1\n"),
        # the first indented block changed: the file's indentation unit comes from it
        ("import torch\nclass A:\n    x = 1\n", "import torch\nclass A:\n  x = 1\n"),
        # no final newline
        (CLASS_A + "z = 1\n", CLASS_A + "z = 2"),
        # the footer: trailing comments of the file
        (CLASS_A + "z = 1\n# end\n", CLASS_A + "z = 2\n# end\n"),
        # the header: comments above the first statement
        ("# header\n" + CLASS_A + "z = 1\n", "# header\n" + CLASS_A + "# new\nz = 1\n"),
        # statements removed between a shared start and a shared end
        (CLASS_A + "z = 1\nw = 2\nv = 3\n", CLASS_A + "v = 3\n"),
        # an import added above the first class: the unit comes from the shared end
        (CLASS_A + "z = 1\n", "import torch\nimport math\n\n\nclass A:\n    x = 1\nz = 1\n"),
        # ... but a block added above it, in another unit, sets the unit itself
        (CLASS_A + "z = 1\n", "import torch\ndef f():\n\treturn 1\nclass A:\n    x = 1\nz = 1\n"),
        # a file without blocks (a registry of imports): a line added in the middle
        ("import a\nimport b\nimport c\n", "import a\nimport b\nimport b2\nimport c\n"),
        # ... and a block added to it, in another indentation unit
        ("import a\nimport b\nimport c\n", "import a\ndef f():\n\treturn 1\nimport c\n"),
        # CRLF newlines
        (CLASS_A.replace("\n", "\r\n") + "z = 1\r\n", CLASS_A.replace("\n", "\r\n") + "z = 2\r\n"),
    ],
)
def test_texts_where_ownership_or_layout_could_move_parse_exactly(base: str, edited: str):
    _assert_exact(base)
    _assert_exact(edited)


def test_a_change_inside_one_class_reparses_only_that_class():
    text = (REPO / "archon_models" / "qwen3" / "model" / "model.py").read_text()
    _assert_exact(text)
    edited = text.replace("class Attention(nn.Module):\n", "class Attention(nn.Module):\n    edited = True\n", 1)
    assert edited != text
    before = parse_cache.stats()
    _assert_exact(edited)
    after = parse_cache.stats()
    assert after.partial == before.partial + 1
    module = parse_cache.parse_module(edited)
    # the statements before and after the edited class are the base parse's own nodes
    base = parse_cache.parse_module(text)
    shared = sum(a is b for a, b in zip(base.body, module.body, strict=True))
    assert shared == len(base.body) - 1


def test_a_block_added_to_a_file_without_blocks_sets_the_unit_for_the_next_edit():
    _assert_exact("import a\nimport b\nimport c\n")
    _assert_exact("import a\ndef f():\n\treturn 1\nimport c\n")
    _assert_exact("import a\ndef f():\n\treturn 1\nimport c\nclass B:\n\tx = 1\n")
    assert parse_cache.stats().partial == 2


def test_a_syntax_error_is_reported_with_the_whole_files_lines():
    text = CLASS_A + "z = 1\n"
    _assert_exact(text)
    with pytest.raises(cst.ParserSyntaxError) as caught:
        parse_cache.parse_module(CLASS_A + "z = (\n")
    assert caught.value.raw_line == 6


def test_the_codemod_helpers_parse_through_the_cache():
    text = CLASS_A + "z = 1\n"
    _parse(text)
    _parse(text + "w = 2\n")
    assert parse_cache.stats().partial == 1
