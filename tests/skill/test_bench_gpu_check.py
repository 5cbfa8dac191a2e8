"""``bench/gpu_check.py`` on CPU: every code path the GPU session will run, with tiny shapes,
so a typo or an API misuse is found here and not in the GPU's 15 minutes.

What only CUDA has is replaced at the device boundary alone: ``torch.cuda``'s allocator
counters (``DeviceStats``). Compilation runs for real (inductor on CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import gpu_check
from skill.harness.models import build_archon_model

ROOT = Path(__file__).resolve().parents[2]

# A rehearsal of the GPU session's script, not of the product: .ci/run runs it (``-m bench``);
# the README's test command leaves it out (it is 50-80 worker-seconds, the compiled row's inductor
# build most of them).
pytestmark = pytest.mark.bench


def _opts(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        **gpu_check.QUICK,
        "docs": 3,
        "device": "cpu",
        "quick": True,
        "peak_tflops": gpu_check.H200_PEAK_TFLOPS,
        "seed": 0,
        "scratch": str(tmp_path),
    } | extra


def test_smoke_correctness_and_training_rows_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command as the GPU runs it (a spawned worker, the budget, both tables, the JSON),
    on CPU with quick shapes; the compiled row has its own test below."""
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--quick", "--families", "llama", "--parts", "correctness,train", "--json", str(out)]
    assert gpu_check.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Correctness" in printed and "Training step" in printed and "torch " in printed
    payload = json.loads(out.read_text())
    assert payload["environment"]["torch"] == torch.__version__
    (correct,) = payload["correctness"]
    assert correct["bf16_passed"] and correct["device_passed"], correct
    assert correct["doc_lens"] == [1200, 300, 740, 160]
    hf, archon = payload["train"]
    assert (hf["side"], archon["side"]) == ("hf", "archon")
    for row in (hf, archon):
        assert row["tok_s"] > 0 and row["mfu"] > 0 and row["real_tokens"] == sum(payload["settings"]["doc_lens"])
        assert row["peak_bytes"] is None  # no allocator counters on CPU
    assert hf["padded_tokens"] > hf["real_tokens"] and hf["attention"].startswith("HF ")
    # The kernel the Archon layers ran, as the profiler saw it (CPU: SDPA's CPU flash kernel).
    assert "VarlenAttentionWrapper" in archon["attention"] and "scaled_dot_product" in archon["attention"]
    assert abs(hf["loss"] - archon["loss"]) < 0.1


@pytest.mark.slow
def test_compiled_row_compiles_every_block_on_cpu(tmp_path: Path) -> None:
    """The package's own parallelize_fn with enable_compile=True on one rank, as AReaL compiles;
    inductor on CPU (about 30 s cold on a loaded 2-core machine, 5 s with its cache warm)."""
    opts = _opts(tmp_path)
    eager = gpu_check.train_row("llama", "archon", opts)
    compiled = gpu_check.train_row("llama", "compiled", opts)
    layers = gpu_check.workload_config("llama", quick=True).num_hidden_layers
    assert compiled["compiled_modules"] == layers
    assert f"[{layers} compiled modules]" in compiled["attention"]
    assert compiled["tok_s"] > 0 and compiled["first_step_s"] > max(compiled["step_s"])
    # Same weights, same documents: the compiled step computes the eager step's loss (bf16).
    assert abs(compiled["loss"] - eager["loss"]) < 0.05, (compiled["loss"], eager["loss"])


def test_device_stats_use_cuda_counters_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("peak", device)) or 123)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty", None)))
    cuda = torch.device("cuda")
    stats = gpu_check.DeviceStats(cuda)
    stats.synchronize()
    stats.reset_peak()
    assert stats.peak_bytes() == 123
    stats.release()
    assert calls == [("sync", cuda), ("reset", cuda), ("peak", cuda), ("empty", None)]
    calls.clear()
    cpu = gpu_check.DeviceStats(torch.device("cpu"))
    cpu.synchronize()
    cpu.reset_peak()
    assert cpu.peak_bytes() is None
    cpu.release()
    assert calls == []


def test_plan_runs_the_headline_compiled_row_early() -> None:
    rows = gpu_check.plan(["llama", "qwen3", "gemma2"], list(gpu_check.PARTS))
    keys = [(r["part"], r["family"], r.get("side")) for r in rows]
    assert keys == [
        ("correctness", "llama", None),
        ("correctness", "qwen3", None),
        ("correctness", "gemma2", None),
        ("train", "llama", "hf"),
        ("train", "llama", "archon"),
        ("train", "llama", "compiled"),
        ("train", "qwen3", "hf"),
        ("train", "qwen3", "archon"),
        ("train", "gemma2", "hf"),
        ("train", "gemma2", "archon"),
        ("train", "qwen3", "compiled"),
        ("train", "gemma2", "compiled"),
    ]
    assert [r.get("side") for r in gpu_check.plan(["llama"], ["compiled"])] == ["compiled"]


class _FakeWorker:
    """Stands in for the spawned process: each item's outcome is scripted."""

    outcomes: ClassVar[dict[str, str]] = {}
    started = 0

    def __init__(self, opts: dict[str, Any], task: Any = None):
        type(self).started += 1
        self._alive = True

    def is_alive(self) -> bool:
        return self._alive

    def stop(self) -> None:
        self._alive = False

    def close(self) -> None:
        pass

    def run(self, item: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        outcome = self.outcomes[item["family"]]
        if outcome == "dies":
            self._alive = False
            return None
        if outcome == "hangs":
            return None
        return {**item, "tok_s": 1.0}


def test_run_plan_turns_every_failure_into_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "Worker", _FakeWorker)
    _FakeWorker.outcomes = {"a": "ok", "b": "dies", "c": "hangs", "d": "ok"}
    _FakeWorker.started = 0
    items = [{"part": "train", "family": f, "side": "hf"} for f in "abcd"]
    seen: list[dict[str, Any]] = []
    rows = gpu_check.run_plan(items, {}, budget_s=10_000.0, on_row=seen.append)
    assert rows == seen and [r["family"] for r in rows] == ["a", "b", "c", "d"]
    assert rows[0]["tok_s"] == 1.0 and rows[3]["tok_s"] == 1.0
    assert "worker process died" in rows[1]["error"]
    assert "ran past its" in rows[2]["error"]
    assert _FakeWorker.started == 3  # a fresh worker after each lost one


def test_run_plan_spent_budget_leaves_rows_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "Worker", _FakeWorker)
    _FakeWorker.outcomes = {"a": "ok"}
    rows = gpu_check.run_plan(
        [{"part": "correctness", "family": "a"}], {}, budget_s=gpu_check.RESERVE_S, on_row=lambda r: None
    )
    assert rows == [
        {"part": "correctness", "family": "a", "not_run": f"the {gpu_check.RESERVE_S:.0f} s budget was spent"}
    ]


def _sleep_task(item: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    time.sleep(item["sleep"])
    return {**item, "slept": True}


@pytest.mark.slow
def test_budget_stops_a_running_row_and_prints_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real spawned worker: a row still running at the budget is stopped (the process
    killed), the rows after it are not run, and it all returns within the budget. The budget
    is a real one: long enough for the spawned worker to import torch and run the first row on
    a loaded 2-core machine (4 s when idle), short enough not to idle the suite."""
    monkeypatch.setattr(gpu_check, "RESERVE_S", 0.0)
    items = [
        {"part": "correctness", "family": "quick", "sleep": 0.0},
        {"part": "correctness", "family": "stuck", "sleep": 600.0},
        {"part": "correctness", "family": "later", "sleep": 0.0},
    ]
    start = time.monotonic()
    rows = gpu_check.run_plan(items, {}, budget_s=15.0, on_row=lambda r: None, task=_sleep_task)
    assert time.monotonic() - start < 25.0
    assert rows[0].get("slept") is True, rows[0]
    assert rows[1]["error"] == "stopped at the 15 s budget"
    assert rows[2]["not_run"] == "the 15 s budget was spent"


def test_formatted_tables_show_failures_and_rows_not_run() -> None:
    correctness = [
        {
            "part": "correctness",
            "family": "llama",
            "covers": "varlen",
            "doc_lens": [3, 2],
            "bf16_logits_ratio": 1.01,
            "bf16_grad_ratio": 2.5,
            "bf16_worst_grad": "grad norm.weight",
            "bf16_passed": False,
            "device_judged_by": "ratio",
            "device_worst": "grad x: mean |diff| 1e-3 = 0.50x HF's own bf16 error",
            "device_max_rel": 1e-3,
            "device_passed": True,
            "computes_bf16": "the grouped expert GEMMs",
        },
        {"part": "correctness", "family": "gemma2", "error": "RuntimeError: boom"},
    ]
    text = gpu_check.format_correctness(correctness)
    llama = next(line for line in text.splitlines() if line.startswith("llama"))
    assert "2.50x norm.weight" in llama and "FAIL" in llama and "[ratio: the grouped expert GEMMs]" in llama
    assert "error: RuntimeError: boom" in text
    train = [
        {"part": "train", "family": "llama", "side": "hf", "tok_s": 100.0, "params": 1e9, "mfu": 0.18,
         "peak_bytes": 2 * 2**30, "step_s": [1.0], "first_step_s": 2.0, "loss": 10.0, "attention": "HF sdpa"},
        {"part": "train", "family": "llama", "side": "archon", "tok_s": 194.0, "params": 1e9, "mfu": 0.35,
         "peak_bytes": None, "step_s": [0.5], "first_step_s": 1.0, "loss": 10.0, "attention": "Varlen"},
        {"part": "train", "family": "llama", "side": "compiled", "not_run": "the 450 s budget was spent"},
    ]  # fmt: skip
    table = gpu_check.format_train(train).splitlines()
    assert "1.94x" in table[3] and "35.0%" in table[3] and "2.0" in table[2]
    assert "not run: the 450 s budget was spent" in table[4]


def test_attention_op_filter_keeps_forward_kernels_only() -> None:
    keep = ["aten::_flash_attention_forward", "torch_attn::_varlen_attn", "aten::_softmax", "aten::_grouped_mm"]
    drop = ["aten::_log_softmax", "autograd::engine::evaluate_function: SoftmaxBackward0", "aten::mm",
            "aten::_flash_attention_backward", "FlashAttentionBackward0"]  # fmt: skip
    assert all(gpu_check.is_attention_op(n) for n in keep)
    assert not any(gpu_check.is_attention_op(n) for n in drop)


def test_attended_keys_and_flops() -> None:
    for length in (1, 5, 128, 300):
        for window in (None, 1, 7, 128, 1000):
            brute = sum(min(i + 1, window or i + 1) for i in range(length))
            assert gpu_check.attended_keys(length, window) == brute
    config = gpu_check.real_config("llama")
    model = build_archon_model(config, device="meta").model
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n)
    assert gpu_check.matmul_parameters(model) == non_embedding
    lens = [1000, 24]
    attention = 6 * (1000 * 1001 // 2 + 24 * 25 // 2) * 32 * (64 + 64) * 22 / sum(lens)
    assert gpu_check.train_flops_per_token(model, config, lens) == pytest.approx(6 * non_embedding + attention)


def test_moe_flops_count_only_the_routed_share() -> None:
    config = gpu_check.real_config("mixtral")
    model = build_archon_model(config, device="meta").model
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n)
    assert gpu_check.matmul_parameters(model) == pytest.approx(dense + experts * 2 / 8)


# Parameters (billions) of each real shape: the models.
EXPECTED_PARAMS_B = {
    "llama": (1.05, 1.15),
    "qwen3": (0.55, 0.65),
    "gemma2": (0.95, 1.1),
    "mixtral": (0.2, 0.5),
    "gpt_oss": (0.2, 0.5),
    "deepseek_v3": (0.2, 0.5),
    "bloom": (0.4, 0.6),
    "gptj": (0.4, 0.6),
    "phi3": (0.4, 0.6),
}


@pytest.mark.parametrize("family", gpu_check.FAMILIES)
def test_real_shapes_build_on_both_sides(family: str) -> None:
    """Each real shape is a valid config of its family for HF and for the Archon package (on
    the meta device: no memory), with the same parameter count, at the size the issue names;
    every document fits the model's positions."""
    config = gpu_check.real_config(family)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    archon = build_archon_model(config, attn_type="varlen", device="meta").model
    n_params = sum(p.numel() for p in archon.parameters())
    assert n_params == sum(p.numel() for p in hf.parameters())
    low, high = EXPECTED_PARAMS_B[family]
    assert low * 1e9 <= n_params <= high * 1e9, n_params
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    assert positions is None or positions >= gpu_check.FULL["max_len"]
    assert all(getattr(config, name) == value for name, value in gpu_check.TOKEN_IDS.items())


def test_gpu_check_needs_neither_libcst_nor_mcp() -> None:
    """The GPU machine has torch, transformers, safetensors, pydantic and pytest only: the
    check and the GPU tier import with libcst and mcp unimportable."""
    code = (
        "import importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('libcst', 'mcp'):\n"
        "            raise ImportError(f'{name} is not on the GPU machine')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import runpy\n"
        "runpy.run_path('bench/gpu_check.py', run_name='gpu_check')\n"
        "import tests.gpu.test_gpu_tier\n"
        "assert not any(m.split('.')[0] in ('libcst', 'mcp') for m in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_imported_main_counts_its_budget_from_its_own_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Imported (as the suite does), main's budget starts at the call, not when the module was
    imported: late in a 15-minute test run the smoke test found its 450 s spent before any row
    ran, and a row that never ran raised KeyError 'bf16_passed' instead of a failed row."""
    seen: list[float] = []

    def fake_run_plan(items, opts, budget_s, on_row, started):  # type: ignore[no-untyped-def]
        seen.append(started)
        on_row({"part": "correctness", "family": "llama", "not_run": "the budget was spent"})

    monkeypatch.setattr(gpu_check, "PROCESS_START", time.monotonic() - 10_000)
    monkeypatch.setattr(gpu_check, "run_plan", fake_run_plan)
    before = time.monotonic()
    argv = ["--device", "cpu", "--quick", "--families", "llama", "--parts", "correctness"]
    assert gpu_check.main([*argv, "--json", str(tmp_path / "out.json")]) == 1  # the not-run row fails, by name
    assert seen and seen[0] >= before
