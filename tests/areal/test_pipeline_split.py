"""Inside a real AReaL 1.0.4: a package with modules around its blocks keeps them on the
pipeline stages that run them (issue 20, item 2).

AReaL's own ``pipeline_llm`` sets every top-level module outside tok_embeddings, layers,
norm and output/score to None; the engine gives such a package a pipelining function of
its own, built on AReaL's public ``generate_llm_fqn_per_model_part`` and
``pipeline_module_split``. OPT (learned positions, and with ``word_embed_proj_dim`` below the
width, projections in and out) is exported into a scratch copy of AReaL and split there,
untied, on the meta device as AReaL's engine splits it, over two gloo ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from skill.areal.export import PROJECT_ROOT, stage_export
from skill.codemod import StagedTree, Workspace
from tests.areal.conftest import AReaLInstall

pytestmark = pytest.mark.areal

_SPLIT = r"""
import json, types
import torch
from transformers import OPTConfig
from areal.experimental.models.archon import get_model_spec
from areal.experimental.models.archon.parallel_dims import ArchonParallelDims
from areal.experimental.models.archon.pipeline_parallel import pipeline_llm
from skill.harness.distributed import launch

spec = get_model_spec("opt")
hf_config = OPTConfig(
    vocab_size=128, hidden_size=64, word_embed_proj_dim=32, num_hidden_layers=4, ffn_dim=128,
    num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
)
args = spec.model_args_class.from_hf_config(hf_config)
config = types.SimpleNamespace(
    pp_schedule="1F1B", pp_layers_per_stage=None, pp_first_stage_less_layers=1, pp_last_stage_less_layers=1
)


def kept(rank, world_size, split):
    with torch.device("meta"):
        model = spec.model_class(args)
    dims = ArchonParallelDims(pp=2, dp_shard=1, world_size=2, device_type="cpu")
    _, parts, _, _ = split(model, torch.device("cpu"), dims, config, lambda part, *a, **k: part)
    (part,) = parts
    return sorted(name for name, child in part.named_children() if not isinstance(child, torch.nn.ModuleDict))


print(json.dumps({
    "package": launch(kept, 2, args=(spec.pipelining_fn,)),
    "pipeline_llm": launch(kept, 2, args=(pipeline_llm,)),
    "pipelining_fn": spec.pipelining_fn.__name__,
}))
"""


def test_the_package_s_pipelining_fn_keeps_its_modules_in_areal(areal_install: AReaLInstall, tmp_path: Path):
    root = areal_install.copy_to(tmp_path / "areal-tree")
    tree = StagedTree(Workspace(root, marker="areal/experimental/models/archon"))
    stage_export(tree, PROJECT_ROOT, "opt", overwrite=True)
    tree.commit()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(PROJECT_ROOT)])}
    run = subprocess.run(
        [str(areal_install.python), "-c", _SPLIT], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["pipelining_fn"] == "pipeline_opt"
    first, last = found["package"]
    assert first == ["pos_embeddings", "project_in", "tok_embeddings"]
    assert last == ["norm", "output", "project_out"]
    # AReaL's own split drops them: what the package's function is for.
    assert found["pipeline_llm"] == [["tok_embeddings"], ["norm", "output"]]
