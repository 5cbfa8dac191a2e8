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

In fp32 there is no fixed tolerance: HF's model is also run in float64 on the same weights
and inputs (the truth), and each Archon result must be within a small multiple of HF's own
fp32 error against it (``skill.harness.truth``): fp32 rounding grows with the logits, so
``assert_close``'s defaults fail correct ports of real checkpoints and a looser fixed bound
would hide real errors on small ones. The Archon package is also run in float64 and held to
a tighter bound; a model or package that cannot run in float64 says so in a ``not run``
check (HF's: the fp32 results are then judged by ``assert_close``'s defaults). The bf16 variant
(CUDA only) cannot use a fixed tolerance: the Archon kernels (flash varlen) and HF's
eager attention round differently, and how much depends on the tensor. It compares
both bf16 models with an fp32 HF run of the same weights and requires the Archon error
to stay within a small multiple of HF's own bf16 error.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import PretrainedConfig, PreTrainedModel

from skill.harness.case import ModelCase
from skill.harness.compare import max_abs_diff
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
    load_archon_model_on,
    load_hf_model,
    save_hf_checkpoint,
)
from skill.harness.results import CheckResult, StageRecorder, StageResult, run_stage
from skill.harness.truth import TRUTH_DTYPE, float64_default, judge, judge_dicts

logger = logging.getLogger(__name__)

ATTN_TYPES = ("varlen", "sdpa")

T = TypeVar("T")

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

    def outputs(self) -> dict[str, torch.Tensor]:
        """Everything but the gradients, by field name."""
        return {"single_logits": self.single_logits, "packed_logits": self.packed_logits, "loss": self.loss}


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


def float64_copy(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` in float64, the same weights (fp32 -> float64 is exact); ``model`` is left as it is.

    transformers' default kernel for MoE experts (``grouped_mm``) takes fp32 and bf16 only, so
    the copy computes its experts with HF's own ``eager`` implementation, the same maths.
    """
    truth = copy.deepcopy(model)
    truth.to(TRUTH_DTYPE)  # type: ignore[arg-type]  # transformers' wrapper around to() drops the bound self from its type
    if getattr(truth.config, "_experts_implementation", None) not in (None, "eager"):
        truth.set_experts_implementation("eager")
    return truth


def truth_reference(model: PreTrainedModel, inputs: PackedInputs, grads_dir: Path) -> Reference:
    """:func:`hf_reference` of :func:`float64_copy` of ``model``: the truth fp32 runs are measured against."""
    return hf_reference(float64_copy(model), inputs, grads_dir)


def load_archon_float64(hf_config: PretrainedConfig, checkpoint: Path, attn_type: str = "varlen") -> ArchonModel:
    """The Archon model loaded from ``checkpoint`` as stage 4 loads it, then cast to float64
    whole, as HF's model is for the truth: buffers computed in fp32 (the RoPE cache) keep
    their fp32 values, as HF's do."""
    archon = load_archon_model(hf_config, checkpoint, attn_type=attn_type)
    archon.model.to(TRUTH_DTYPE)
    return archon


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


def check_against_hf(
    rec: StageRecorder,
    ref: Reference,
    got: Reference,
    inputs: PackedInputs,
    label: str,
    truth: Reference | None = None,
    float64_run: bool = False,
) -> None:
    """Logits, loss and gradients of ``got`` against HF's fp32 ``ref``, judged by the float64
    ``truth`` (:mod:`skill.harness.truth`); without a truth, with ``assert_close``'s fp32
    defaults. ``float64_run``: ``got`` is the package run in float64, held to the tighter bound."""
    names = {
        "single_logits": f"logits, one sequence of {inputs.num_tokens} [{label}]",
        "packed_logits": f"logits, {len(inputs.doc_lens)} packed documents {inputs.doc_lens} vs each alone [{label}]",
        "loss": f"loss [{label}]",
    }
    expected, outputs = ref.outputs(), got.outputs()
    true = truth.outputs() if truth is not None else {}
    for part, name in names.items():
        rec.add(judge(name, outputs[part], expected[part], true.get(part), float64_run))
    rec.add(
        judge_dicts(
            f"gradients of every parameter [{label}]",
            got.grads,
            ref.grads,
            truth.grads if truth is not None else None,
            float64_run,
        )
    )
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


def float64_truth(rec: StageRecorder, compute: Callable[[], T], what: str) -> T | None:
    """``compute()``, HF's float64 run; when HF's model cannot run in float64, ``None`` and a
    passing check that says so: the fp32 results are then judged by ``assert_close``'s defaults."""
    try:
        with float64_default():
            return compute()
    except Exception as exc:  # whatever HF's own model raises in float64
        reason = f"HF's model raised in float64: {type(exc).__name__}: {exc}"
        logger.warning("%s: %s", what, reason)
        rec.check(f"not run (float64 truth, {what})", True, f"{reason}; fp32 judged by assert_close's defaults")
        return None


def float64_run(rec: StageRecorder, compute: Callable[[], T], what: str) -> T | None:
    """``compute()``, the Archon package run in float64; when it cannot run so (a kernel that
    takes fp32 or bf16 only), ``None`` and a passing check that says so."""
    try:
        with float64_default():
            return compute()
    except Exception as exc:  # whatever the package's kernels raise in float64
        reason = f"the package raised in float64: {type(exc).__name__}: {exc}"
        logger.warning("%s: %s", what, reason)
        rec.check(f"not run (float64 run of the package, {what})", True, f"{reason}; its fp32 runs are judged")
        return None


def _parity_fp32(rec: StageRecorder, case: ModelCase, tmp: Path) -> None:
    hf_config = build_hf_config(case)
    hf_model = build_hf_model(case, hf_config)
    checkpoint = save_hf_checkpoint(hf_model, tmp / "hf")
    inputs = parity_inputs(case, hf_config)
    ref = hf_reference(hf_model, inputs, tmp / "hf_grads")
    truth = float64_truth(rec, lambda: truth_reference(hf_model, inputs, tmp / "truth_grads"), "tiny model")
    for attn_type in ATTN_TYPES:
        archon = load_archon_model(hf_config, checkpoint, attn_type=attn_type)
        check_against_hf(rec, ref, archon_outputs(archon, inputs), inputs, attn_type, truth)
    if truth is None:
        return
    got = float64_run(rec, lambda: archon_outputs(load_archon_float64(hf_config, checkpoint), inputs), "tiny model")
    if got is not None:
        check_against_hf(rec, ref, got, inputs, "float64", truth, float64_run=True)


def hf_logits(model: PreTrainedModel, inputs: PackedInputs) -> Reference:
    """HF's logits (one sequence; each document alone), no loss or gradients."""
    with torch.no_grad():
        single = model(input_ids=inputs.tokens).logits
        packed = torch.cat([model(input_ids=doc).logits for doc in inputs.documents()], dim=1)
    return Reference(single_logits=single, packed_logits=packed, loss=torch.zeros(()), grads={})


def archon_logits(archon: ArchonModel, inputs: PackedInputs) -> Reference:
    """Archon's logits (one sequence; the documents packed), no loss or gradients."""
    whole = single_sequence(inputs)
    with torch.no_grad():
        single = archon.model(whole.tokens, whole.positions, whole.cu_seqlens, whole.max_seqlen)
        packed = archon.model(inputs.tokens, inputs.positions, inputs.cu_seqlens, inputs.max_seqlen)
    return Reference(single_logits=single, packed_logits=packed, loss=torch.zeros(()), grads={})


def source_weight_files(case: ModelCase) -> list[Path]:
    """The safetensors files of the case's source folder (none without a folder source)."""
    if case.source is None:
        return []
    folder = Path(case.source).expanduser()
    if folder.is_file():
        folder = folder.parent
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _check_source_logits(
    rec: StageRecorder, ref: Reference, got: Reference, truth: Reference | None, label: str, n_docs: int
) -> None:
    float64 = label == "float64"
    rec.add(
        judge(
            f"logits, one sequence, the source folder's own weights [{label}]",
            got.single_logits,
            ref.single_logits,
            truth.single_logits if truth is not None else None,
            float64,
        )
    )
    rec.add(
        judge(
            f"logits, {n_docs} packed documents, the source folder's own weights [{label}]",
            got.packed_logits,
            ref.packed_logits,
            truth.packed_logits if truth is not None else None,
            float64,
        )
    )


def _parity_source_weights(rec: StageRecorder, case: ModelCase) -> None:
    """The folder's own checkpoint: HF ``from_pretrained`` (its own code with
    ``trust_remote_code``) against Archon loaded from the same files through the adapter,
    judged by HF's float64 run of the same weights (real checkpoints have logits of +-30).
    The folder's config is used as it is (the case's overrides would not fit its weights)."""
    files = source_weight_files(case)
    if not files:
        return
    folder = files[0].parent
    hf_model = load_hf_model(folder, torch.float32, "cpu", case.trust_remote_code)
    hf_config = hf_model.config
    inputs = parity_inputs(case, hf_config)
    n_docs = len(inputs.doc_lens)
    ref = hf_logits(hf_model, inputs)
    what = "the source folder's own weights"
    truth = float64_truth(rec, lambda: hf_logits(float64_copy(hf_model), inputs), what)
    for attn_type in ATTN_TYPES:
        archon = load_archon_model(hf_config, folder, attn_type=attn_type)
        _check_source_logits(rec, ref, archon_logits(archon, inputs), truth, attn_type, n_docs)
    if truth is None:
        return
    got = float64_run(rec, lambda: archon_logits(load_archon_float64(hf_config, folder), inputs), what)
    if got is not None:
        _check_source_logits(rec, ref, got, truth, "float64", n_docs)


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


def _parity_bf16(rec: StageRecorder, case: ModelCase, tmp: Path, device: str) -> None:
    hf_config = build_hf_config(case)
    checkpoint = save_hf_checkpoint(build_hf_model(case, hf_config), tmp / "hf")
    inputs = parity_inputs(case, hf_config).to(device)
    trust = case.trust_remote_code
    truth = hf_reference(load_hf_model(checkpoint, torch.float32, device, trust), inputs, tmp / "g32")
    hf = hf_reference(load_hf_model(checkpoint, torch.bfloat16, device, trust), inputs, tmp / "g16")
    got = archon_outputs(load_archon_model_on(hf_config, checkpoint, device, torch.bfloat16), inputs)
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
