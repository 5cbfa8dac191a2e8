"""locate_divergence names the module a broken port goes wrong at (each run is one subprocess)."""

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


def _llama_workspace(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "archon_models", tmp_path / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests" / "archon").mkdir(parents=True)
    shutil.copy(REPO / "tests/archon/test_llama.py", tmp_path / "tests/archon/test_llama.py")
    return tmp_path


def _with_activation_module(workspace: Path, activation: str) -> None:
    """Give llama's FeedForward an activation module (no parameters), as HF's MLP has."""
    model = workspace / "archon_models/llama/model/model.py"
    source = model.read_text()
    init = "        self.w3 = nn.Linear(dim, hidden_dim, bias=False)\n"
    call = "return self.w2(F.silu(self.w1(x)) * self.w3(x))"
    assert init in source and call in source
    source = source.replace(init, init + f"        self.act_fn = {activation}\n")
    model.write_text(source.replace(call, "return self.w2(self.act_fn(self.w1(x)) * self.w3(x))"))


@pytest.mark.slow
def test_a_mutation_in_a_module_without_parameters_is_located(tmp_path):
    workspace = _llama_workspace(tmp_path)
    _with_activation_module(workspace, "nn.GELU()")  # HF llama's act_fn is SiLU

    result = locate_divergence(LocateDivergenceRequest(model_name="llama", workspace=workspace))

    assert result.diverged
    first = result.first_divergence
    assert first is not None
    assert (first.archon_module, first.hf_module) == ("layers.0.feed_forward.act_fn", "model.layers.0.mlp.act_fn")
    assert first.matched_by == "execution_order" and first.input_max_abs_diff is not None
    assert first.input_max_abs_diff <= 1e-5 < first.max_abs_diff  # right input, wrong output: the module itself
    # Its siblings w1 and w3 match; the difference reaches w2 through it, not from them.
    compared = {c.archon_module: c for c in result.compared}
    assert (
        compared["layers.0.feed_forward.w1"].within_tolerance and compared["layers.0.feed_forward.w3"].within_tolerance
    )
    assert not compared["layers.0.feed_forward.w2"].within_tolerance
    # Every layer's activation module was paired with that layer's HF activation, in order.
    pairs = {c.archon_module: c.hf_module for c in result.compared if c.matched_by == "execution_order"}
    assert pairs["layers.1.feed_forward.act_fn"] == "model.layers.1.mlp.act_fn"


@pytest.mark.slow
def test_config_overrides_reach_both_sides_and_expose_what_a_default_hides(tmp_path):
    # A port that hard-codes the default norm epsilon: the default config hides it.
    workspace = _llama_workspace(tmp_path)
    args = workspace / "archon_models/llama/model/args.py"
    assert "norm_eps=hf_config.rms_norm_eps," in args.read_text()
    args.write_text(args.read_text().replace("norm_eps=hf_config.rms_norm_eps,", "norm_eps=1e-6,"))

    plain = locate_divergence(LocateDivergenceRequest(model_name="llama", workspace=workspace))
    assert not plain.diverged and plain.config_overrides == {"num_key_value_heads": 2}

    request = LocateDivergenceRequest(model_name="llama", workspace=workspace, config_overrides={"rms_norm_eps": 0.5})
    result = locate_divergence(request)
    assert result.config_overrides == {"num_key_value_heads": 2, "rms_norm_eps": 0.5}  # the case's, then the request's
    assert result.diverged and result.first_divergence is not None
    assert (result.first_divergence.archon_module, result.first_divergence.hf_module) == (
        "layers.0.attention_norm",
        "model.layers.0.input_layernorm",
    )
