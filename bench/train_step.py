"""Tokens/s of one training step: an Archon model on packed documents vs its HF model on a padded batch.

Any registered family (``--model``, default qwen3): both sides hold the same weights (the
HF model built from the family's config class at a small-but-not-trivial size, fp32, CPU,
saved with ``save_pretrained`` and loaded into Archon through the family's adapter) and see
the same documents. Archon packs them into one ``[1, T]`` row with ``cu_seqlens``; HF pads
them to ``[n_docs, max_len]`` with an attention mask, as a trainer without packing would.
One step is forward, next-token cross-entropy over the real tokens, and backward.
Throughput counts real (unpadded) tokens for both. Each implementation runs in its own
spawned process so that its peak RSS is its own (spawned, not forked: a fork after
torch has started its OpenMP threads can deadlock).

    python bench/train_step.py                      # qwen3; 8 documents of 64..512 tokens
    python bench/train_step.py --model gemma2 --iters 10 --threads 2
    python bench/train_step.py --model mistral,starcoder2 --size small   # several families, one table
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger("bench.train_step")

# Model sizes (transformers' canonical field names); tiny_config keeps every other feature
# of the family (layer types, windows, soft-caps, MoE pattern) at its tiny value.
SIZES: dict[str, dict[str, int]] = {
    # ~50M parameters for qwen3: 6 layers of 512, 8 heads of 64 (4 KV heads), 32k vocabulary.
    "default": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    ),
    # A quarter of it, for sweeping every family on a small CPU.
    "small": dict(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    ),
}


def bench_config(model_type: str, size: str = "default") -> PretrainedConfig:
    """The family's config class at the bench size: its features kept, its widths set."""
    from skill.tiny_model import tiny_config

    sizes: dict[str, Any] = dict(SIZES[size])
    probe = tiny_config(model_type)
    derived = isinstance(getattr(type(probe), "head_dim", None), property)  # FalconConfig: a read-only property
    if not hasattr(probe, "head_dim") or derived or hasattr(probe, "qk_rope_head_dim"):
        # The family derives it from hidden_size / heads, or (MLA) its head widths are their own fields.
        sizes.pop("head_dim")
    kv_heads = getattr(probe, "num_key_value_heads", None)
    if kv_heads in (None, probe.num_attention_heads):
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]  # no GQA in the family: keep MHA
    elif kv_heads == 1:
        # Multi-query (tiny_config keeps it as one KV head): a switch such as GPTBigCode's
        # multi_query fixes one KV head whatever the count says, so the count must say one.
        sizes["num_key_value_heads"] = 1
    if isinstance(getattr(probe, "sliding_window", None), int):
        sizes["sliding_window"] = 128  # shorter than the longest documents, so the window works
    sizes.update(dropout_off(probe))
    return tiny_config(probe, pad_token_id=0, bos_token_id=1, eos_token_id=2, **sizes)


def dropout_off(config: PretrainedConfig) -> dict[str, float]:
    """Each dropout probability of ``config`` that is on, as 0.0. Archon applies no dropout; HF
    in training mode would (GPT-2's resid/embd/attn_pdrop, OPT's dropout, ...), spending time
    Archon does not and computing another loss. Both sides run without."""
    return {
        name: 0.0
        for name, value in config.to_dict().items()
        if ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float) and value > 0
    }


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


def _hf_model(
    config: PretrainedConfig,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """The HF model (random, seeded) with its fastest attention that runs here (SDPA where the
    family supports it, else eager), in training mode, built on ``device`` in ``dtype``."""
    from skill.tiny_model import build_tiny_model

    try:
        model = build_tiny_model(config, seed=seed, attn_implementation="sdpa", dtype=dtype, device=device)
    except Exception:  # a family whose attention SDPA cannot run (sinks, soft-caps) refuses it
        model = build_tiny_model(config, seed=seed, attn_implementation="eager", dtype=dtype, device=device)
    return model.train()


def build_archon(
    config: PretrainedConfig, attn_type: str, seed: int, hf: PreTrainedModel | None = None
) -> torch.nn.Module:
    """The Archon model of ``config`` loaded, through the family's adapter, with the weights
    ``save_pretrained`` writes for the seeded HF model (``hf`` when given: it is that model)."""
    from skill.harness.models import load_archon_model, save_hf_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        save_hf_checkpoint(_hf_model(config, seed) if hf is None else hf, tmp)
        return load_archon_model(config, tmp, attn_type=attn_type).model.train()


def _step_fn(impl: str, opts: argparse.Namespace, config: PretrainedConfig, docs: Documents):
    if impl == "archon":
        model = build_archon(config, opts.attn_type, opts.seed)
        tokens, positions, cu_seqlens, max_seqlen, labels = docs.packed()

        def step() -> float:
            logits = model(tokens, positions, cu_seqlens, max_seqlen)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
            loss.backward()
            return loss.item()

        return model, step

    hf = _hf_model(config, opts.seed)
    input_ids, mask, labels = docs.padded(config.pad_token_id)

    def hf_step() -> float:
        logits = hf(input_ids=input_ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        loss.backward()
        return loss.item()

    return hf, hf_step


def _run(impl: str, model_type: str, opts: argparse.Namespace, queue: mp.Queue) -> None:
    """Child process: build, warm up, time; report step times, loss and peak RSS."""
    from transformers.utils import logging as hf_logging

    import archon_models  # noqa: F401 - registers every family

    hf_logging.disable_progress_bar()
    torch.set_num_threads(opts.threads)
    config = bench_config(model_type, opts.size)
    docs = make_documents(opts.docs, opts.min_len, opts.max_len, config.vocab_size, opts.seed)
    model, step = _step_fn(impl, opts, config, docs)
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
    n_params = sum(p.numel() for p in model.parameters())
    queue.put({"impl": impl, "times": times, "loss": loss, "peak_rss_mb": peak_rss_mb, "params": n_params})


def run_isolated(impl: str, model_type: str, opts: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_run, args=(impl, model_type, opts, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"benchmark process for {impl} exited with {proc.exitcode}")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3", help="registered model_type(s), comma-separated")
    p.add_argument("--size", choices=sorted(SIZES), default="default", help="model widths (see SIZES)")
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
    import archon_models

    unknown = [m for m in opts.model.split(",") if not archon_models.is_supported_model(m)]
    if unknown:
        p.error(
            f"not registered in archon_models: {', '.join(unknown)}; known: {archon_models.get_supported_model_types()}"
        )
    return opts


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    opts = parse_args(argv)
    docs = make_documents(opts.docs, opts.min_len, opts.max_len, SIZES[opts.size]["vocab_size"], opts.seed)
    lengths = [len(d) for d in docs.docs]
    logger.info(
        "fp32, %d threads, %s size; %d documents, %d tokens (lengths %s); padded batch %dx%d = %d slots",
        opts.threads,
        opts.size,
        len(lengths),
        docs.n_tokens,
        lengths,
        len(lengths),
        max(lengths),
        len(lengths) * max(lengths),
    )
    rows = []
    for model_type in opts.model.split(","):
        hf, archon = run_isolated("hf", model_type, opts), run_isolated("archon", model_type, opts)
        hf_tps, archon_tps = (docs.n_tokens / statistics.median(r["times"]) for r in (hf, archon))
        rows.append((model_type, archon["params"] / 1e6, archon_tps, hf_tps, archon_tps / hf_tps, archon, hf))
        logger.info("%s: Archon %.0f tok/s, HF %.0f tok/s, %.2fx", model_type, archon_tps, hf_tps, archon_tps / hf_tps)
        if abs(hf["loss"] - archon["loss"]) > 1e-3:
            logger.warning(
                "%s: losses differ (%.6f HF vs %.6f Archon): the two runs did not compute the same thing",
                model_type,
                hf["loss"],
                archon["loss"],
            )
    width = max(len("family"), *(len(r[0]) for r in rows))
    header = (
        f"{'family':<{width}}  {'params M':>8}  {'Archon tok/s':>12}  {'HF tok/s':>9}  {'ratio':>6}  "
        f"{'Archon RSS MB':>13}  {'HF RSS MB':>9}  {'loss':>8}"
    )
    lines = [
        header,
        *(
            f"{name:<{width}}  {params:>8.1f}  {a_tps:>12.0f}  {h_tps:>9.0f}  {ratio:>5.2f}x  "
            f"{a['peak_rss_mb']:>13.0f}  {h['peak_rss_mb']:>9.0f}  {a['loss']:>8.4f}"
            for name, params, a_tps, h_tps, ratio, a, h in rows
        ),
        f"Archon packed ({opts.attn_type}) vs HF padded; median of {opts.iters} steps after {opts.warmup} warm-up",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
