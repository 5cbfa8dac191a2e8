"""Stage 4: the Archon model computes what the HF model computes.

A seeded tiny HF model is saved with ``save_pretrained`` and the Archon model is loaded
from those files through the adapter. Compared: logits of one sequence; logits of
several packed documents of different lengths against HF run on each document alone
(proving no document attends to another); the loss; and the gradient of that loss
w.r.t. every parameter, matched under checkpoint keys. Both attention backends run.

When the case names a ``source`` folder that holds safetensors weights (a checkpoint,
possibly with its own remote code), the folder's own model is compared too: HF
``from_pretrained(folder)`` against the Archon model loaded from that folder's files
through the adapter, logits of one sequence and of the packed documents.

In fp32 the tolerance is ``torch.testing.assert_close``'s default. The bf16 variant
(CUDA only) cannot use a fixed tolerance: the Archon kernels (flash varlen) and HF's
eager attention round differently, and how much depends on the tensor. It compares
both bf16 models with an fp32 HF run of the same weights and requires the Archon error
to stay within a small multiple of HF's own bf16 error.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from skill.harness.case import ModelCase
from skill.harness.compare import compare_tensor_dicts, compare_tensors, max_abs_diff
from skill.harness.inputs import (
    PackedInputs,
    make_packed_inputs,
    next_token_loss,
    special_token_ids,
)
from skill.harness.models import (
    ArchonModel,
    build_hf_config,
    build_hf_model,
    hf_gradients_as_saved,
    load_archon_model,
    save_hf_checkpoint,
)
from skill.harness.results import CheckResult, StageRecorder, StageResult, run_stage

logger = logging.getLogger(__name__)

ATTN_TYPES = ("varlen", "sdpa")

# bf16 variant: Archon's error against fp32 may be this many times HF's own bf16 error
# (two equally valid roundings differ by about a factor of two; four leaves margin)...
BF16_ERROR_RATIO = 4.0
# ...plus this fraction of the reference's magnitude, for tensors HF happens to get
# almost exactly right in bf16 (bf16 carries 8 bits of mantissa: 2**-8 ~ 4e-3).
BF16_ERROR_FLOOR = 4e-3


@dataclass
class Reference:
    """HF outputs the Archon model is compared with, already under checkpoint keys."""

    single_logits: torch.Tensor
    packed_logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def single_sequence(inputs: PackedInputs) -> PackedInputs:
    """All tokens of ``inputs`` as one document."""
    total = inputs.num_tokens
    return PackedInputs(
        tokens=inputs.tokens,
        positions=torch.arange(total, device=inputs.tokens.device).unsqueeze(0),
        cu_seqlens=torch.tensor([0, total], dtype=torch.int32, device=inputs.tokens.device),
        max_seqlen=total,
        doc_lens=(total,),
    )


def hf_reference(model: PreTrainedModel, inputs: PackedInputs, grads_dir: Path) -> Reference:
    """HF on the whole row as one sequence, then on each document alone, with gradients."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        single = model(input_ids=inputs.tokens).logits
    packed = torch.cat([model(input_ids=doc).logits for doc in inputs.documents()], dim=1)
    loss = next_token_loss(packed, inputs.tokens, inputs.doc_lens)
    loss.backward()
    grads = hf_gradients_as_saved(model, grads_dir)
    model.zero_grad(set_to_none=True)
    return Reference(single_logits=single.detach(), packed_logits=packed.detach(), loss=loss.detach(), grads=grads)


def archon_outputs(archon: ArchonModel, inputs: PackedInputs) -> Reference:
    """The same four things from the Archon model, gradients converted with ``to_hf``."""
    model = archon.model
    model.zero_grad(set_to_none=True)
    whole = single_sequence(inputs)
    with torch.no_grad():
        single = model(whole.tokens, whole.positions, whole.cu_seqlens, whole.max_seqlen)
    packed = model(inputs.tokens, inputs.positions, inputs.cu_seqlens, inputs.max_seqlen)
    loss = next_token_loss(packed, inputs.tokens, inputs.doc_lens)
    loss.backward()
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
    }
    # Persistent buffers are checkpoint state without a gradient (as HF's side saves them).
    grads.update((name, torch.zeros_like(b)) for name, b in model.state_dict().items() if name not in grads)
    model.zero_grad(set_to_none=True)
    return Reference(
        single_logits=single.detach(),
        packed_logits=packed.detach(),
        loss=loss.detach(),
        grads=archon.adapter.to_hf(grads),
    )


def check_fp32(rec: StageRecorder, ref: Reference, got: Reference, inputs: PackedInputs, label: str) -> None:
    rec.add(
        compare_tensors(f"logits, one sequence of {inputs.num_tokens} [{label}]", got.single_logits, ref.single_logits)
    )
    rec.add(
        compare_tensors(
            f"logits, {len(inputs.doc_lens)} packed documents {inputs.doc_lens} vs each alone [{label}]",
            got.packed_logits,
            ref.packed_logits,
        )
    )
    rec.add(compare_tensors(f"loss [{label}]", got.loss, ref.loss))
    grads = compare_tensor_dicts(f"gradients of every parameter [{label}]", got.grads, ref.grads)
    rec.add(grads)
    nonzero = sum(bool(g.abs().max() > 0) for g in ref.grads.values() if g.numel())
    rec.check(
        f"gradients are not vacuous [{label}]",
        nonzero > 0 and len(got.grads) > 0,
        f"{nonzero} of {len(ref.grads)} reference gradients are non-zero",
    )


def parity_inputs(case: ModelCase, hf_config: PretrainedConfig) -> PackedInputs:
    """The packed documents HF and Archon are compared on: the case's seeded tokens, with
    the config's pad, bos and eos ids in every document (see ``special_token_ids``)."""
    return make_packed_inputs(case.doc_lens, hf_config.vocab_size, seed=case.seed, special=special_token_ids(hf_config))


def _parity_fp32(rec: StageRecorder, case: ModelCase, tmp: Path) -> None:
    hf_config = build_hf_config(case)
    hf_model = build_hf_model(case, hf_config)
    checkpoint = save_hf_checkpoint(hf_model, tmp / "hf")
    inputs = parity_inputs(case, hf_config)
    ref = hf_reference(hf_model, inputs, tmp / "hf_grads")
    for attn_type in ATTN_TYPES:
        archon = load_archon_model(hf_config, checkpoint, attn_type=attn_type)
        check_fp32(rec, ref, archon_outputs(archon, inputs), inputs, attn_type)


def _logits(model: PreTrainedModel, archon: ArchonModel, inputs: PackedInputs) -> tuple[Reference, Reference]:
    """HF (one sequence; each document alone) and Archon (the same, packed) logits, no gradients."""
    whole = single_sequence(inputs)
    with torch.no_grad():
        hf_single = model(input_ids=inputs.tokens).logits
        hf_packed = torch.cat([model(input_ids=doc).logits for doc in inputs.documents()], dim=1)
        got_single = archon.model(whole.tokens, whole.positions, whole.cu_seqlens, whole.max_seqlen)
        got_packed = archon.model(inputs.tokens, inputs.positions, inputs.cu_seqlens, inputs.max_seqlen)
    empty: dict[str, torch.Tensor] = {}
    nothing = torch.zeros(())
    return (
        Reference(single_logits=hf_single, packed_logits=hf_packed, loss=nothing, grads=empty),
        Reference(single_logits=got_single, packed_logits=got_packed, loss=nothing, grads=empty),
    )


def source_weight_files(case: ModelCase) -> list[Path]:
    """The safetensors files of the case's source folder (none without a folder source)."""
    if case.source is None:
        return []
    folder = Path(case.source).expanduser()
    if folder.is_file():
        folder = folder.parent
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _parity_source_weights(rec: StageRecorder, case: ModelCase) -> None:
    """The folder's own checkpoint: HF ``from_pretrained`` (its own code with
    ``trust_remote_code``) against Archon loaded from the same files through the adapter.
    The folder's config is used as it is (the case's overrides would not fit its weights)."""
    files = source_weight_files(case)
    if not files:
        return
    folder = files[0].parent
    hf_model = _load_hf(folder, torch.float32, "cpu", case.trust_remote_code)
    hf_config = hf_model.config
    inputs = parity_inputs(case, hf_config)
    for attn_type in ATTN_TYPES:
        archon = load_archon_model(hf_config, folder, attn_type=attn_type)
        ref, got = _logits(hf_model, archon, inputs)
        rec.add(
            compare_tensors(
                f"logits, one sequence, the source folder's own weights [{attn_type}]",
                got.single_logits,
                ref.single_logits,
            )
        )
        rec.add(
            compare_tensors(
                f"logits, {len(inputs.doc_lens)} packed documents, the source folder's own weights [{attn_type}]",
                got.packed_logits,
                ref.packed_logits,
            )
        )


def _within_bf16_error(name: str, archon: torch.Tensor, hf: torch.Tensor, truth: torch.Tensor) -> CheckResult:
    archon_err = max_abs_diff(archon, truth)
    hf_err = max_abs_diff(hf, truth)
    scale = float(truth.detach().float().abs().max()) if truth.numel() else 0.0
    bound = BF16_ERROR_RATIO * hf_err + BF16_ERROR_FLOOR * scale
    return CheckResult(
        name=name,
        passed=archon_err <= bound,
        detail=f"Archon bf16 error {archon_err:.3e}, HF bf16 error {hf_err:.3e}, bound {bound:.3e}",
        max_abs_diff=max_abs_diff(archon, hf),
    )


def _load_hf(checkpoint: Path, dtype: torch.dtype, device: str, trust_remote_code: bool = False) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=dtype, attn_implementation="eager", trust_remote_code=trust_remote_code
    )
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper around to() drops the bound self from its type
    return model.eval()


def _archon_in(hf_config: PretrainedConfig, checkpoint: Path, dtype: torch.dtype, device: str) -> ArchonModel:
    archon = load_archon_model(hf_config, checkpoint, attn_type="varlen")
    # Loaded buffers (a router's expert_bias) keep their checkpoint values and dtype; the
    # computed ones are recomputed below.
    persistent = {
        k: v.clone() for k, v in archon.model.state_dict().items() if k not in dict(archon.model.named_parameters())
    }
    archon.model.to(device=device, dtype=dtype)
    # The RoPE cache is computed in fp32 (as HF computes cos/sin), not cast to bf16.
    archon.model.init_buffers(buffer_device=device)
    if persistent:
        archon.model.load_state_dict({k: v.to(device) for k, v in persistent.items()}, strict=False)
    return archon


def _parity_bf16(rec: StageRecorder, case: ModelCase, tmp: Path, device: str) -> None:
    hf_config = build_hf_config(case)
    checkpoint = save_hf_checkpoint(build_hf_model(case, hf_config), tmp / "hf")
    inputs = parity_inputs(case, hf_config).to(device)
    trust = case.trust_remote_code
    truth = hf_reference(_load_hf(checkpoint, torch.float32, device, trust), inputs, tmp / "g32")
    hf = hf_reference(_load_hf(checkpoint, torch.bfloat16, device, trust), inputs, tmp / "g16")
    got = archon_outputs(_archon_in(hf_config, checkpoint, torch.bfloat16, device), inputs)
    rec.add(_within_bf16_error("bf16 logits, one sequence", got.single_logits, hf.single_logits, truth.single_logits))
    rec.add(
        _within_bf16_error("bf16 logits, packed documents", got.packed_logits, hf.packed_logits, truth.packed_logits)
    )
    missing = sorted(set(truth.grads) - set(got.grads))
    rec.check("bf16 gradients for every checkpoint key", not missing, f"missing {missing[:5]}" if missing else "")
    common = sorted(set(truth.grads) & set(got.grads))
    outside = [
        check
        for key in common
        if not (check := _within_bf16_error(key, got.grads[key], hf.grads[key], truth.grads[key])).passed
    ]
    worst = max((max_abs_diff(got.grads[k], hf.grads[k]) for k in common), default=None)
    rec.check(
        "bf16 gradients within HF's own bf16 error",
        bool(common) and not outside,
        "; ".join(f"{c.name}: {c.detail}" for c in outside[:3]) if outside else f"{len(common)} gradients",
        max_abs_diff=worst,
    )


def run_parity_stage(
    case: ModelCase,
    workdir: str | Path | None = None,
    raise_on_failure: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StageResult:
    """Stage 4. ``dtype=torch.bfloat16`` needs ``device="cuda"`` (bf16 on CPU proves nothing useful)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={dtype}: stage 4 runs in torch.float32, or torch.bfloat16 on CUDA")
    if dtype == torch.bfloat16 and not device.startswith("cuda"):
        raise ValueError("the bf16 parity variant runs on CUDA only; pass device='cuda' on a GPU machine")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch.cuda.is_available() is False; skip this variant without a GPU")

    def body(rec: StageRecorder) -> None:
        with tempfile.TemporaryDirectory(prefix="archon-stage4-", dir=workdir) as tmp:
            if dtype == torch.float32:
                if device != "cpu":
                    raise ValueError("the fp32 parity stage runs on CPU")
                _parity_fp32(rec, case, Path(tmp))
                _parity_source_weights(rec, case)
            else:
                _parity_bf16(rec, case, Path(tmp), device)

    return run_stage(case, 4, body, raise_on_failure)
