"""libcst helpers, transactional writes and name validation of the porting engine (no torch)."""

from __future__ import annotations

import os

import pytest

from skill.codemod import ModelNames, Workspace, WorkspaceError, transaction, validate_model_name
from skill.codemod import cst as c
from skill.codemod.workspace import ConcurrentEditError, StagedTree

ADAPTER = """class A:
    from_hf_map = {
        "a.weight": "x.weight",  # keep this comment
        "b.inv_freq": None,
    }
"""


def test_rename_identifiers_renames_classes_modules_constants_and_strings():
    source = (
        "from archon_models.qwen2.model.model import Qwen2Model  # qwen2\n"
        "QWEN2_SPEC = ModelSpec(name='qwen2', parallelize_fn=parallelize_qwen2)\n"
    )
    pairs = ModelNames.from_name("qwen2").rename_pairs(ModelNames.from_name("mistral"))
    out = c.rename_identifiers(c.Document(source), pairs).code
    assert out == (
        "from archon_models.mistral.model.model import MistralModel  # mistral\n"
        "MISTRAL_SPEC = ModelSpec(name='mistral', parallelize_fn=parallelize_mistral)\n"
    )


def test_model_names_of_an_underscored_name():
    names = ModelNames.from_name("qwen2_moe")
    assert (names.package, names.camel, names.upper) == ("qwen2_moe", "Qwen2Moe", "QWEN2_MOE")


def test_edit_dict_literal_keeps_comments_and_is_idempotent():
    out = c.edit_dict_literal(c.Document(ADAPTER), "from_hf_map", {"a.weight": "y.weight", "c.bias": "z.bias"})
    assert '"a.weight": "y.weight",  # keep this comment' in out
    assert '"c.bias": "z.bias",' in out
    assert c.edit_dict_literal(out, "from_hf_map", {"a.weight": "y.weight", "c.bias": "z.bias"}) is out
    removed = c.edit_dict_literal(out, "from_hf_map", remove=["c.bias"])
    assert c.read_dict_literal(removed, "from_hf_map") == {"a.weight": "y.weight", "b.inv_freq": None}


PLAN = """plan = {
    "first": 1,
    # about second
    "second": 2,
    # about third
    "third": 3,
}
"""


@pytest.mark.parametrize(
    ("removed", "expected"),
    [
        # The comment above the next entry stays with it; the removed entry's own goes.
        ("first", 'plan = {\n    # about second\n    "second": 2,\n    # about third\n    "third": 3,\n}\n'),
        ("second", 'plan = {\n    "first": 1,\n    # about third\n    "third": 3,\n}\n'),
        ("third", 'plan = {\n    "first": 1,\n    # about second\n    "second": 2,\n}\n'),
    ],
)
def test_edit_dict_literal_removal_keeps_the_next_entrys_comment(removed: str, expected: str):
    # Before: the lines above an entry hang on the previous entry's comma, so removing the
    # previous entry dropped them (a post-norm TP plan lost the comment above "attention",
    # and the no-RoPE plan edit that looks for it failed: fuzzer seed 72).
    assert c.edit_dict_literal(c.Document(PLAN), "plan", remove=[removed]).code == expected


def test_edit_dict_literal_names_a_missing_target():
    with pytest.raises(c.CodemodError, match="no dict literal assigned to 'nope'"):
        c.edit_dict_literal(c.Document(ADAPTER), "nope", {"a": "b"})


def test_ensure_import_line_is_idempotent_and_sorted_in_its_group():
    source = (
        '"""doc"""\n\nfrom archon_models.model_spec import ModelSpec  # noqa: F401\n'
        "from archon_models.gemma import spec as gemma_spec  # noqa: F401\n"
        "from archon_models.qwen2 import spec as qwen2_spec  # noqa: F401\n"
    )
    line = "from archon_models.llama import spec as llama_spec  # noqa: F401"
    out = c.ensure_import_line(c.Document(source), line)
    lines = out.code.splitlines()
    assert lines.index(line) == lines.index("from archon_models.gemma import spec as gemma_spec  # noqa: F401") + 1
    assert c.ensure_import_line(out, line) is out
    assert c.ensure_import_line(out, "from archon_models.llama import spec as llama_spec") is out


def test_class_fields_and_functions_are_replaced_in_place():
    source = (
        '@dataclass\nclass Args:\n    """Doc."""\n\n    dim: int = 1  # width\n    old: bool = True\n\n'
        "    def f(self):\n        return 1\n"
    )
    out = c.set_class_fields(c.Document(source), "Args", {"dim": "int = 1", "extra": "float = 0.5"}, remove=["old"])
    assert "dim: int = 1  # width" in out and "extra: float = 0.5" in out and "old" not in out
    assert c.set_class_fields(out, "Args", {"dim": "int = 1", "extra": "float = 0.5"}) is out
    replaced = c.replace_function(out, "Args", "f", 'def f(self):\n    """Two."""\n    return 2\n')
    assert '        """Two."""\n        return 2' in replaced
    assert c.replace_function(replaced, "Args", "f", 'def f(self):\n    """Two."""\n    return 2\n') is replaced


def test_insert_at_loop_head_hoists_what_the_new_statements_read_and_is_idempotent():
    source = (
        "class A:\n    def from_hf(self, sd):\n        out = {}\n        for key, value in sd.items():\n"
        "            target = self.rename(key)\n            # the abstract key\n"
        "            template, indices = abstract(key)\n            out[target] = value\n        return out\n"
    )
    doc = c.Document(source)
    assert c.loop_body_code(doc, "A", "from_hf", "sd.items()")[1] == "template, indices = abstract(key)"
    new = "if template in self.fused:\n    out.update(self.split(key, template, indices, value))\n    continue\n"
    out = c.insert_at_loop_head(doc, "A", "from_hf", "sd.items()", new, hoist="template, indices = abstract(key)")
    assert c.loop_body_code(out, "A", "from_hf", "sd.items()") == [
        "template, indices = abstract(key)",
        "if template in self.fused:\n    out.update(self.split(key, template, indices, value))\n    continue\n",
        "target = self.rename(key)",
        "out[target] = value",
    ]
    assert (
        c.insert_at_loop_head(out, "A", "from_hf", "sd.items()", new, hoist="template, indices = abstract(key)") is out
    )
    with pytest.raises(c.CodemodError, match="no top-level loop over"):
        c.insert_at_loop_head(doc, "A", "from_hf", "other.items()", new)


def test_set_call_kwarg_edits_only_the_named_target():
    source = (
        "class A:\n    def __init__(self):\n        self.wq = nn.Linear(1, 2, bias=bias)\n"
        "        self.wo = nn.Linear(2, 1, bias=False)\n"
    )
    out = c.set_call_kwarg(c.Document(source), "nn.Linear", "bias", "True", target="self.wo")
    assert "self.wq = nn.Linear(1, 2, bias=bias)" in out and "self.wo = nn.Linear(2, 1, bias=True)" in out


def test_set_call_argument_edits_one_positional_argument_of_the_named_target():
    source = (
        "class A:\n    def __init__(self):\n        self.wq = nn.Linear(1, 2, bias=bias)\n"
        "        self.wo = nn.Linear(2, 1, bias=False)\n"
    )
    out = c.set_call_argument(c.Document(source), "nn.Linear", 1, "2 * 2", target="self.wq")
    assert "self.wq = nn.Linear(1, 2 * 2, bias=bias)" in out and "self.wo = nn.Linear(2, 1, bias=False)" in out
    assert c.set_call_argument(out, "nn.Linear", 1, "2 * 2", target="self.wq") is out  # already set
    with pytest.raises(c.CodemodError, match="positional argument 2"):
        c.set_call_argument(c.Document(source), "nn.Linear", 2, "3", target="self.wq")


@pytest.mark.parametrize(
    "name", ["../evil", "a/b", "Mistral", "my-model", "class", "attention", "", "9lives", ".hidden"]
)
def test_invalid_model_names_are_refused(name):
    with pytest.raises(ValueError):
        validate_model_name(name)


def test_valid_model_name():
    assert validate_model_name("qwen2_moe") == "qwen2_moe"


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "archon_models").mkdir()
    (tmp_path / "archon_models" / "__init__.py").write_text("# registry\n")
    return Workspace(tmp_path)


def test_paths_are_confined_to_the_workspace(workspace):
    with pytest.raises(WorkspaceError):
        workspace.resolve("../outside.py")
    with pytest.raises(WorkspaceError):
        workspace.resolve("/etc/passwd")
    tree = StagedTree(workspace)
    with pytest.raises(WorkspaceError):
        tree.write_text("archon_models/../../x.py", "x")


def test_transaction_applies_all_writes_at_exit(workspace):
    with transaction(workspace) as tree:
        tree.write_text("archon_models/new/a.py", "a\n")
        tree.write_text("archon_models/__init__.py", "# registry\nimport x\n")
        assert tree.read_text("archon_models/new/a.py") == "a\n"
        assert not (workspace.root / "archon_models/new").exists()
    assert (workspace.root / "archon_models/new/a.py").read_text() == "a\n"


def test_an_exception_in_the_block_writes_nothing(workspace):
    with pytest.raises(RuntimeError), transaction(workspace) as tree:
        tree.write_text("archon_models/new/a.py", "a\n")
        raise RuntimeError("step failed")
    assert not (workspace.root / "archon_models/new").exists()


def test_ctrl_c_during_apply_rolls_everything_back(workspace, monkeypatch):
    real_replace = os.replace
    calls = []

    def interrupted_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted_replace)
    tree = StagedTree(workspace)
    tree.write_text("archon_models/__init__.py", "# registry\nfrom archon_models.new import spec\n")
    tree.write_text("archon_models/new/spec.py", "x = 1\n")
    tree.write_text("archon_models/new/model/model.py", "y = 2\n")
    with pytest.raises(KeyboardInterrupt):
        tree.commit()
    assert (workspace.root / "archon_models/__init__.py").read_text() == "# registry\n"
    assert not (workspace.root / "archon_models/new").exists()
    assert sorted(p.name for p in (workspace.root / "archon_models").iterdir()) == ["__init__.py"]


def test_commit_refuses_a_file_changed_since_staging(workspace):
    tree = StagedTree(workspace)
    text = tree.read_text("archon_models/__init__.py")
    tree.write_text("archon_models/__init__.py", text + "import mine\n")
    (workspace.root / "archon_models/__init__.py").write_text("# registry\nimport theirs\n")
    with pytest.raises(ConcurrentEditError, match="changed on disk"):
        tree.commit()
    assert (workspace.root / "archon_models/__init__.py").read_text() == "# registry\nimport theirs\n"


@pytest.mark.parametrize("reference", ["qwen2", "qwen3", "deepseek_v3"])
def test_replace_node_gives_what_libcst_deep_replace_gives(reference: str):
    # replace_node rebuilds only the ancestors of the node it replaces; the tree, and so the
    # code, must be libcst's deep_replace's for a node at any depth and in any field kind
    # (a single child, a body sequence, an argument list).
    import pathlib

    import libcst as cst

    source = (pathlib.Path(__file__).parents[2] / "archon_models" / reference / "model" / "model.py").read_text()
    module = cst.parse_module(source)
    nodes: list[cst.CSTNode] = []

    class _Collect(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            nodes.append(node)
            return True

    module.visit(_Collect())
    kinds = (cst.Name, cst.SimpleStatementLine, cst.Arg, cst.FunctionDef, cst.Integer)
    # Four of each kind, spread over the module.
    picked = [node for kind in kinds for node in [n for n in nodes if isinstance(n, kind)][::-1][::60][:4]]
    assert len({type(n) for n in picked}) == len(kinds)
    for node in picked:
        new = cst.Name("REPLACED") if isinstance(node, (cst.Name, cst.Integer)) else node.deep_clone()
        expected = module.deep_replace(node, new)
        assert isinstance(expected, cst.Module)
        got = c.replace_node(module, node, new)
        assert got.deep_equals(expected)
        assert isinstance(got, cst.Module) and got.code == expected.code
    with pytest.raises(c.CodemodError, match="is not inside the module edited"):
        c.replace_node(module, cst.Name("elsewhere"), cst.Name("x"))
