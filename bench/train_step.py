"""Tokens/s of one training step: Archon Qwen3 on packed documents vs HF Qwen3 on a padded batch.

Both models hold the same weights (a ~50M-parameter Qwen3, fp32, CPU) and see the same
documents. Archon packs them into one ``[1, T]`` row with ``cu_seqlens``; HF pads them
to ``[n_docs, max_len]`` with an attention mask, as a trainer without packing would.
One step is forward, next-token cross-entropy over the real tokens, and backward.
Throughput counts real (unpadded) tokens for both. Each implementation runs in its own
spawned process so that its peak RSS is its own (spawned, not forked: a fork after
torch has started its OpenMP threads can deadlock).

    python bench/train_step.py            # defaults: 8 documents of 64..512 tokens
    python bench/train_step.py --iters 10 --threads 2
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from archon_models.qwen3 import Qwen3Model, Qwen3ModelArgs, Qwen3StateDictAdapter

logger = logging.getLogger("bench.train_step")


def bench_config() -> Qwen3Config:
    """A ~50M-parameter Qwen3 (6 layers of 512, untied 32k vocabulary)."""
    return Qwen3Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@dataclass
class Documents:
    docs: list[torch.Tensor]

    @property
    def n_tokens(self) -> int:
        return sum(len(d) for d in self.docs)

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """``tokens``, ``positions`` ``[1, T]``, ``cu_seqlens``, ``max_seqlen``, and next-token
        labels (-100 at doc ends)."""
        tokens = torch.cat(self.docs)[None]
        positions = torch.cat([torch.arange(len(d)) for d in self.docs])[None]
        lengths = torch.tensor([len(d) for d in self.docs])
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in self.docs])[None]
        return tokens, positions, cu_seqlens, int(lengths.max()), labels

    def padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids``, ``attention_mask`` ``[n_docs, max_len]`` (right padding) and labels
        (-100 on padding/doc ends)."""
        max_len = max(len(d) for d in self.docs)
        input_ids = torch.full((len(self.docs), max_len), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        labels = torch.full_like(input_ids, -100)
        for i, d in enumerate(self.docs):
            input_ids[i, : len(d)] = d
            mask[i, : len(d)] = 1
            labels[i, : len(d) - 1] = d[1:]
        return input_ids, mask, labels


def make_documents(n_docs: int, min_len: int, max_len: int, vocab: int, seed: int) -> Documents:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n_docs,), generator=g)
    return Documents([torch.randint(3, vocab, (int(n),), generator=g) for n in lengths])


def build_models(attn_type: str, seed: int) -> tuple[Qwen3ForCausalLM, Qwen3Model]:
    """The HF model (random, seeded) and an Archon model loaded with its weights."""
    config = bench_config()
    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").float()
    args = Qwen3ModelArgs.from_hf_config(config, attn_type=attn_type)
    archon = Qwen3Model(args)
    # Dense Qwen3 keeps the same parameter names in memory and on disk.
    archon.load_state_dict(Qwen3StateDictAdapter(config).from_hf(hf.state_dict()))
    return hf, archon


def _step_fn(impl: str, hf: Qwen3ForCausalLM, archon: Qwen3Model, docs: Documents):
    if impl == "archon":
        tokens, positions, cu_seqlens, max_seqlen, labels = docs.packed()

        def step() -> float:
            logits = archon(tokens, positions, cu_seqlens, max_seqlen)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
            loss.backward()
            return loss.item()

        return archon, step

    input_ids, mask, labels = docs.padded(bench_config().pad_token_id)

    def step() -> float:
        logits = hf(input_ids=input_ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss.backward()
        return loss.item()

    return hf, step


def _run(impl: str, opts: argparse.Namespace, queue: mp.Queue) -> None:
    """Child process: build, warm up, time; report step times, loss and peak RSS."""
    torch.set_num_threads(opts.threads)
    hf, archon = build_models(opts.attn_type, opts.seed)
    docs = make_documents(opts.docs, opts.min_len, opts.max_len, bench_config().vocab_size, opts.seed)
    model, step = _step_fn(impl, hf, archon, docs)
    del hf, archon
    model.train()
    loss = 0.0
    for _ in range(opts.warmup):
        loss = step()
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(opts.iters):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    queue.put({"impl": impl, "times": times, "loss": loss, "peak_rss_mb": peak_rss_mb})


def run_isolated(impl: str, opts: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_run, args=(impl, opts, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"benchmark process for {impl} exited with {proc.exitcode}")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=8, help="documents per step")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--attn-type", choices=("varlen", "sdpa"), default="varlen", help="Archon attention backend")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    if not 1 <= opts.min_len <= opts.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if opts.docs < 1 or opts.iters < 1 or opts.warmup < 0:
        p.error("need --docs >= 1, --iters >= 1, --warmup >= 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    opts = parse_args(argv)
    docs = make_documents(opts.docs, opts.min_len, opts.max_len, bench_config().vocab_size, opts.seed)
    lengths = [len(d) for d in docs.docs]
    n_params = sum(p.numel() for p in Qwen3Model(Qwen3ModelArgs.from_hf_config(bench_config())).parameters())
    logger.info(
        "Qwen3 %.1fM params, fp32, %d threads; %d documents, %d tokens (lengths %s); padded batch %dx%d = %d slots",
        n_params / 1e6,
        opts.threads,
        len(lengths),
        docs.n_tokens,
        lengths,
        len(lengths),
        max(lengths),
        len(lengths) * max(lengths),
    )
    results = [run_isolated("hf", opts), run_isolated("archon", opts)]
    label = {"hf": "HF Qwen3ForCausalLM (padded, sdpa)", "archon": f"Archon Qwen3Model (packed, {opts.attn_type})"}
    rows = []
    for r in results:
        step_ms = statistics.median(r["times"]) * 1000
        rows.append((label[r["impl"]], docs.n_tokens / (step_ms / 1000), step_ms, r["peak_rss_mb"], r["loss"]))
    width = max(len(row[0]) for row in rows)
    lines = [
        f"{'impl':<{width}}  {'tokens/s':>9}  {'step ms':>8}  {'peak RSS MB':>11}  {'loss':>8}",
        *(f"{n:<{width}}  {tps:>9.0f}  {ms:>8.1f}  {rss:>11.0f}  {loss:>8.4f}" for n, tps, ms, rss, loss in rows),
    ]
    ratio = rows[1][1] / rows[0][1]
    lines.append(f"Archon / HF tokens/s: {ratio:.2f}x  (median of {opts.iters} steps after {opts.warmup} warm-up)")
    sys.stdout.write("\n".join(lines) + "\n")
    if abs(rows[0][4] - rows[1][4]) > 1e-3:
        logger.warning(
            "losses differ (%.6f vs %.6f): the two runs did not compute the same thing", rows[0][4], rows[1][4]
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
