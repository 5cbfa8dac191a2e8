"""Edits compose (issue 8, item 2): remote-code families of our own, each combining
features across both references, port with zero hand edits and pass stages 1-6.

The families live in ``tests/composition/<name>/`` as a ``configuration_<name>.py`` +
``modeling_<name>.py`` pair written the way HF remote code is (a family in ``DERIVED`` is
another's pair, renamed, with a few lines of its modeling code replaced). Each test copies one into
a temporary checkpoint folder, writes its ``config.json`` (with ``auto_map``) and tiny
noisy random weights with ``save_pretrained``, and runs ``port_model`` on that folder
in a scratch workspace. Stage 4 then also compares the folder's own weights
(``from_pretrained(folder, trust_remote_code=True)`` against the Archon model loaded
from those files through the adapter).

| family   | reference | features combined                                                      |
|----------|-----------|------------------------------------------------------------------------|
| sandmoe  | qwen3     | MoE + full-width QK RMSNorm + sandwich norms + residual multiplier     |
| partyarn | qwen2     | partial rotary + YaRN-scaled RoPE (and q/k/v bias)                     |
| sigmoe   | qwen3     | interleaved RoPE + sigmoid-scored router MoE                           |
| capscale | qwen2     | embedding multiplier + final logit soft-cap + tied LM head             |
| sigate   | qwen2     | gated attention output: sigmoid, per element, biased gate projection   |
| headgate | qwen2     | gated attention output: softplus, per head + per-head QK RMSNorm + GQA |
| postqk   | qwen2     | post-LN blocks + no final norm + per-head QK RMSNorm + tied LM head    |
| postmoe  | qwen3     | MoE + post-LN blocks + no final norm + full-width QK RMSNorm + residual multiplier |
| revrot   | qwen2     | RoPE turning each pair the other way ((x2, -x1), as nanochat's) + partial  |
|          |           | rotary + YaRN-scaled RoPE + q/k/v bias                                    |
| embrms   | qwen2     | an RMSNorm module on the embeddings + untied LM head: stage 5 runs PP=2 with the |
|          |           | norm kept on the first pipeline stage (the package's own pipelining_fn)           |
| diffmoe  | qwen3     | differential attention (written with doubled values, its own names) + GQA +      |
|          |           | per-head QK RMSNorm + sliding window on every other layer + MoE                  |
| epsmoe   | qwen3     | sandmoe (derived: DERIVED) with block norms of a constant epsilon (feature module |
|          |           | constant_norm_eps) + sandwich norms + full-width QK RMSNorm + MoE + residual multiplier |
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from skill.harness.case import ModelCase
from skill.harness.models import build_hf_model
from skill.porting.port_model import PortModelRequest, port_model
from tests.skill.test_port_rope import _workspace

REPO = Path(__file__).resolve().parents[2]
FAMILIES_DIR = REPO / "tests" / "composition"

# The model edits each family must get (a subset of result.edits), and facts of the plan
# and of the generated files that no model edit names.
FAMILIES: dict[str, dict] = {
    "sandmoe": {
        "reference": "qwen3",
        "edits": {
            "full_width_qk_norm",
            "sandwich_norm",
            "residual_multiplier",
            "all_layers_moe",
        },
        "files": {
            "model/model.py": [
                "self.post_attention_norm(",
                "* self.residual_multiplier",
                "RMSNorm(self.n_heads * self.head_dim",
            ]
        },
    },
    "partyarn": {
        "reference": "qwen2",
        "edits": {"rope_cache", "projection_bias"},
        "files": {
            "model/args.py": ["rotary_dim", "rope_freq_scaling"],
            "model/rope.py": ["rotary_dim"],
        },
    },
    "sigmoe": {
        "reference": "qwen3",
        "edits": {"remove_qk_norm", "all_layers_moe"},
        "files": {
            "model/args.py": ["moe_args.score_func = hf_config.scoring_func"],
            "model/rope.py": ["x[..., ::2]"],
        },
    },
    "capscale": {
        "reference": "qwen2",
        "edits": {"embedding_multiplier", "final_softcap"},
        "files": {
            "model/model.py": [
                "self.model_args.embedding_multiplier",
                "torch.tanh(logits / cap) * cap",
            ]
        },
    },
    "sigate": {
        "reference": "qwen2",
        "edits": {"output_gate", "projection_bias"},
        "files": {
            "model/model.py": [
                "self.wg = nn.Linear(model_args.dim, self.n_heads * self.head_dim, bias=True)",
                "torch.sigmoid(self.wg(x))",
            ],
            "infra/parallelize.py": ['"attention.wg": ColwiseParallel()'],
        },
    },
    "postmoe": {
        "reference": "qwen3",
        "edits": {"post_ln", "no_final_norm", "full_width_qk_norm", "residual_multiplier", "all_layers_moe"},
        "files": {
            "model/model.py": [
                "x = self.attention_norm(\n",
                "x + self.attention(x, rope_cache, positions, cu_seqlens, max_seqlen) * self.residual_multiplier",
                "self.norm: nn.Module | None = None",
            ],
        },
    },
    "postqk": {
        "reference": "qwen2",
        "edits": {"post_ln", "no_final_norm", "per_head_qk_norm"},
        "files": {
            "model/model.py": [
                "x = self.attention_norm(x + self.attention(x, rope_cache, positions, cu_seqlens, max_seqlen))",
                "self.norm: nn.Module | None = None",
            ],
            "infra/parallelize.py": ['"ffn_norm": SequenceParallel(use_local_output=True)'],
        },
    },
    "revrot": {
        "reference": "qwen2",
        "edits": {"reversed_rotation", "rope_cache", "projection_bias"},
        "files": {"model/model.py": ["cos, sin = cache.chunk(2, dim=-1)", "return torch.cat([cos, -sin], dim=-1)"]},
    },
    "embrms": {
        "reference": "qwen2",
        "edits": {"embedding_norm"},
        "files": {
            "model/model.py": ["self.embedding_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)"],
            "infra/parallelize.py": ['FIRST_STAGE_MODULES: tuple[str, ...] = ("embedding_norm",)'],
            "spec.py": ["pipelining_fn=pipeline_embrms"],
        },
        # Issue 20: AReaL's pipeline split set the norm to None on every stage.
        "stage5_checks": ["gradients (pp=2, stage 0)", "gradients (pp=2, stage 1)", "logits (pp=2, last stage)"],
    },
    "diffmoe": {
        "reference": "qwen3",
        "edits": {"differential_attention", "eager_attention", "all_layers_moe"},
        "files": {
            "model/model.py": [
                "DifferentialAttention(self.packed_attn, layer_id, self.head_dim, model_args.norm_eps)",
                "lambda_diff=self.diff_lambda()",
            ],
            "model/state_dict_adapter.py": ['"model.layers.{}.self_attn.mix_qa": "layers.{}.attention.diff_lambda.q1"'],
            "infra/parallelize.py": [
                '"attention.diff_lambda": ReplicateParallel(local_output_grad_placements=(Partial(),))'
            ],
        },
    },
    "epsmoe": {
        "reference": "qwen3",
        "edits": {"constant_norm_eps", "sandwich_norm", "full_width_qk_norm", "residual_multiplier", "all_layers_moe"},
        "files": {
            "model/model.py": [
                "BLOCK_NORM_EPS = 1e-05  # a constant of the modeling code, not rms_norm_eps (norm_eps)",
                "self.post_ffn_norm = RMSNorm(model_args.dim, eps=BLOCK_NORM_EPS)",
                "self.norm: RMSNorm | None = RMSNorm(model_args.dim, eps=model_args.norm_eps)",
            ],
            "../../tests/archon/test_epsmoe.py": ['"rms_norm_eps": 0.01'],
        },
    },
    "headgate": {
        "reference": "qwen2",
        "edits": {"output_gate", "per_head_qk_norm"},
        "files": {
            "model/model.py": [
                "self.wg = nn.Linear(model_args.dim, self.n_heads, bias=False)",
                "gate_per_head(out.view(bs, seqlen, -1), F.softplus(self.wg(x)))",
            ],
            "infra/parallelize.py": ['"attention.wg": ColwiseParallel()'],
        },
    },
}


# Ported and proven in the default run (each port costs 15-25 worker-seconds): headgate, edits of
# the qwen2 reference composed (a softplus per-head output gate, per-head QK RMSNorm, GQA). The
# default run proves a remote-code MoE port through tests/skill/test_moe_fuzz_layouts.py and a
# package's own pipelining_fn under PP=2 through bloom's stage 5. The others carry the
# ``every_family`` marker, which .ci/run runs.
DEFAULT_RUN = frozenset({"headgate"})


def _family_param(name: str):  # type: ignore[no-untyped-def]
    return pytest.param(name, id=name, marks=() if name in DEFAULT_RUN else pytest.mark.every_family)


def test_the_default_run_families_are_composition_families():
    assert set(FAMILIES) >= DEFAULT_RUN, sorted(DEFAULT_RUN - set(FAMILIES))


def _camel(name: str) -> str:
    return name[0].upper() + name[1:]


# Families written as another family's code, renamed, with a few lines changed: the family, and
# its source family with the replacements in its modeling file.
DERIVED: dict[str, tuple[str, dict[str, str]]] = {
    # sandmoe with the four block norms built with a constant eps=1e-5 (the final and QK norms
    # still read rms_norm_eps, 1e-6 by default).
    "epsmoe": (
        "sandmoe",
        {
            f"self.{norm} = SandmoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)": (
                f"self.{norm} = SandmoeRMSNorm(config.hidden_size, eps=1e-5)"
            )
            for norm in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        },
    ),
}


def _write_family(folder: Path, name: str) -> None:
    """The family's ``configuration_<name>.py`` and ``modeling_<name>.py`` in ``folder``."""
    if name not in DERIVED:
        shutil.copytree(FAMILIES_DIR / name, folder, ignore=shutil.ignore_patterns("__pycache__"))
        return
    source, replacements = DERIVED[name]
    folder.mkdir(parents=True)
    for part in ("configuration", "modeling"):
        text = (FAMILIES_DIR / source / f"{part}_{source}.py").read_text()
        if part == "modeling":
            for old, new in replacements.items():
                assert old in text, f"{source}'s modeling code no longer has {old!r}"
                text = text.replace(old, new)
        renamed = text.replace(_camel(source), _camel(name)).replace(source, name)
        (folder / f"{part}_{name}.py").write_text(renamed)


def make_checkpoint(tmp_path: Path, name: str) -> Path:
    """The family's folder with ``config.json`` (auto_map) and tiny noisy weights."""
    folder = tmp_path / f"{name}-checkpoint"
    _write_family(folder, name)
    camel = _camel(name)
    # A config.json naming only the family's code: every value comes from the config
    # class's defaults, which the tiny config then shrinks.
    auto_map = {
        "AutoConfig": f"configuration_{name}.{camel}Config",
        "AutoModelForCausalLM": f"modeling_{name}.{camel}ForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps({"model_type": name, "auto_map": auto_map}))
    case = ModelCase(model_type=name, source=str(folder), trust_remote_code=True, seed=7)
    model = build_hf_model(case)
    model.save_pretrained(str(folder), safe_serialization=True)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForCausalLM"] == auto_map["AutoModelForCausalLM"]
    assert sorted(folder.glob("*.safetensors")), "save_pretrained wrote no weights"
    return folder


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", [_family_param(n) for n in sorted(FAMILIES)])
def test_family_ports_with_zero_hand_edits(tmp_path, name):
    expected = FAMILIES[name]
    folder = make_checkpoint(tmp_path, name)
    root = _workspace(tmp_path)

    # Without trust_remote_code: refused in one line naming the fix, nothing written.
    before = _files(root)
    refused = port_model(PortModelRequest(source=str(folder), stages=[], workspace=root))
    assert not refused.passed and refused.failed_step == "analyze"
    assert refused.error is not None and "\n" not in refused.error.strip()
    assert "trust_remote_code" in refused.error, refused.error
    assert _files(root) == before, "a refused port wrote files"

    result = port_model(
        PortModelRequest(
            source=str(folder),
            trust_remote_code=True,
            stages=[1, 2, 3, 4, 5, 6],
            workspace=root,
        )
    )
    failing = [f"{s.step}: {s.detail}" for s in result.steps if not s.ok]
    assert result.passed, f"{result.failed_step}: {result.error}\n" + "\n".join(failing)
    assert result.reference == expected["reference"]
    missing = expected["edits"] - set(result.edits)
    assert not missing, f"edits {sorted(missing)} not applied (applied: {result.edits})"

    assert [r.stage for r in result.stage_results] == [1, 2, 3, 4, 5, 6]
    assert all(r.passed for r in result.stage_results)
    # Stage 4 also compared the folder's own weights (one sequence and packed documents, for
    # varlen, sdpa and the package's float64 run), judged against HF's float64 run.
    parity = next(r for r in result.stage_results if r.stage == 4)
    own = [c for t in parity.tests for c in t.checks if "source folder's own weights" in c.name]
    assert len(own) == 6 and all(c.passed for c in own), [c.name for c in own]
    assert all(c.error_vs_truth is not None for c in own), [c.line() for c in own]
    assert result.max_abs_logit_diff is not None and result.max_abs_logit_diff < 1e-5

    distributed = next(r for r in result.stage_results if r.stage == 5)
    ran = {c.name: c for t in distributed.tests for c in t.checks}
    for check in expected.get("stage5_checks", []):
        assert check in ran and ran[check].passed, f"stage 5 did not pass {check!r}: {sorted(ran)}"

    package = root / "archon_models" / name
    for relative, needles in expected["files"].items():
        text = (package / relative).read_text()
        for needle in needles:
            assert needle in text, f"{relative} lacks {needle!r}"
