"""The GPU check: one command that proves and measures the representative families on one CUDA GPU.

Prints two tables, and writes both (and the environment) as JSON with ``--json``:

1. **Correctness** (``skill.harness.device_checks``), per representative family, on tiny
   seeded models over packed documents: Archon-bf16's mean error over HF-bf16's own error
   against HF fp32 of the same weights, for the logits and the worst of a few named
   gradients (pass: <= 2); and the same package in fp32 on CUDA against CPU (pass: within
   1e-4 of the largest value, or, where the package computes its grouped expert GEMMs in
   bf16 on CUDA as AReaL's do, within 2x HF's own bf16 error).
2. **Training step** at real shapes (a TinyLlama-shaped 1.1B llama, a Qwen3-0.6B-shaped
   qwen3, a 12-layer Gemma-2-2B-shaped gemma2, 0.3-0.5B mixtral / gpt_oss / deepseek_v3 and
   ~0.5B bloom / gptj / phi3): 16 documents of 128-2048 tokens, bf16, forward + next-token
   loss + backward. HF on a padded batch (its SDPA, or eager where the family refuses SDPA)
   and Archon packed with ``cu_seqlens``, same weights (HF's checkpoint loaded through the
   adapter), then Archon compiled as AReaL's ``parallelize`` compiles it (the package's own
   ``parallelize_fn`` with ``enable_compile=True`` on one rank: per-block ``torch.compile``).
   Per row: real tokens/s (median step), its ratio to HF, peak memory
   (``torch.cuda.max_memory_allocated`` over the timed steps, reset before them), MFU
   (model FLOPs per real token x tokens/s / ``--peak-tflops``), the loss, and for Archon the
   attention kernels its layers ran (module classes and the attention ops the profiler saw).

Rows run in a spawned worker process in this order: the correctness rows, the first family's
three training rows (llama's compiled row is the MFU headline), the other families' HF and
Archon rows, then their compiled rows. A hard wall-time budget (``--budget-s``, counted from
the start of the process) stops the worker where it is: every row not measured by then is
printed as not run, so the command always prints what it has in time. A failure is one row,
never the end of the run.

    python bench/gpu_check.py --json $OUT/gpu_check.json                 # the whole check, <= 8 min on one H200
    python bench/gpu_check.py --families gemma2,gpt_oss --parts train,compiled --budget-s 240
    python bench/gpu_check.py --device cpu --quick --families llama      # the path the suite's smoke test runs

Needs only torch, transformers, safetensors and pydantic (no libcst, no mcp): it imports
``archon_models``, the harness and ``bench/train_step.py``, nothing of the engine's faces.
"""

# ruff: noqa: E402 - the clock starts before the imports, which take seconds of the budget.
from __future__ import annotations

import time

PROCESS_START = time.monotonic()

import argparse
import gc
import json
import logging
import platform
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_step import Documents, _hf_model, bench_config, dropout_off, make_documents
from bench.train_step_all import Worker, attention_path

logger = logging.getLogger("bench.gpu_check")

# Measured dense bf16 matmul rate of one H200 (TFLOP/s), the default MFU denominator.
H200_PEAK_TFLOPS = 790.0
FAMILIES = ("llama", "qwen3", "gemma2", "mixtral", "deepseek_v3", "gpt_oss", "bloom", "gptj", "phi3")
PARTS = ("correctness", "train", "compiled")
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Real shapes, as fields of each family's config class on top of its defaults (its published
# model). The HF eager families (gemma2, gpt_oss, bloom, gptj) keep few enough layers and heads
# that HF's materialised [16, heads, 2048, 2048] scores fit on one 141 GB GPU.
REAL_SHAPES: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B
    "llama": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    ),
    # Qwen3-0.6B
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Gemma-2-2B (the class defaults: 2304 wide, 8 heads of 256, soft-caps 50/30, window 4096), 12 of
    # its 26 layers and a 32k vocabulary (1.0B): HF's padded, soft-capped 256k-wide logits would
    # hold several 17 GB copies at once, on top of its eager scores.
    "gemma2": dict(num_hidden_layers=12, vocab_size=32000),
    # ~0.4B, 8 experts, top-2
    "mixtral": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    ),
    # ~0.5B, 16 experts, top-4, sinks, 128-token window on every other layer (the class defaults)
    "gpt_oss": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=16,
        num_experts_per_tok=4,
    ),
    # ~0.3B MLA, one dense layer then 16 routed experts (top-4 of 4 groups, 2 chosen) and a shared one
    "deepseek_v3": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=4096,
    ),
    # ~0.47B: 8 layers of 2048, 16 heads of 128, ALiBi
    "bloom": dict(vocab_size=32000, hidden_size=2048, n_layer=8, n_head=16),
    # ~0.47B: 8 parallel blocks of 2048, 8 heads of 256, rotary on 64 of them
    "gptj": dict(vocab_size=32000, n_embd=2048, n_layer=8, n_head=8, rotary_dim=64, n_positions=2048),
    # ~0.5B: 14 layers of 1536, 16 heads of 96, fused qkv / gate_up; no sliding window (the port has none)
    "phi3": dict(
        vocab_size=32064,
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=14,
        num_attention_heads=16,
        num_key_value_heads=16,
        sliding_window=None,
        max_position_embeddings=4096,
    ),
}

# Workloads: the (16 documents of 128-2048 tokens) and --quick's.
FULL = dict(docs=16, min_len=128, max_len=2048, warmup=2, iters=3)
QUICK = dict(docs=4, min_len=32, max_len=256, warmup=1, iters=2)
# Per-row wall-time caps (seconds), always also cut to what is left of the budget.
ROW_CAP_S = {"correctness": 150.0, "train": 150.0, "compiled": 300.0}
# Kept back from the budget for stopping the worker and printing the tables.
RESERVE_S = 10.0


def real_config(family: str) -> PretrainedConfig:
    """The family's config class at its real shape (``REAL_SHAPES``), dropout off, token ids in range."""
    probe = AutoConfig.for_model(family)
    return AutoConfig.for_model(family, **REAL_SHAPES[family], **TOKEN_IDS, **dropout_off(probe))


def workload_config(family: str, quick: bool) -> PretrainedConfig:
    return bench_config(family, "small") if quick else real_config(family)


# --------------------------------------------------------------------------- the device


class DeviceStats:
    """Synchronisation and peak memory of one device: CUDA's allocator counters, none on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.is_cuda else None

    def release(self) -> None:
        """Free what the last row left (its models are out of scope) before the next one."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": device.type,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(device)
    return env


# --------------------------------------------------------------------------- FLOPs


def attended_keys(length: int, window: int | None) -> int:
    """Keys a causal document of ``length`` tokens attends to, summed over its queries."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def layer_windows(config: PretrainedConfig, n_layers: int) -> list[int | None]:
    """Each layer's sliding window, from ``layer_types``; no window where the config has none."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not layer_types or not isinstance(window, int):
        return [None] * n_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types[:n_layers]]


def matmul_parameters(model: nn.Module) -> float:
    """Weights a token is multiplied by: every ``nn.Linear`` (the output head included, the
    embedding lookup not), and of the 3D expert weights the share a token is routed to
    (``top_k / num_experts`` of each MoE layer)."""
    total = 0.0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()
        top_k, n_experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
        if isinstance(top_k, int) and isinstance(n_experts, int) and n_experts > 0:
            total += sum(p.numel() for p in module.parameters() if p.ndim == 3) * top_k / n_experts
    return total


def train_flops_per_token(model: nn.Module, config: PretrainedConfig, doc_lens: list[int]) -> float:
    """Model FLOPs of one training step per real token: 6 x the matmul weights a token meets,
    plus attention's scores and weighted values (2 x keys x heads x (qk + v head width) forward,
    x3 with backward), over causal documents and each layer's window."""
    heads = int(config.num_attention_heads)
    qk_dim = (getattr(config, "qk_nope_head_dim", None) or 0) + (getattr(config, "qk_rope_head_dim", None) or 0)
    v_dim = getattr(config, "v_head_dim", None) or 0
    if not qk_dim:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        qk_dim = v_dim = int(head_dim)
    n_layers = len(model.layers)  # type: ignore[arg-type]
    keys = sum(attended_keys(n, w) for w in layer_windows(config, n_layers) for n in doc_lens)
    attention = 6 * keys * heads * (qk_dim + v_dim)
    return 6 * matmul_parameters(model) + attention / sum(doc_lens)


# --------------------------------------------------------------------------- attention probe

_ATTENTION_OP = re.compile(r"attention|attn|flash|flex|softmax|grouped_mm", re.IGNORECASE)


def is_attention_op(name: str) -> bool:
    """A forward operator (``namespace::op``) of attention or expert GEMMs: not an autograd
    node, not a backward kernel, not the loss's log-softmax."""
    lowered = name.lower()
    return (
        "::" in name
        and not name.startswith("autograd::")
        and "backward" not in lowered
        and "log_softmax" not in lowered
        and bool(_ATTENTION_OP.search(name))
    )


def attention_ops(step: Callable[[], float]) -> tuple[float, str]:
    """Run ``step`` under the profiler; its loss and the attention ops it dispatched."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = step()
    names = sorted({event.key for event in prof.key_averages() if is_attention_op(event.key)})
    return loss, ", ".join(names) or "none seen"


# --------------------------------------------------------------------------- rows


def correctness_row(family: str, opts: dict[str, Any]) -> dict[str, Any]:
    from skill.harness.device_checks import check_on_device, representative

    rep = representative(family)
    start = time.perf_counter()
    report = check_on_device(rep.case(), opts["device"], workdir=opts["scratch"])
    worst_device = max(report.device_diffs, key=lambda d: d.margin)
    return {
        "part": "correctness",
        "family": family,
        "covers": rep.covers,
        "doc_lens": list(report.doc_lens),
        "bf16_logits_ratio": report.bf16_logits.ratio,
        "bf16_grad_ratio": report.worst_grad.ratio,
        "bf16_worst_grad": report.worst_grad.name,
        "bf16_passed": report.bf16_passed,
        "device": report.device,
        "device_judged_by": worst_device.judged_by,
        "device_worst": worst_device.describe(),
        "device_max_rel": max(d.max_abs_diff / d.scale if d.scale else 0.0 for d in report.device_diffs),
        "device_passed": report.devices_passed,
        "computes_bf16": report.computes_bf16,
        "report": report.model_dump(),
        "seconds": time.perf_counter() - start,
    }


def _documents(config: PretrainedConfig, opts: dict[str, Any]) -> Documents:
    return make_documents(opts["docs"], opts["min_len"], opts["max_len"], config.vocab_size, opts["seed"])


def _checkpoint(family: str, opts: dict[str, Any], build: Callable[[], PreTrainedModel]) -> Path:
    """The family's seeded bf16 HF checkpoint in the scratch folder, written from ``build()``
    by the first row that needs it (the HF row; an Archon row run without it builds its own)."""
    from skill.harness.models import save_hf_checkpoint

    directory = Path(opts["scratch"]) / f"{family}-checkpoint"
    if not directory.exists():
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # a row stopped while writing it
        save_hf_checkpoint(build(), partial)
        partial.rename(directory)
    return directory


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def _time_steps(step: Callable[[], float], stats: DeviceStats, opts: dict[str, Any]) -> dict[str, Any]:
    """First step (compiles where compiled), the other warm-up steps, then the timed steps with
    the peak memory counter reset before them."""
    stats.synchronize()
    start = time.perf_counter()
    loss = step()
    first = time.perf_counter() - start
    for _ in range(opts["warmup"] - 1):
        loss = step()
    stats.synchronize()
    stats.reset_peak()
    times = []
    for _ in range(opts["iters"]):
        start = time.perf_counter()
        loss = step()  # .item() waits for the device
        times.append(time.perf_counter() - start)
    return {"first_step_s": first, "step_s": times, "loss": loss, "peak_bytes": stats.peak_bytes()}


def train_row(family: str, side: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One training-step row: ``side`` is ``hf`` (padded), ``archon`` (packed, eager) or
    ``compiled`` (packed, compiled as the package's ``parallelize_fn`` compiles it)."""
    from archon_models.parallel_dims import ArchonParallelDims
    from skill.harness.models import build_archon_model, load_archon_model_on

    device = torch.device(opts["device"])
    stats = DeviceStats(device)
    stats.release()
    config = workload_config(family, opts["quick"])
    docs = _documents(config, opts)
    doc_lens = [len(d) for d in docs.docs]
    start = time.perf_counter()
    row: dict[str, Any] = {"part": "train", "family": family, "side": side}

    def build_hf() -> PreTrainedModel:
        return _hf_model(config, opts["seed"], device=device, dtype=torch.bfloat16)

    if side == "hf":
        hf = build_hf()
        _checkpoint(family, opts, lambda: hf)
        input_ids, mask, labels = (t.to(device) for t in docs.padded(config.pad_token_id))
        # The FLOPs of the model HF runs, counted on Archon's structure (meta device: no memory).
        meta = build_archon_model(config, device="meta").model

        def hf_step() -> float:
            loss = _loss(hf(input_ids=input_ids, attention_mask=mask).logits, labels)
            loss.backward()
            hf.zero_grad(set_to_none=True)
            return float(loss.item())

        step, model = hf_step, meta
        row["attention"] = f"HF {hf.config._attn_implementation}"
        row["padded_tokens"] = int(input_ids.numel())
        row["params"] = sum(p.numel() for p in hf.parameters())
    else:
        checkpoint = _checkpoint(family, opts, build_hf)
        archon = load_archon_model_on(config, checkpoint, device, torch.bfloat16, attn_type="varlen")
        archon.model.train()
        tokens, positions, cu_seqlens, max_seqlen, labels = docs.packed()
        tokens, positions, cu_seqlens, labels = (t.to(device) for t in (tokens, positions, cu_seqlens, labels))
        model = archon.model

        def archon_step() -> float:
            loss = _loss(model(tokens, positions, cu_seqlens, max_seqlen), labels)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return float(loss.item())

        step = archon_step
        row["attention"] = attention_path(model)
        row["params"] = sum(p.numel() for p in model.parameters())
        if side == "compiled":
            dims = ArchonParallelDims(world_size=1, device_type=device.type)
            archon.spec.parallelize_fn(model, dims, param_dtype=torch.bfloat16, enable_compile=True)
            row["compiled_modules"] = sum(isinstance(m, OptimizedModule) for m in model.modules())
            row["attention"] += f" [{row['compiled_modules']} compiled modules]"

    row["build_s"] = time.perf_counter() - start
    row |= _time_steps(step, stats, opts)
    if side == "archon":
        # One more step, under the profiler (after the timed ones, which it would slow down).
        row["attention"] += f" [{attention_ops(step)[1]}]"
    median = statistics.median(row["step_s"])
    flops = train_flops_per_token(model, config, doc_lens)
    row |= {
        "real_tokens": sum(doc_lens),
        "tok_s": sum(doc_lens) / median,
        "flops_per_token": flops,
        "mfu": flops * sum(doc_lens) / median / (opts["peak_tflops"] * 1e12),
    }
    return row


def run_task(item: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """One row of the plan, in the worker; an exception is the row's error, not the run's end."""
    family, part = item["family"], item["part"]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if part == "correctness":
            return correctness_row(family, opts)
        return train_row(family, item["side"], opts)
    except Exception as exc:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**item, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}


# --------------------------------------------------------------------------- the plan


def plan(families: list[str], parts: list[str]) -> list[dict[str, Any]]:
    """The rows in running order: correctness, the first family's training rows (compiled too),
    the other families' HF and Archon rows, then their compiled rows."""
    items: list[dict[str, Any]] = []
    if "correctness" in parts:
        items += [{"part": "correctness", "family": f} for f in families]
    sides = [s for s, part in (("hf", "train"), ("archon", "train"), ("compiled", "compiled")) if part in parts]
    for index, family in enumerate(families):
        items += [{"part": "train", "family": family, "side": s} for s in sides if s != "compiled" or index == 0]
    if "compiled" in sides:
        items += [{"part": "train", "family": f, "side": "compiled"} for f in families[1:]]
    return items


def run_plan(
    items: list[dict[str, Any]],
    opts: dict[str, Any],
    budget_s: float,
    on_row: Callable[[dict[str, Any]], None],
    task: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] = run_task,
    started: float | None = None,
) -> list[dict[str, Any]]:
    """Run ``items`` in a worker under the wall-time budget counted from ``started`` (a
    ``time.monotonic()``; now by default); every item gets a row."""
    deadline = (time.monotonic() if started is None else started) + budget_s - RESERVE_S
    worker: Worker | None = None
    rows = []
    try:
        for item in items:
            left = deadline - time.monotonic()
            cap = ROW_CAP_S["compiled" if item.get("side") == "compiled" else item["part"]]
            if left <= 1.0:
                row = {**item, "not_run": f"the {budget_s:.0f} s budget was spent"}
            else:
                worker = worker or Worker(opts, task=task)
                row = worker.run(item, timeout_s=min(cap, left)) or {}
                if not row:
                    alive = worker.is_alive()
                    worker.stop()
                    worker = None
                    if not alive:
                        reason = "the worker process died (a crash in native code, or out of host memory)"
                    elif min(cap, left) < cap:
                        reason = f"stopped at the {budget_s:.0f} s budget"
                    else:
                        reason = f"ran past its {cap:.0f} s cap"
                    row = {**item, "error": reason}
            rows.append(row)
            on_row(row)
    finally:
        if worker is not None:
            worker.close()
    return rows


# --------------------------------------------------------------------------- tables


def _table(header: tuple[str, ...], cells: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(
            f"{v:>{w}}" if i in right else f"{v:<{w}}" for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return [line(header), line(tuple("-" * w for w in widths)), *(line(c) for c in cells)]


def _problem(row: dict[str, Any]) -> str | None:
    if "not_run" in row:
        return f"not run: {row['not_run']}"
    if "error" in row:
        return f"error: {row['error'][:160]}"
    return None


def format_correctness(rows: list[dict[str, Any]]) -> str:
    from skill.harness.device_checks import BF16_RATIO_LIMIT, DEVICE_FP32_RTOL

    header = ("family", "covers", "bf16 logits", "bf16 grads (worst)", "bf16", "fp32 device vs CPU", "device")
    cells = []
    for r in rows:
        if (problem := _problem(r)) is not None:
            cells.append((r["family"], "-", "-", "-", "FAIL", problem, "FAIL"))
            continue
        grad_name = r["bf16_worst_grad"].removeprefix("grad ")
        if r["device_judged_by"] == "ratio":
            device = f"{r['device_worst']} [ratio: {r['computes_bf16']}]"
        else:
            device = f"max rel {r['device_max_rel']:.1e} [tolerance]"
        cells.append(
            (
                r["family"],
                r["covers"],
                f"{r['bf16_logits_ratio']:.2f}x",
                f"{r['bf16_grad_ratio']:.2f}x {grad_name}",
                "pass" if r["bf16_passed"] else "FAIL",
                device,
                "pass" if r["device_passed"] else "FAIL",
            )
        )
    lines = _table(header, cells, right={2})
    lines.append(
        f"bf16: mean |Archon bf16 - HF fp32| / mean |HF bf16 - HF fp32| (pass <= {BF16_RATIO_LIMIT:g}), logits and "
        f"named gradients, packed documents {rows[0].get('doc_lens', '') if rows else ''}; fp32 device: Archon on "
        f"the device vs on CPU, max |diff| within {DEVICE_FP32_RTOL:g} x the largest value, or judged by the ratio "
        "where the CUDA path computes in bf16 on purpose"
    )
    return "\n".join(lines)


def format_train(rows: list[dict[str, Any]]) -> str:
    hf_tok_s = {r["family"]: r["tok_s"] for r in rows if r.get("side") == "hf" and "tok_s" in r}
    labels = {"hf": "HF padded", "archon": "Archon packed", "compiled": "Archon compiled"}
    header = (
        "family",
        "side",
        "params M",
        "tok/s",
        "vs HF",
        "MFU",
        "peak GiB",
        "step s",
        "first s",
        "loss",
        "attention",
    )
    cells = []
    for r in rows:
        side = labels.get(r.get("side", ""), "?")
        if (problem := _problem(r)) is not None:
            cells.append((r["family"], side, "-", "-", "-", "-", "-", "-", "-", "-", problem))
            continue
        base = hf_tok_s.get(r["family"])
        peak = r.get("peak_bytes")
        cells.append(
            (
                r["family"],
                side,
                f"{r['params'] / 1e6:.0f}",
                f"{r['tok_s']:.0f}",
                f"{r['tok_s'] / base:.2f}x" if base and r["side"] != "hf" else "-",
                f"{100 * r['mfu']:.1f}%",
                f"{peak / 2**30:.1f}" if peak is not None else "-",
                f"{statistics.median(r['step_s']):.3f}",
                f"{r['first_step_s']:.1f}",
                f"{r['loss']:.4f}",
                r["attention"],
            )
        )
    return "\n".join(_table(header, cells, right={2, 3, 4, 5, 6, 7, 8, 9}))


def header_lines(env: dict[str, Any], opts: dict[str, Any], doc_lens: list[int]) -> list[str]:
    padded = len(doc_lens) * max(doc_lens)
    versions = (
        f"torch {env['torch']}, transformers {env['transformers']}, CUDA {env['cuda']}, python {env['python']}, "
        f"on {env['device']}"
    )
    workload = (
        f"training step: bf16, {len(doc_lens)} documents of {opts['min_len']}-{opts['max_len']} tokens, "
        f"{sum(doc_lens)} real tokens (HF pads to {padded}); median of {opts['iters']} steps after "
        f"{opts['warmup']} warm-up; MFU against {opts['peak_tflops']:g} TFLOP/s (--peak-tflops; default 790, "
        f"the measured H200 dense bf16 rate); {'quick shapes' if opts['quick'] else 'real shapes'}"
    )
    return [versions, workload]


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, in running order")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="small shapes, 4 short documents, 1+2 steps")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (what the suite's smoke test runs)")
    p.add_argument("--peak-tflops", type=float, default=H200_PEAK_TFLOPS, help="the GPU's dense bf16 peak, TFLOP/s")
    p.add_argument("--budget-s", type=float, default=450.0, help="hard wall-time budget of the whole process, seconds")
    p.add_argument("--warmup", type=int, help="warm-up steps per row (default 2, quick 1)")
    p.add_argument("--iters", type=int, help="timed steps per row (default 3, quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", type=Path, help="also write the environment and both tables here")
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in REAL_SHAPES]
    if unknown:
        p.error(f"no real shape for {', '.join(unknown)}; families: {', '.join(FAMILIES)}")
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if not parts or any(s not in PARTS for s in parts):
        p.error(f"--parts takes a subset of {','.join(PARTS)}")
    if args.device.split(":")[0] == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False; run on a CUDA machine or pass --device cpu")
    args.families, args.parts = families, parts
    return args


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The command; ``started`` is when its budget began (the process start when run as a
    script, so the imports count; this call's start when a caller imports the module)."""
    started = time.monotonic() if started is None else started
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    workload = dict(QUICK if args.quick else FULL)
    workload["warmup"] = max(1, args.warmup if args.warmup is not None else workload["warmup"])
    workload["iters"] = max(1, args.iters if args.iters is not None else workload["iters"])
    device = torch.device(args.device)
    env = environment(device)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    opts = {
        **workload,
        "device": args.device,
        "quick": args.quick,
        "peak_tflops": args.peak_tflops,
        "seed": args.seed,
        "scratch": str(scratch),
    }
    doc_lens = [len(d) for d in make_documents(opts["docs"], opts["min_len"], opts["max_len"], 100, opts["seed"]).docs]
    head = header_lines(env, opts, doc_lens)
    for line in head:
        logger.info(line)
    settings = {k: v for k, v in opts.items() if k != "scratch"} | {
        "families": args.families,
        "parts": args.parts,
        "budget_s": args.budget_s,
        "doc_lens": doc_lens,
    }
    rows: list[dict[str, Any]] = []

    def write_json() -> None:
        if args.json_path:
            payload = {
                "environment": env,
                "settings": settings,
                "correctness": [r for r in rows if r["part"] == "correctness"],
                "train": [r for r in rows if r["part"] == "train"],
            }
            args.json_path.parent.mkdir(parents=True, exist_ok=True)
            args.json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")

    def on_row(row: dict[str, Any]) -> None:
        rows.append(row)
        write_json()
        what = row["family"] + (f" {row['side']}" if "side" in row else "") + f" ({row['part']})"
        if (problem := _problem(row)) is not None:
            logger.info("%-36s %s", what, problem)
        elif row["part"] == "correctness":
            logger.info(
                "%-36s bf16 %.2fx/%.2fx, device %s",
                what,
                row["bf16_logits_ratio"],
                row["bf16_grad_ratio"],
                "pass" if row["device_passed"] else "FAIL",
            )
        else:
            logger.info("%-36s %.0f tok/s, MFU %.1f%%", what, row["tok_s"], 100 * row["mfu"])

    try:
        run_plan(plan(args.families, args.parts), opts, args.budget_s, on_row, started=started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    correctness = [r for r in rows if r["part"] == "correctness"]
    train = [r for r in rows if r["part"] == "train"]
    out = [*head, ""]
    if correctness:
        out += ["Correctness", format_correctness(correctness), ""]
    if train:
        out += ["Training step", format_train(train)]
    sys.stdout.write("\n".join(out) + "\n")
    write_json()
    failed = [r for r in rows if _problem(r) is not None]
    failed += [r for r in correctness if _problem(r) is None and not (r["bf16_passed"] and r["device_passed"])]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(started=PROCESS_START))
