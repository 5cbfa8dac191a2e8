"""Stage 6: Archon weights written back as an HF checkpoint load in transformers.

This is the path a trained Archon model takes to be published: ``to_hf``, sharded
safetensors with ``model.safetensors.index.json``, ``from_pretrained``. The weights are
the loaded ones plus seeded noise, as after training, so nothing already on disk can
stand in for them. The adapter built with ``hf_assets_path`` must read the same shard
layout back (``fqn_to_index_mapping``), which is how Archon saves in the original layout.

The reloaded model's logits are judged by its own float64 run (``skill.harness.truth``):
Archon's fp32 error against that truth within a small multiple of HF's own; and the Archon
model itself run in float64 is held to the tighter bound of a float64 run.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from archon_models.base import SAFETENSORS_INDEX
from skill.harness.case import ModelCase
from skill.harness.inputs import PackedInputs, make_packed_inputs, special_token_ids
from skill.harness.models import ArchonModel, build_model_pair, copy_remote_code
from skill.harness.parity import float64_copy, float64_run, float64_truth
from skill.harness.results import StageRecorder, StageResult, run_stage
from skill.harness.truth import TRUTH_DTYPE, judge

MIN_SHARDS = 2
TRAINING_NOISE_STD = 0.02


def perturb_weights(archon: ArchonModel, seed: int) -> None:
    """Move every parameter by seeded noise, standing in for a training step."""
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for param in archon.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * TRAINING_NOISE_STD)


def write_sharded_checkpoint(
    hf_state: dict[str, torch.Tensor], directory: Path, min_shards: int = MIN_SHARDS
) -> dict[str, str]:
    """HF-named tensors -> ``model-0000i-of-0000n.safetensors`` + index; returns the weight map."""
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    largest = max(t.numel() * t.element_size() for t in hf_state.values())
    # Shards of about total/(min_shards+1) bytes give at least min_shards files as long
    # as no single tensor dominates (checked by the caller through the index).
    max_shard_size = max(largest, total // (min_shards + 1))
    tensors = {k: v.detach().contiguous().clone() for k, v in hf_state.items()}
    save_torch_state_dict(tensors, directory, max_shard_size=max_shard_size)
    index_file = directory / SAFETENSORS_INDEX
    if not index_file.is_file():
        return dict.fromkeys(hf_state, "model.safetensors")
    return json.loads(index_file.read_text())["weight_map"]


def _shard_number(filename: str) -> int:
    """1-based shard of ``model-00002-of-00003.safetensors``; 1 for an unsharded file."""
    parts = Path(filename).stem.split("-")
    return int(parts[-3]) if len(parts) >= 3 and parts[-2] == "of" else 1


def _hf_packed_logits(model: PreTrainedModel, inputs: PackedInputs) -> torch.Tensor:
    """HF's logits of each document alone, concatenated."""
    with torch.no_grad():
        return torch.cat([model(input_ids=doc).logits for doc in inputs.documents()], dim=1)


def _archon_packed_logits(model: nn.Module, inputs: PackedInputs) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs.tokens, inputs.positions, inputs.cu_seqlens, inputs.max_seqlen)


def _float64_archon_logits(model: nn.Module, inputs: PackedInputs) -> torch.Tensor:
    """The packed logits of a float64 copy of ``model`` (its trained weights, exactly)."""
    return _archon_packed_logits(copy.deepcopy(model).to(TRUTH_DTYPE), inputs)


def run_checkpoint_stage(
    case: ModelCase, workdir: str | Path | None = None, raise_on_failure: bool = True
) -> StageResult:
    """Stage 6: write back, reload in transformers, compare keys, logits and the shard index."""

    def body(rec: StageRecorder) -> None:
        with tempfile.TemporaryDirectory(prefix="archon-stage6-", dir=workdir) as tmp:
            pair = build_model_pair(case, tmp)
            archon = pair.archon
            perturb_weights(archon, case.seed)
            out = Path(tmp) / "archon_export"
            out.mkdir()
            pair.hf_config.save_pretrained(str(out))
            copy_remote_code(case, out)
            hf_state = archon.adapter.to_hf(archon.model.state_dict())
            weight_map = write_sharded_checkpoint(hf_state, out)
            shards = sorted(set(weight_map.values()))
            rec.check(
                f"sharded into at least {MIN_SHARDS} files with an index",
                len(shards) >= MIN_SHARDS and (out / SAFETENSORS_INDEX).is_file(),
                f"{len(shards)} shards: {shards}",
            )

            # output_loading_info=True makes it a (model, info) pair; transformers types the model only.
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                str(out),
                output_loading_info=True,
                dtype=torch.float32,
                attn_implementation="eager",
                trust_remote_code=case.trust_remote_code,
            )
            reloaded, info = loaded
            reloaded.eval()
            for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
                found = sorted(str(item) for item in info.get(kind, []))
                rec.check(
                    f"from_pretrained reports no {kind.replace('_', ' ')}",
                    not found,
                    f"{found[:5]}" if found else "",
                )

            inputs = make_packed_inputs(
                case.doc_lens, pair.hf_config.vocab_size, seed=case.seed, special=special_token_ids(pair.hf_config)
            )
            expected = _hf_packed_logits(reloaded, inputs)
            got = _archon_packed_logits(archon.model, inputs)
            name = "logits of the reloaded HF model equal Archon's"
            truth = float64_truth(rec, lambda: _hf_packed_logits(float64_copy(reloaded), inputs), "reloaded model")
            rec.add(judge(name, got, expected, truth))
            if truth is not None:
                float64 = float64_run(rec, lambda: _float64_archon_logits(archon.model, inputs), "reloaded model")
                if float64 is not None:
                    rec.add(judge(f"{name} [float64]", float64, expected, truth, float64_run=True))

            adapter = archon.spec.state_dict_adapter_class(pair.hf_config, str(out))
            mapping = adapter.fqn_to_index_mapping or {}
            expected_mapping = {key: _shard_number(name) for key, name in weight_map.items()}
            wrong = sorted(k for k in set(mapping) | set(expected_mapping) if mapping.get(k) != expected_mapping.get(k))
            rec.check(
                "hf_assets_path: fqn_to_index_mapping reads the shard of every key",
                bool(mapping) and not wrong,
                f"{len(wrong)} keys disagree with the index, e.g. "
                + ", ".join(f"{k}: {mapping.get(k)} vs {expected_mapping.get(k)}" for k in wrong[:3])
                if wrong
                else f"{len(mapping)} keys over shards {sorted(set(mapping.values()))}",
            )

    return run_stage(case, 6, body, raise_on_failure)
