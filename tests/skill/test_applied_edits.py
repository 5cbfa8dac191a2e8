"""The steps after edit_model follow the edits it applied, not only the analysis' selection
(issue 20, agent20d's friction 5 and 6): ctrl's hand port passed ``remove_rope`` by name (the
analysis read its sinusoidal positions as no feature it knows, so selected no RoPE removal),
and write_parallelize still gave the attention the five inputs of a RoPE signature, set_rope
wrote "HF's default rotary embedding" and the header's edits left remove_rope out. The analysis
reads ctrl's table since; a RoPE family with both edits named by hand stands in for it here."""

from __future__ import annotations

from pathlib import Path

import pytest

from skill.porting.applied_edits import recorded_edits, stamp_generated_line
from skill.porting.common import staged
from skill.porting.copy_reference import CopyReferenceRequest, copy_reference
from skill.porting.edit_model import EditModelRequest, edit_model
from skill.porting.model_edits import describe
from skill.porting.plan import plan_for
from skill.porting.provenance import header_lines
from skill.porting.run_test_stage import ensure_test_file
from skill.porting.set_rope import SetRopeRequest, set_rope
from skill.porting.write_parallelize import (
    ATTENTION_INPUTS,
    ROPE_ATTENTION_INPUTS,
    WriteParallelizeRequest,
    write_parallelize,
)
from tests.mcp.conftest import make_workspace

SOURCE = "mistral"  # a RoPE family: the analysis selects no remove_rope and no embedding scale
NAME = "mistral_named"


def test_recorded_edits_read_back_what_the_stamp_wrote():
    many = [f"edit_number_{i}" for i in range(12)]  # wraps over continuation lines
    text = stamp_generated_line('"""doc"""\n', "qwen2", many)
    assert text.count("\n") > 2 and recorded_edits(text) == many
    assert recorded_edits(stamp_generated_line(text, "qwen2", [])) == []
    assert recorded_edits('"""no header"""\n') is None


@pytest.mark.slow
def test_edits_named_on_edit_model_decide_rope_the_tp_plan_and_the_header(tmp_path: Path):
    workspace = make_workspace(tmp_path / "ws")
    package = workspace / "archon_models" / NAME
    copy_reference(CopyReferenceRequest(workspace=workspace, model_name=NAME, reference="qwen2", model_types=[SOURCE]))
    request = {"workspace": workspace, "model_name": NAME, "source": SOURCE}
    selected = edit_model(EditModelRequest(**request, allow_unsupported=True)).edits
    assert not {"remove_rope", "embedding_sqrt_dim"} & set(selected)  # the analysis' own selection
    named = [*selected, "remove_rope", "embedding_sqrt_dim"]
    applied = edit_model(EditModelRequest(**request, allow_unsupported=True, edits=named)).edits

    model = (package / "model" / "model.py").read_text()
    assert recorded_edits(model) == applied and {"remove_rope", "embedding_sqrt_dim"} <= set(applied)
    docstring = " ".join(model.split('"""')[1].split())
    assert "no RoPE" in docstring and "sqrt(dim)-scaled embeddings" in docstring, docstring
    assert " ".join(describe(plan_for(SOURCE), "MistralNamed", applied).split()) == docstring
    set_rope(SetRopeRequest(**request))
    rope = (package / "model" / "rope.py").read_text()
    assert "applies no RoPE" in rope and "default rotary embedding" not in rope
    write_parallelize(WriteParallelizeRequest(**request))
    plan = (package / "infra" / "parallelize.py").read_text()
    assert ATTENTION_INPUTS.splitlines()[3].strip() in plan
    assert ROPE_ATTENTION_INPUTS.splitlines()[3].strip() not in plan
    pristine = (workspace / "archon_models" / "qwen2" / "model" / "model.py").read_text()
    header = " ".join(header_lines(plan_for(SOURCE), NAME, pristine, recorded_edits(model)).split())
    assert "remove_rope, embedding_sqrt_dim." in header.replace("#", " ").replace("  ", " ")

    (workspace / "tests" / "archon" / f"test_{NAME}.py").unlink(missing_ok=True)
    with staged(workspace) as tree:
        ensure_test_file(tree, NAME, SOURCE)
    test_file = (workspace / "tests" / "archon" / f"test_{NAME}.py").read_text()
    assert recorded_edits(test_file) == applied
    assert "no RoPE" in " ".join(test_file.split('"""')[1].split())
