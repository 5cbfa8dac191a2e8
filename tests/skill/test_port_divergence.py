"""locate_divergence names the module a broken port goes wrong at (each run is one subprocess)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

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
    # The committed case's overrides: two KV heads, and the pad id HF's embedding never trains.
    case_overrides = {"num_key_value_heads": 2, "pad_token_id": 7}
    assert not plain.diverged and plain.config_overrides == case_overrides

    request = LocateDivergenceRequest(model_name="llama", workspace=workspace, config_overrides={"rms_norm_eps": 0.5})
    result = locate_divergence(request)
    assert result.config_overrides == {**case_overrides, "rms_norm_eps": 0.5}  # the case's, then the request's
    assert result.diverged and result.first_divergence is not None
    assert (result.first_divergence.archon_module, result.first_divergence.hf_module) == (
        "layers.0.attention_norm",
        "model.layers.0.input_layernorm",
    )


def _workspace_with(tmp_path: Path, family: str, old: str, new: str) -> Path:
    """A project copy whose ``family`` package has ``old`` replaced by ``new`` in model.py."""
    shutil.copytree(REPO / "archon_models", tmp_path / "archon_models", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests" / "archon").mkdir(parents=True)
    shutil.copy(REPO / f"tests/archon/test_{family}.py", tmp_path / f"tests/archon/test_{family}.py")
    model = tmp_path / f"archon_models/{family}/model/model.py"
    source = model.read_text()
    assert source.count(old) == 1, f"{family}'s model.py no longer holds {old!r} once"
    model.write_text(source.replace(old, new))
    return tmp_path


@pytest.mark.slow
def test_a_broken_weightless_final_norm_is_located_by_its_role(tmp_path):
    """Issue 20: modules without parameters were paired by execution order, and a weightless
    final norm was never compared. OLMo's norms hold no weights; the final one is broken."""
    workspace = _workspace_with(
        tmp_path,
        "olmo",
        "nn.LayerNorm(model_args.dim, eps=model_args.norm_eps, elementwise_affine=False)\n\n        self.output",
        "nn.LayerNorm(model_args.dim, eps=0.5, elementwise_affine=False)\n\n        self.output",
    )
    result = locate_divergence(LocateDivergenceRequest(model_name="olmo", workspace=workspace))
    assert result.diverged
    first = result.first_divergence
    assert first is not None
    assert (first.archon_module, first.hf_module, first.matched_by) == ("norm", "model.norm", "module_role")
    assert first.input_max_abs_diff is not None and first.input_max_abs_diff <= 1e-5 < first.max_abs_diff
    # Every weightless block norm was compared, with the HF norm of its role.
    roles = {c.archon_module: c.hf_module for c in result.compared if c.matched_by == "module_role"}
    assert roles["layers.1.attention_norm"] == "model.layers.1.input_layernorm"
    assert roles["layers.1.ffn_norm"] == "model.layers.1.post_attention_layernorm"
    assert not result.not_compared


@pytest.mark.slow
def test_a_broken_q_norm_is_located_at_the_q_norm(tmp_path):
    workspace = _workspace_with(
        tmp_path,
        "qwen3",
        "self.q_norm = RMSNorm(self.head_dim, eps=model_args.norm_eps)",
        "self.q_norm = RMSNorm(self.head_dim, eps=0.5)",
    )
    result = locate_divergence(LocateDivergenceRequest(model_name="qwen3", workspace=workspace))
    assert result.diverged
    first = result.first_divergence
    assert first is not None
    assert (first.archon_module, first.hf_module) == ("layers.0.attention.q_norm", "model.layers.0.self_attn.q_norm")
    compared = {c.archon_module: c for c in result.compared}
    assert compared["layers.0.attention.k_norm"].within_tolerance
    assert compared["layers.0.attention.k_norm"].hf_module == "model.layers.0.self_attn.k_norm"
    # The attention's kernel wrapper has no HF counterpart and is paired with nothing.
    assert "layers.0.attention.packed_attn" not in compared


class _SharedNorm(nn.Module):
    """A weightless norm run twice: on the input, and again after a projection (as
    nanochat's HF model runs one norm on the embeddings and on the last hidden states)."""

    def __init__(self, scale: float = 1.0, twice: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(4, elementwise_affine=False)
        self.proj = nn.Linear(4, 4)
        self.scale, self.twice = scale, twice

    def forward(self, x):
        h = self.proj(self.norm(x) if self.twice else x) * self.scale
        return self.norm(h)


def _run(archon: nn.Module, hf: nn.Module):
    from skill.porting.locate_divergence import _Recorder, compare_calls

    recorders = [_Recorder(archon, with_kwargs=False), _Recorder(hf, with_kwargs=True)]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        archon(x), hf(x)
    pairs = {"norm": "norm", "proj": "proj"}
    return compare_calls(*recorders, pairs, dict.fromkeys(pairs, "module_role"))


def test_each_call_of_a_module_run_twice_is_compared():
    # The second call reads a sign-flipped input: only it differs.
    compared, not_compared = _run(_SharedNorm(scale=-1.0), _SharedNorm())
    calls = [(c.archon_module, c.call, c.hf_call, c.within_tolerance) for c in compared]
    assert calls == [("norm", 0, 0, True), ("proj", 0, 0, True), ("norm", 1, 1, False)]
    assert not not_compared
    # Run once on one side, twice on the other: the calls are paired from the last.
    compared, _ = _run(_SharedNorm(twice=False), _SharedNorm())
    norm = [c for c in compared if c.archon_module == "norm"]
    assert [(c.call, c.hf_call) for c in norm] == [(0, 1)]
