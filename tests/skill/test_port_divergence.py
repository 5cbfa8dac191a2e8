"""locate_divergence names the module a broken port goes wrong at (one subprocess run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from skill.porting.locate_divergence import LocateDivergenceRequest, locate_divergence

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_swapped_mlp_projection_is_located_at_the_feed_forward(tmp_path):
    shutil.copytree(REPO / "archon_models", tmp_path / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests" / "archon").mkdir(parents=True)
    shutil.copy(REPO / "tests/archon/test_llama.py", tmp_path / "tests/archon/test_llama.py")
    model = tmp_path / "archon_models/llama/model/model.py"
    source = model.read_text()
    correct = "return self.w2(F.silu(self.w1(x)) * self.w3(x))"
    assert correct in source
    model.write_text(source.replace(correct, "return self.w2(F.silu(self.w3(x)) * self.w1(x))"))

    result = locate_divergence(LocateDivergenceRequest(model_name="llama", workspace=tmp_path))

    assert result.diverged and result.logits_max_abs_diff > 1e-4
    first = result.first_divergence
    assert first is not None
    assert (first.archon_module, first.hf_module) == ("layers.0.feed_forward", "model.layers.0.mlp")
    assert first.max_abs_diff > 1e-5
    # Everything that ran before it, outside it, matched: the attention half of layer 0 is fine.
    before = [
        c
        for c in result.compared[: result.compared.index(first)]
        if not c.archon_module.startswith("layers.0.feed_forward.")
    ]
    assert before and all(c.within_tolerance for c in before)
    assert any(c.archon_module == "layers.0.attention" for c in before)
    # Its sub-projections w1/w3 saw the right input and computed the right outputs.
    inner = {c.archon_module: c for c in result.compared if c.archon_module.startswith("layers.0.feed_forward.")}
    assert inner["layers.0.feed_forward.w1"].within_tolerance and inner["layers.0.feed_forward.w3"].within_tolerance
