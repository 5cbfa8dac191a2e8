"""The training-step table for every registered family: Archon (packed) vs HF (padded) tokens/s on CPU.

For each model_type ``archon_models`` registers (or ``--families``), one spawned process
builds both sides exactly as ``bench/train_step.py`` does (same weights, same documents,
fp32) and times them **interleaved**: HF step, Archon step, HF step, ... . On a machine
other jobs share, a load spike then hits both sides alike, so the ratio stays fair even
when the absolute numbers move; the table reports the load average it ran under. Each
family's process is its own, so one family that fails (or runs out of time) is one row,
not the end of the table.

    nice -n 10 python bench/train_step_all.py --json bench_train_step.json
    python bench/train_step_all.py --families gemma2,granite_swa --size default --iters 7

Columns: family, Archon tok/s, HF tok/s, ratio (Archon / HF), the ratio by the other clock, the attention path each side
took (Archon: the kernel modules its layers call; HF: its attention implementation), and
whether both computed the same loss. ``--min-ratio`` makes the exit status 1 when a family
is below it (the issue's bar is 1.5x).

Clock: by default tok/s divides by the CPU time the process spent in the step, with one
torch thread per side. On a machine shared with other jobs the wall time of a step counts
the time the scheduler gave to them; CPU time does not, and with one thread it is what the
wall time would be on an idle core. ``--clock wall`` (and ``--threads N``) measures wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue as queue_lib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_step import SIZES, _hf_model, bench_config, build_archon, make_documents

logger = logging.getLogger("bench.train_step_all")


def attention_path(model: torch.nn.Module) -> str:
    """The attention kernels an Archon model's layers call, by class (``EagerAttention``,
    ``VarlenAttentionWrapper``, ...), most frequent first."""
    counts: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name != "Attention" and name.endswith(("Attention", "Wrapper")):
            counts[name] = counts.get(name, 0) + 1
    return "+".join(sorted(counts, key=lambda n: -counts[n])) or "?"


def measure(model_type: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Build HF and Archon for ``model_type``, warm both up, then time them interleaved."""
    from transformers.utils import logging as hf_logging

    import archon_models  # noqa: F401 - registers every family

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(opts["threads"])
    config = bench_config(model_type, opts["size"])
    docs = make_documents(opts["docs"], opts["min_len"], opts["max_len"], config.vocab_size, opts["seed"])
    hf = _hf_model(config, opts["seed"])
    archon = build_archon(config, "varlen", opts["seed"])
    tokens, positions, cu_seqlens, max_seqlen, packed_labels = docs.packed()
    input_ids, mask, padded_labels = docs.padded(config.pad_token_id)

    def archon_step() -> float:
        logits = archon(tokens, positions, cu_seqlens, max_seqlen)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), packed_labels.view(-1), ignore_index=-100)
        loss.backward()
        archon.zero_grad(set_to_none=True)
        return loss.item()

    def hf_step() -> float:
        logits = hf(input_ids=input_ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), padded_labels.view(-1), ignore_index=-100)
        loss.backward()
        hf.zero_grad(set_to_none=True)
        return loss.item()

    losses = {"hf": 0.0, "archon": 0.0}
    for _ in range(opts["warmup"]):
        losses["hf"], losses["archon"] = hf_step(), archon_step()
    wall: dict[str, list[float]] = {"hf": [], "archon": []}
    cpu: dict[str, list[float]] = {"hf": [], "archon": []}
    for _ in range(opts["iters"]):
        for impl, step in (("hf", hf_step), ("archon", archon_step)):
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[impl] = step()
            wall[impl].append(time.perf_counter() - start)
            cpu[impl].append(time.process_time() - start_cpu)
    times = cpu if opts["clock"] == "cpu" else wall
    hf_tps, archon_tps = (docs.n_tokens / statistics.median(times[i]) for i in ("hf", "archon"))
    wall_ratio = statistics.median(wall["hf"]) / statistics.median(wall["archon"])
    cpu_ratio = statistics.median(cpu["hf"]) / statistics.median(cpu["archon"])
    return {
        "family": model_type,
        "archon_tok_s": archon_tps,
        "hf_tok_s": hf_tps,
        "ratio": archon_tps / hf_tps,
        "wall_ratio": wall_ratio,
        "cpu_ratio": cpu_ratio,
        "archon_attention": attention_path(archon),
        "hf_attention": str(getattr(hf.config, "_attn_implementation", "?")),
        "loss_archon": losses["archon"],
        "loss_hf": losses["hf"],
        "same_loss": abs(losses["archon"] - losses["hf"]) <= 1e-3,
        "params_m": sum(p.numel() for p in archon.parameters()) / 1e6,
        "wall_s_archon": wall["archon"],
        "wall_s_hf": wall["hf"],
        "cpu_s_archon": cpu["archon"],
        "cpu_s_hf": cpu["hf"],
        "n_tokens": docs.n_tokens,
    }


def _child(model_type: str, opts: dict[str, Any], out: mp.Queue) -> None:
    try:
        out.put(measure(model_type, opts))
    except Exception as exc:
        out.put({"family": model_type, "error": f"{type(exc).__name__}: {exc}"})


def run_family(model_type: str, opts: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``measure`` in a spawned process (spawned, not forked: OpenMP threads and fork deadlock)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(model_type, opts, out))
    proc.start()
    try:
        row = out.get(timeout=timeout_s)
    except queue_lib.Empty:
        row = {"family": model_type, "error": f"ran past {timeout_s:.0f}s"}
        proc.kill()
    proc.join(timeout=30)
    return row


def format_table(rows: list[dict[str, Any]], min_ratio: float, clock: str) -> str:
    header = ("family", "Archon tok/s", "HF tok/s", "ratio", "other clock", "Archon attention (CPU)", "HF attn", "loss")
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((r["family"], "-", "-", "-", "-", f"error: {r['error'][:100]}", "-", "-"))
            continue
        flag = "" if r["ratio"] >= min_ratio else " <"
        cells.append(
            (
                r["family"],
                f"{r['archon_tok_s']:.0f}",
                f"{r['hf_tok_s']:.0f}",
                f"{r['ratio']:.2f}x{flag}",
                f"{r['wall_ratio'] if clock == 'cpu' else r['cpu_ratio']:.2f}x",
                r["archon_attention"],
                r["hf_attention"],
                "same" if r["same_loss"] else f"DIFFERS {r['loss_archon']:.4f}/{r['loss_hf']:.4f}",
            )
        )
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    right = {1, 2, 3, 4}
    lines = [
        "  ".join(
            f"{h:>{w}}" if i in right else f"{h:<{w}}" for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for cell in cells:
        lines.append(
            "  ".join(
                f"{c:>{w}}" if i in right else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cell, widths, strict=True))
            )
        )
    ratios = [r["ratio"] for r in rows if "error" not in r]
    if ratios:
        below = [r["family"] for r in rows if "error" not in r and r["ratio"] < min_ratio]
        lines.append("")
        lines.append(
            f"{len(ratios)} families measured, {len(rows) - len(ratios)} failed; ratio min {min(ratios):.2f}x, "
            f"median {statistics.median(ratios):.2f}x; below {min_ratio}x: {', '.join(below) or 'none'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--families", help="comma-separated model_types (default: every registered one)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model widths (bench/train_step.py SIZES)")
    p.add_argument("--docs", type=int, default=8, help="documents per step")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=5, help="timed steps per side, interleaved")
    p.add_argument("--threads", type=int, default=1, help="torch threads per side (1: CPU time is then comparable)")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="what tok/s divides by: the step's process CPU time (default; robust on a shared machine) or wall time",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one family may take")
    p.add_argument("--min-ratio", type=float, default=1.5, help="exit 1 when a family's ratio is below it")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the rows (step times included) as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import archon_models

    known = sorted(archon_models.get_supported_model_types())
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else known
    unknown = [f for f in families if f not in known]
    if unknown:
        p.error(f"not registered in archon_models: {', '.join(unknown)}")
    keys = ("size", "docs", "min_len", "max_len", "warmup", "iters", "threads", "seed", "clock")
    opts = {k: getattr(args, k) for k in keys}
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []

    def write_json() -> None:
        if args.json_path:
            payload = {"settings": opts, "load_average": [load_start, os.getloadavg()], "cpus": os.cpu_count()}
            args.json_path.write_text(json.dumps(payload | {"rows": rows}, indent=1) + "\n", encoding="utf-8")

    for family in families:
        row = run_family(family, opts, args.timeout)
        rows.append(row)
        write_json()  # after every family: a long table run that is stopped keeps what it measured
        if "error" in row:
            logger.info("%-20s error: %s", family, row["error"])
        else:
            logger.info(
                "%-20s %.2fx (Archon %.0f, HF %.0f tok/s)", family, row["ratio"], row["archon_tok_s"], row["hf_tok_s"]
            )
    load_end = os.getloadavg()
    table = format_table(rows, args.min_ratio, args.clock)
    footer = (
        f"tok/s per {args.clock} second (other clock: the ratio by the other one); "
        f"fp32 CPU, {args.threads} threads, {args.size} size, {args.docs} documents of {args.min_len}-{args.max_len} "
        f"tokens; Archon packed (varlen) vs HF padded, interleaved, median of {args.iters} steps after "
        f"{args.warmup} warm-up; load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end "
        f"on {os.cpu_count()} CPUs"
    )
    sys.stdout.write(table + "\n" + footer + "\n")
    write_json()
    return 1 if any("error" in r or r["ratio"] < args.min_ratio for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
