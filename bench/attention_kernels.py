"""Forward + backward time of the packed-document attention paths, per variant, on this machine.

The question it answers: which path should a package's kernel (skill/snippets/
attention.py) take where no flash kernel runs (CPU, fp32)? Compared, on the same packed
documents: one call per document, the documents as one zero-padded batch, one SDPA
call with a dense ``[T, T]`` document mask (no soft-cap or sink possible), and flex
attention (forward only: it has no CPU backward). Every path runs the snippet
kernels' own math and is checked against the per-document one before it is timed.

    python bench/attention_kernels.py
    python bench/attention_kernels.py --lengths 300,120,512,64,200,400,90,362 --repeats 5
    python bench/attention_kernels.py --variants alibi
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from skill.snippets.attention import (
    AlibiAttention,
    EagerAttention,
    SinkAttention,
    SlidingWindowAttention,
    alibi_slopes,
    per_document,
)

logger = logging.getLogger("bench.attention_kernels")

Kernel = Callable[..., torch.Tensor]


def _kernel(window=None, softcap=None, sinks=None, slopes=None):
    """The snippet kernel for a variant, and the keyword arguments its ``attend`` takes."""
    if slopes is not None:
        return AlibiAttention(), {"slopes": slopes}
    if sinks is not None:
        return SinkAttention(window), {"sinks": sinks}
    if softcap is not None or window is None:
        return EagerAttention(softcap, window), {}
    return SlidingWindowAttention(window), {}


def loop(q, k, v, cu, window=None, softcap=None, sinks=None, slopes=None):
    """One call per document (the snippets' CPU path)."""
    kernel, kw = _kernel(window, softcap, sinks, slopes)
    return per_document(kernel.attend, q, k, v, cu, scale=q.shape[-1] ** -0.5, **kw)


def padded(q, k, v, cu, window=None, softcap=None, sinks=None, slopes=None):
    """The documents scattered into one zero-padded ``[n_docs, H, L, D]`` batch by index,
    one call of the kernel's ``attend``, gathered back (the CUDA path for sinks before it
    became flex attention with the sink folded in from the log-sum-exp)."""
    kernel, kw = _kernel(window, softcap, sinks, slopes)
    total = q.shape[2]
    bounds = cu.to(torch.long)
    lengths = bounds[1:] - bounds[:-1]
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    columns = torch.arange(total) - bounds[:-1][rows]

    def pad(x):
        out = x.new_zeros(lengths.numel(), int(lengths.max()), x.shape[1], x.shape[3])
        return out.index_put((rows, columns), x[0].transpose(0, 1)).transpose(1, 2)

    out = kernel.attend(pad(q), pad(k), pad(v), scale=q.shape[-1] ** -0.5, **kw)
    return out.transpose(1, 2)[rows, columns].transpose(0, 1).unsqueeze(0)


def dense_mask(q, k, v, cu, window=None, softcap=None, sinks=None, slopes=None):
    """One SDPA call with a ``[T, T]`` boolean document (and window) mask; with ALiBi an
    additive ``[H, T, T]`` bias (in-document distance times the slope, -inf elsewhere)."""
    if softcap is not None or sinks is not None:
        raise NotImplementedError("SDPA can neither soft-cap nor take a sink")
    pos = torch.arange(q.shape[2])
    doc = torch.searchsorted(cu, pos, right=True)
    d = pos[:, None] - pos[None, :]
    m = (doc[:, None] == doc[None, :]) & (d >= 0)
    if window is not None:
        m = m & (d < window)
    if slopes is not None:
        bias = (slopes.view(-1, 1, 1) * -d.float()).masked_fill(~m, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=q.shape[1] != k.shape[1])


def flex(q, k, v, cu, window=None, softcap=None, sinks=None, slopes=None):
    """Flex attention with a block mask from the document ids (the snippets' CUDA path for
    soft-caps, sinks and ALiBi, compiled there; forward only, uncompiled, on CPU)."""
    if sinks is not None:
        return SinkAttention(window).flex(q, k, v, sinks, cu, q.shape[-1] ** -0.5)
    if slopes is not None:
        return AlibiAttention().flex(q, k, v, slopes, cu, q.shape[-1] ** -0.5)
    return EagerAttention(softcap, window).flex(q, k, v, cu, scale=q.shape[-1] ** -0.5)


KERNELS: dict[str, Kernel] = {"loop": loop, "dense_mask": dense_mask, "flex": flex, "padded": padded}


def _time(fn: Kernel, inputs: tuple, kw: dict, backward: bool, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        q, k, v = (t.detach().requires_grad_(backward) for t in inputs[:3])
        start = time.perf_counter()
        out = fn(q, k, v, inputs[3], **kw)
        if backward:
            out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="300,120,512,64,200,400,90,362", help="document lengths")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--variants", default="", help="comma-separated variants to time (default: all)")
    opts = p.parse_args(argv)
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    lengths = [int(x) for x in opts.lengths.split(",")]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(1, opts.heads, total, opts.head_dim)
    k = torch.randn(1, opts.kv_heads, total, opts.head_dim)
    v = torch.randn(1, opts.kv_heads, total, opts.head_dim)
    sinks = torch.randn(opts.heads)
    variants = {
        "causal": {},
        "window": {"window": opts.window},
        "softcap": {"softcap": 50.0},
        "window+softcap": {"window": opts.window, "softcap": 50.0},
        "sinks": {"sinks": sinks},
        "window+sinks": {"window": opts.window, "sinks": sinks},
        "alibi": {"slopes": alibi_slopes(opts.heads)},
    }
    logger.info(
        "%d documents, %d tokens, %d/%d heads of %d", len(lengths), total, opts.heads, opts.kv_heads, opts.head_dim
    )
    rows = [f"{'variant':<16} {'path':<11} {'fwd ms':>9} {'fwd+bwd ms':>11}  max diff vs loop"]
    chosen = [v for v in opts.variants.split(",") if v] or list(variants)
    for variant, kw in ((v, variants[v]) for v in chosen):
        expected = loop(q, k, v, cu, **kw).detach()
        for name, fn in KERNELS.items():
            try:
                diff = (fn(q, k, v, cu, **kw) - expected).abs().max().item()
            except NotImplementedError as exc:
                rows.append(f"{variant:<16} {name:<11} {'-':>9} {'-':>11}  n/a: {exc}")
                continue
            fwd = _time(fn, (q, k, v, cu), kw, False, opts.repeats)
            try:
                both = f"{_time(fn, (q, k, v, cu), kw, True, opts.repeats):11.1f}"
            except (NotImplementedError, RuntimeError):
                both = f"{'no bwd':>11}"
            rows.append(f"{variant:<16} {name:<11} {fwd:9.1f} {both}  {diff:.1e}")
    sys.stdout.write("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
