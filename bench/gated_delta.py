"""Forward + backward time of a Gated DeltaNet layer: the qwen3_5 reference's against HF's, side by side.

The question it answers: what does the qwen3_5 package's PyTorch path (the chunked gated
delta rule, document by document; ``archon_models/qwen3_5/model/gated_delta.py``) cost
against HF's own PyTorch fallback of the same layer (``torch_chunk_gated_delta_rule``, which
ignores document boundaries: it runs each packed row as one sequence), and, on CUDA with
flash-linear-attention installed, what its fused kernel gains. Both layers hold the same
weights (HF's, loaded into the reference by name) and their outputs are compared on one
document before anything is timed.

Rows: one packed row of ``--docs`` documents of ``--length`` tokens each, at Qwen3.5-9B's
layer widths by default (hidden 4096, 16 key heads and 32 value heads of 128). Columns: HF's
time, the reference's, their ratio (HF / reference: above 1, the reference is faster), and
on CUDA the peak memory of each.

    python bench/gated_delta.py
    python bench/gated_delta.py --lengths 256,1024 --docs 1,4 --hidden 1024 --repeats 3
    python bench/gated_delta.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from archon_models.qwen3_5.model import gated_delta
from archon_models.qwen3_5.model.args import Qwen3_5ModelArgs
from archon_models.qwen3_5.model.model import GatedDeltaNet


def _layers(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = AutoConfig.for_model(
        "qwen3_5_text",
        hidden_size=args.hidden,
        linear_num_key_heads=args.key_heads,
        linear_num_value_heads=args.value_heads,
        linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    ours = GatedDeltaNet(
        Qwen3_5ModelArgs(
            dim=args.hidden,
            n_layers=1,
            norm_eps=config.rms_norm_eps,
            linear_num_key_heads=args.key_heads,
            linear_num_value_heads=args.value_heads,
            linear_key_head_dim=args.head_dim,
            linear_value_head_dim=args.head_dim,
        )
    )
    ours.load_state_dict(hf.state_dict())
    dtype = getattr(torch, args.dtype)
    return hf.to(args.device, dtype), ours.to(args.device, dtype)


def _timed(step, repeats: int, device: str) -> tuple[float, float | None]:
    """Median seconds of ``step()`` (forward + backward) after one warm-up, and the peak CUDA memory (GiB)."""
    step()
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,1024,4096", help="tokens per document")
    p.add_argument("--docs", default="1,4", help="documents per packed row")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    hf, ours = _layers(args)
    dtype = getattr(torch, args.dtype)

    # Same weights, same maths: one document through both before anything is timed.
    x = torch.randn(1, 96, args.hidden, device=args.device, dtype=dtype)
    with torch.no_grad():
        diff = float((hf(x) - ours(x, torch.tensor([0, 96], device=args.device, dtype=torch.int32))).abs().max())
    fused = args.device == "cuda" and gated_delta.fla_chunk_gated_delta_rule is not None
    print(
        f"Gated DeltaNet layer, hidden {args.hidden}, {args.key_heads} key / {args.value_heads} value heads of "
        f"{args.head_dim}, {args.dtype} on {args.device} (torch {torch.__version__}); reference path: "
        f"{'fla chunk_gated_delta_rule + causal_conv1d' if fused else 'PyTorch, per document'}; "
        f"max |HF - reference| on one document of 96: {diff:.2e}"
    )
    header = f"{'docs x length':>14} {'HF s':>9} {'reference s':>12} {'HF/reference':>13}"
    if args.device == "cuda":
        header += f" {'HF GiB':>8} {'ref GiB':>8}"
    print(header)
    for docs in (int(d) for d in args.docs.split(",")):
        for length in (int(n) for n in args.lengths.split(",")):
            total = docs * length
            x = torch.randn(1, total, args.hidden, device=args.device, dtype=dtype, requires_grad=True)
            cu = torch.arange(0, total + 1, length, device=args.device, dtype=torch.int32)

            hf_s, hf_peak = _timed(lambda x=x: hf(x).sum().backward(), args.repeats, args.device)
            ours_s, ours_peak = _timed(lambda x=x, cu=cu: ours(x, cu).sum().backward(), args.repeats, args.device)
            row = f"{f'{docs} x {length}':>14} {hf_s:>9.3f} {ours_s:>12.3f} {hf_s / ours_s:>13.2f}"
            if hf_peak is not None and ours_peak is not None:
                row += f" {hf_peak:>8.2f} {ours_peak:>8.2f}"
            print(row, flush=True)
    print(
        "HF's fallback runs a packed row as one sequence (its state crosses documents); the reference "
        "restarts each document, as fla's kernel does through cu_seqlens."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
