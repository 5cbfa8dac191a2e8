"""The training-step table for every registered family: Archon (packed) vs HF (padded) tokens/s on CPU.

For each model_type ``archon_models`` registers (or ``--families``), a spawned process
builds both sides exactly as ``bench/train_step.py`` does (same weights, same documents,
fp32) and times them in **pairs**: an HF step and an Archon step back to back, the order
alternating from pair to pair. Whatever the machine does to one step of a pair (a load
spike, a cold cache) it does to the other alike, so each pair gives one ratio and the
table reports the median of those ratios and their spread (quartiles, extremes): a family
at 1.45x whose pairs run 1.40-1.50 is below the bar, one whose pairs run 1.2-1.9 is noise.
One worker process measures the families in turn (``--isolate``: a fresh one each); a
family that fails is one row, one that crashes the process or runs out of time costs the
process, not the table.

    nice -n 10 python bench/train_step_all.py --json bench/results/train_step_all.json
    python bench/train_step_all.py --families gemma2,granite_swa --iters 12
    # in chunks (background), then one table of them all:
    python bench/train_step_all.py --families a,b,c --json /tmp/part1.json   # ... part2, part3
    python bench/train_step_all.py --merge /tmp/part*.json --json bench/results/train_step_all.json

Columns: family, HF tok/s, Archon tok/s (each by the median step), ratio (median over the
pairs of HF step time / Archon step time), its spread over the pairs (q1-q3, min-max), the
ratio by the other clock, the attention path each side took (Archon: the kernel modules its
layers call; HF: its attention implementation), and whether both computed the same loss.
A ratio below ``--min-ratio`` (the issue's bar, 1.5x) is flagged ``<`` and makes the exit
status 1; a ratio above it whose lower quartile is below it is flagged ``?``.

Clock: by default a step's time is the CPU time the process spent in it, with one torch
thread per side. On a machine shared with other jobs the wall time of a step counts the
time the scheduler gave to them; CPU time does not, and with one thread it is what the
wall time would be on an idle core. ``--clock wall`` (and ``--threads N``) measures wall time.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing as mp
import os
import queue as queue_lib
import statistics
import sys
import time
from collections.abc import Callable
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


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


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
    archon = build_archon(config, "varlen", opts["seed"], hf=hf)
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
    sides = [("hf", hf_step), ("archon", archon_step)]
    for i in range(opts["iters"]):
        # A pair of steps back to back, in alternating order: whatever the machine does to
        # one step (a load spike, a warm cache, a collector run) it does to its pair alike.
        for impl, step in sides if i % 2 == 0 else sides[::-1]:
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[impl] = step()
            wall[impl].append(time.perf_counter() - start)
            cpu[impl].append(time.process_time() - start_cpu)
    times = cpu if opts["clock"] == "cpu" else wall
    hf_tps, archon_tps = (docs.n_tokens / statistics.median(times[i]) for i in ("hf", "archon"))
    pair_ratios = sorted(h / a for h, a in zip(times["hf"], times["archon"], strict=True))
    other = wall if opts["clock"] == "cpu" else cpu
    return {
        "family": model_type,
        "pairs": opts["iters"],
        "archon_tok_s": archon_tps,
        "hf_tok_s": hf_tps,
        # The headline: the median over the pairs of HF step time / Archon step time.
        "ratio": statistics.median(pair_ratios),
        "ratio_min": pair_ratios[0],
        "ratio_q1": _quantile(pair_ratios, 0.25),
        "ratio_q3": _quantile(pair_ratios, 0.75),
        "ratio_max": pair_ratios[-1],
        "ratio_of_medians": statistics.median(times["hf"]) / statistics.median(times["archon"]),
        "other_clock_ratio": statistics.median(h / a for h, a in zip(other["hf"], other["archon"], strict=True)),
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


Task = Callable[[Any, dict[str, Any]], dict[str, Any]]


def _worker(task: Task, opts: dict[str, Any], todo: mp.Queue, out: mp.Queue) -> None:
    """Run ``task`` on each item ``todo`` sends (a family by default), one at a time, until it sends ``None``."""
    while (item := todo.get()) is not None:
        try:
            row = task(item, opts)
        except Exception as exc:
            row = {"family": item, "error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
        out.put(row)


class Worker:
    """A spawned process (spawned, not forked: OpenMP threads and fork deadlock) that measures
    families in turn, so torch, transformers and ``archon_models`` are imported once, not once
    per family (on a loaded machine that import takes a minute). Each family builds its own
    models in a function scope; a family that crashes the process or runs out of time costs
    the process, and the next family gets a fresh one.

    ``task`` (a module-level function, so the spawned process can import it) turns one item
    into one row; by default it is :func:`measure` and the items are families."""

    def __init__(self, opts: dict[str, Any], task: Task = measure):
        ctx = mp.get_context("spawn")
        self.todo, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_worker, args=(task, opts, self.todo, self.out), daemon=True)
        self.proc.start()

    def run(self, item: Any, timeout_s: float) -> dict[str, Any] | None:
        """The item's row; ``None`` when the process died or ran past ``timeout_s`` (then it is
        still running: ``is_alive`` tells the two apart, and ``stop`` ends it)."""
        self.todo.put(item)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                return self.out.get(timeout=min(5.0, left))
            except queue_lib.Empty:
                if not self.proc.is_alive():
                    return None
        return None

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self) -> None:
        """Kill the process (it is stuck or lost) and reap it."""
        self.proc.kill()
        self.proc.join(timeout=30)

    def close(self) -> None:
        if self.proc.is_alive():
            self.todo.put(None)
            self.proc.join(timeout=30)


def run_families(families: list[str], opts: dict[str, Any], timeout_s: float, isolate: bool):
    """Yield each family's row, measured in a worker process (a fresh one per family with ``isolate``)."""
    worker: Worker | None = None
    for family in families:
        if worker is None:
            worker = Worker(opts)
        row = worker.run(family, timeout_s)
        if row is None:
            alive = worker.is_alive()
            row = {"family": family, "error": f"ran past {timeout_s:.0f}s" if alive else "the process died"}
            worker.stop()
            worker = None
        elif isolate:
            worker.close()
            worker = None
        yield row
    if worker is not None:
        worker.close()


def format_table(rows: list[dict[str, Any]], min_ratio: float) -> str:
    """The table: one row per family (an error is a row too), then a summary line."""
    header = (
        "family",
        "HF tok/s",
        "Archon tok/s",
        "ratio",
        "pairs",
        "spread q1-q3",
        "min-max",
        "other clock",
        "Archon attention (CPU)",
        "HF attn",
        "loss",
    )
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((r["family"], "-", "-", "-", "-", "-", "-", "-", f"error: {r['error'][:100]}", "-", "-"))
            continue
        # "<": the median pair is below the bar; "?": the median clears it but a quarter of the pairs do not.
        flag = " <" if r["ratio"] < min_ratio else (" ?" if r["ratio_q1"] < min_ratio else "")
        cells.append(
            (
                r["family"],
                f"{r['hf_tok_s']:.0f}",
                f"{r['archon_tok_s']:.0f}",
                f"{r['ratio']:.2f}x{flag}",
                str(r.get("pairs", "?")),
                f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}",
                f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
                f"{r['other_clock_ratio']:.2f}x",
                r["archon_attention"],
                r["hf_attention"],
                "same" if r["same_loss"] else f"DIFFERS {r['loss_archon']:.4f}/{r['loss_hf']:.4f}",
            )
        )
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    right = {1, 2, 3, 4, 5, 6, 7}

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(
            f"{v:>{w}}" if i in right else f"{v:<{w}}" for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    lines = [line(header), line(tuple("-" * w for w in widths)), *(line(c) for c in cells)]
    measured = [r for r in rows if "error" not in r]
    if measured:
        ratios = [r["ratio"] for r in measured]
        below = [r["family"] for r in measured if r["ratio"] < min_ratio]
        unsure = [r["family"] for r in measured if r["ratio"] >= min_ratio > r["ratio_q1"]]
        lines.append("")
        lines.append(
            f"{len(measured)} families measured, {len(rows) - len(measured)} failed; ratio min {min(ratios):.2f}x, "
            f"median {statistics.median(ratios):.2f}x, max {max(ratios):.2f}x; below {min_ratio}x: "
            f"{', '.join(below) or 'none'}; q1 below it: {', '.join(unsure) or 'none'}"
        )
    return "\n".join(lines)


def footer(settings: dict[str, Any], load: list[Any], cpus: int | None) -> str:
    pairs = settings["iters"]
    pairs = "/".join(str(n) for n in pairs) if isinstance(pairs, list) else str(pairs)
    return (
        f"ratio: median over {pairs} interleaved pairs (HF step, Archon step, order alternating) of "
        f"HF {settings['clock']} time / Archon {settings['clock']} time; spread: the pairs' quartiles and extremes; "
        f"other clock: the same median by the {'wall' if settings['clock'] == 'cpu' else 'cpu'} clock. "
        f"fp32 CPU, {settings['threads']} thread(s), {settings['size']} size, {settings['docs']} documents of "
        f"{settings['min_len']}-{settings['max_len']} tokens, Archon packed (varlen) vs HF padded, "
        f"{settings['warmup']} warm-up pair(s); load average {load[0][0]:.1f} at start, {load[-1][0]:.1f} at end "
        f"on {cpus} CPUs"
    )


def merge(paths: list[Path]) -> dict[str, Any]:
    """The payloads of several runs as one: rows by family, a later file's row replacing an
    earlier one's (a re-measured family), in family order; settings must agree."""
    payloads = [json.loads(path.read_text(encoding="utf-8")) for path in paths]

    def workload(settings: dict[str, Any]) -> dict[str, Any]:
        # What a step computes and how it is clocked; the number of pairs may differ (each row says its own).
        return {k: v for k, v in settings.items() if k not in ("iters", "warmup")}

    settings = payloads[0]["settings"]
    for path, payload in zip(paths[1:], payloads[1:], strict=True):
        if workload(payload["settings"]) != workload(settings):
            raise SystemExit(f"{path}: measured with {payload['settings']}, not {settings}; not merging")

    def pair_counts(settings: dict[str, Any]) -> list[int]:
        # A merged payload already lists its runs' counts (and its rows say their own).
        iters = settings["iters"]
        return list(iters) if isinstance(iters, list) else [iters]

    settings = settings | {"iters": sorted({n for payload in payloads for n in pair_counts(payload["settings"])})}
    rows = {
        row["family"]: {"pairs": max(pair_counts(payload["settings"]))} | row
        for payload in payloads
        for row in payload["rows"]
    }
    return {
        "settings": settings,
        "load_average": [la for payload in payloads for la in payload["load_average"]],
        "cpus": payloads[0]["cpus"],
        "merged_from": [str(path) for path in paths],
        "rows": [rows[family] for family in sorted(rows)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--families", help="comma-separated model_types (default: every registered one)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model widths (bench/train_step.py SIZES)")
    p.add_argument("--docs", type=int, default=8, help="documents per step")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=1, help="untimed pairs of steps first")
    p.add_argument("--iters", type=int, default=8, help="timed pairs of steps (one HF, one Archon), interleaved")
    p.add_argument("--threads", type=int, default=1, help="torch threads per side (1: CPU time is then comparable)")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="what tok/s divides by: the step's process CPU time (default; robust on a shared machine) or wall time",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one family may take")
    p.add_argument(
        "--isolate", action="store_true", help="a fresh process per family (default: one process measures them in turn)"
    )
    p.add_argument("--min-ratio", type=float, default=1.5, help="exit 1 when a family's ratio is below it")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the rows (step times included) as JSON")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="measure nothing: print the table of these runs' JSON (a later file's row for a family replaces an "
        "earlier one's) and, with --json, write them as one",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.merge:
        payload = merge(args.merge)
        rows = payload["rows"]
        if args.json_path:
            args.json_path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        table = format_table(rows, args.min_ratio)
        sys.stdout.write(table + "\n" + footer(payload["settings"], payload["load_average"], payload["cpus"]) + "\n")
        return 1 if any("error" in r or r["ratio"] < args.min_ratio for r in rows) else 0
    if args.iters < 1 or args.warmup < 0:
        p.error("need --iters >= 1 and --warmup >= 0")
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

    for row in run_families(families, opts, args.timeout, args.isolate):
        family = row["family"]
        rows.append(row)
        write_json()  # after every family: a long table run that is stopped keeps what it measured
        if "error" in row:
            logger.info("%-20s error: %s", family, row["error"])
        else:
            logger.info(
                "%-20s %.2fx (pairs %.2f-%.2f; Archon %.0f, HF %.0f tok/s)",
                family,
                row["ratio"],
                row["ratio_min"],
                row["ratio_max"],
                row["archon_tok_s"],
                row["hf_tok_s"],
            )
    table = format_table(rows, args.min_ratio)
    sys.stdout.write(table + "\n" + footer(opts, [load_start, os.getloadavg()], os.cpu_count()) + "\n")
    write_json()
    return 1 if any("error" in r or r["ratio"] < args.min_ratio for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
