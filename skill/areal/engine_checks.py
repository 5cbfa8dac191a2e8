"""What AReaL's engine must leave of a checkpoint: after its materialisation, and after a
training step.

Each model here is built by :func:`skill.areal.engine_load.build_as_engine` (AReaL's own
``ArchonEngine`` methods). The checks:

- every tensor of the checkpoint is in the model as ``from_hf`` maps it (a buffer AReaL's
  ``init_buffers`` recreates after the load, such as AReaL's ``MoE.expert_bias``, shows here);
- the router's score-correction bias in particular (``expert_bias`` wherever the adapter maps a
  checkpoint key to it), with the largest value on each side;
- a tied LM head is still the embedding's parameter;
- after one training step (AReaL's ``create_optimizer`` over the engine's parameters, then the
  auxiliary-loss-free balancing step of :func:`balance_expert_bias` on every MoE that switches
  balancing on) the bias is the checkpoint's unless the args opted into balancing, and a tied
  head is still tied; opted in, the bias moves by the balancing step from the checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from skill.areal.engine_load import EngineStandIn, build_as_engine, opted_into_balancing
from skill.harness.compare import compare_tensor_dicts
from skill.harness.inputs import PackedInputs, next_token_loss
from skill.harness.models import read_hf_checkpoint
from skill.harness.results import StageRecorder

CORRECTION_BIAS = "expert_bias"
# The opt-in of the balancing check: DeepSeek-V3's bias update speed.
BALANCING_COEFF = 1e-3


def balance_expert_bias(model: torch.nn.Module) -> int:
    """DeepSeek-V3's auxiliary-loss-free balancing step, on every MoE that switches it on
    (``load_balance_coeff`` set: AReaL's switch, the one torchtitan's optimizer hook reads):
    each expert's bias moves by the coefficient towards the experts that took fewer tokens
    than the mean (``tokens_per_expert``), and the counts start over. AReaL 1.0.4's engine
    takes no such step; a trainer that balances does. Returns the number of MoE layers moved."""
    moved = 0
    for module in model.modules():
        coeff = getattr(module, "load_balance_coeff", None)
        bias = getattr(module, CORRECTION_BIAS, None)
        if coeff is None or not isinstance(bias, torch.Tensor):
            continue
        counts = module.tokens_per_expert
        assert isinstance(counts, torch.Tensor)
        with torch.no_grad():
            bias.add_(coeff * torch.sign(counts.mean() - counts))
            counts.zero_()
        moved += 1
    return moved


def _bias_keys(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in state if k.rsplit(".", 1)[-1] == CORRECTION_BIAS)


def _expected_state(engine: EngineStandIn, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint as the package's adapter maps it onto the model."""
    return engine.state_dict_adapter.from_hf(read_hf_checkpoint(checkpoint))


def _largest(tensors: list[torch.Tensor]) -> float:
    return max((float(t.abs().max()) for t in tensors), default=0.0)


def _tied(model: Any) -> bool:
    output, embeddings = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
    return output is not None and embeddings is not None and output.weight is embeddings.weight


def check_materialised(rec: StageRecorder, engine: EngineStandIn, checkpoint: Path, label: str) -> None:
    """After AReaL's ``_materialize_and_load_weights``: the checkpoint's tensors, bias and tie."""
    model = engine.model
    expected = _expected_state(engine, checkpoint)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    rec.add(compare_tensor_dicts(f"every checkpoint tensor in the model after AReaL's load [{label}]", state, expected))
    keys = _bias_keys(expected)
    if keys:
        present = [k for k in keys if k in state]
        rec.check(
            f"score-correction bias: the checkpoint's after AReaL's load and init_buffers [{label}]",
            len(present) == len(keys) and all(torch.equal(state[k], expected[k]) for k in present),
            f"{len(keys)} layers; max |bias| checkpoint {_largest([expected[k] for k in keys]):.4g}, "
            f"model {_largest([state[k] for k in present]):.4g}"
            + (f"; missing in the model: {sorted(set(keys) - set(present))[:3]}" if len(present) < len(keys) else ""),
        )
    if model.model_args.enable_weight_tying and not model.model_args.is_critic:
        rec.check(
            f"tied LM head is the embedding's parameter after AReaL's materialisation [{label}]",
            _tied(model),
            "output.weight is tok_embeddings.weight" if _tied(model) else "output.weight is a separate parameter",
        )


def _train_step(engine: EngineStandIn, inputs: PackedInputs) -> int:
    """One step as a trainer on AReaL's engine takes it; the number of MoE layers balanced."""
    from areal.api.cli_args import OptimizerConfig
    from areal.experimental.engine.archon_engine import ArchonEngine
    from areal.experimental.engine.archon_utils import create_optimizer

    model = engine.model
    optimizer = create_optimizer(ArchonEngine._get_all_parameters(engine), OptimizerConfig(lr=1e-2))
    logits = model(inputs.tokens, inputs.positions, inputs.cu_seqlens, inputs.max_seqlen)
    next_token_loss(logits, inputs.tokens, inputs.doc_lens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return balance_expert_bias(model)


def check_training_step(
    rec: StageRecorder, spec: Any, hf_config: Any, checkpoint: Path, inputs: PackedInputs, attn_type: str
) -> None:
    """The score-correction bias and the tie through one training step, and the balancing opt-in."""
    engine = build_as_engine(spec, hf_config, checkpoint, attn_type)
    model = engine.model
    expected = _expected_state(engine, checkpoint)
    keys = _bias_keys(expected)
    balanced = _train_step(engine, inputs)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if keys:
        whole = all(k in state for k in keys)
        moved = _largest([state[k] - expected[k] for k in keys]) if whole else None
        rec.check(
            "score-correction bias fixed through a training step (not opted into balancing)",
            moved == 0.0 and balanced == 0,
            f"{balanced} MoE layers switch balancing on (load_balance_coeff); "
            + ("bias missing from the model" if moved is None else f"max |change| {moved:.3g}"),
        )
        _check_balancing_opt_in(rec, spec, hf_config, checkpoint, inputs, attn_type, expected, keys)
    if model.model_args.enable_weight_tying and not model.model_args.is_critic:
        same = _tied(model) and torch.equal(state["output.weight"], state["tok_embeddings.weight"])
        rec.check(
            "tied LM head still the embedding's parameter after a training step",
            same,
            "one parameter, trained once" if same else "the head and the embedding were trained apart",
        )


def _check_balancing_opt_in(
    rec: StageRecorder,
    spec: Any,
    hf_config: Any,
    checkpoint: Path,
    inputs: PackedInputs,
    attn_type: str,
    expected: dict[str, torch.Tensor],
    keys: list[str],
) -> None:
    engine = build_as_engine(opted_into_balancing(spec, BALANCING_COEFF), hf_config, checkpoint, attn_type)
    state = engine.model.state_dict()
    kept = all(k in state and torch.equal(state[k], expected[k]) for k in keys)
    balanced = _train_step(engine, inputs)
    after = engine.model.state_dict()
    steps = [(after[k] - expected[k]).abs() for k in keys if k in after]
    moved = bool(steps) and all(float(s.max()) <= BALANCING_COEFF * (1 + 1e-4) for s in steps)
    moved = moved and any(float(s.max()) > 0 for s in steps)
    rec.check(
        f"opted into balancing (load_balance_coeff={BALANCING_COEFF}): the bias starts as the checkpoint's "
        "and one balancing step moves it",
        kept and moved and balanced == len(keys),
        f"kept through AReaL's load: {kept}; {balanced} of {len(keys)} layers balanced; "
        f"max |change| {_largest(steps):.3g}",
    )
