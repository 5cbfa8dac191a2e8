"""The training-step bench (``bench/train_step.py``, ``bench/train_step_all.py``): what it
compares is a fair pair, and how it reports a ratio says how sure it is."""

from __future__ import annotations

import json
import runpy
import statistics
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def table() -> dict[str, Any]:
    return runpy.run_path(str(BENCH / "train_step_all.py"))


@pytest.fixture(scope="module")
def step() -> dict[str, Any]:
    return runpy.run_path(str(BENCH / "train_step.py"))


TINY = {
    "size": "small",
    "docs": 3,
    "min_len": 8,
    "max_len": 24,
    "warmup": 1,
    "iters": 3,
    "threads": 1,
    "seed": 0,
    "clock": "cpu",
}


def _row(family: str, ratio: float, q1: float, **extra: Any) -> dict[str, Any]:
    return {
        "family": family,
        "pairs": 4,
        "hf_tok_s": 1000.0,
        "archon_tok_s": 1000.0 * ratio,
        "ratio": ratio,
        "ratio_min": q1 - 0.1,
        "ratio_q1": q1,
        "ratio_q3": ratio + 0.1,
        "ratio_max": ratio + 0.2,
        "other_clock_ratio": ratio,
        "archon_attention": "VarlenAttentionWrapper",
        "hf_attention": "sdpa",
        "same_loss": True,
        "loss_archon": 9.0,
        "loss_hf": 9.0,
    } | extra


@pytest.mark.parametrize("model_type", ["gpt2", "opt", "xglm"])
def test_bench_config_turns_dropout_off(step: dict[str, Any], model_type: str) -> None:
    """Archon applies no dropout: HF in training mode must not either, or it spends time
    (and randomness) the Archon side does not, and the losses differ."""
    config = step["bench_config"](model_type, "small")
    dropouts = {
        k: v for k, v in config.to_dict().items() if ("dropout" in k or k.endswith("_pdrop")) and isinstance(v, float)
    }
    assert dropouts, f"{model_type}'s config has dropout fields; the test must see them"
    assert all(v == 0.0 for v in dropouts.values()), dropouts


def test_quantile_interpolates(table: dict[str, Any]) -> None:
    q = table["_quantile"]
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert q(values, 0.0) == 1.0 and q(values, 1.0) == 5.0 and q(values, 0.5) == 3.0
    assert q([1.0, 2.0, 3.0, 4.0], 0.25) == pytest.approx(1.75)
    assert q([7.0], 0.75) == 7.0


def test_table_flags_below_and_unsure(table: dict[str, Any]) -> None:
    rows = [
        _row("fast", 2.0, 1.9),
        _row("unsure", 1.6, 1.45),
        _row("slow", 1.45, 1.4),
        {"family": "broken", "error": "RuntimeError: boom"},
    ]
    text = table["format_table"](rows, 1.5)
    lines = {
        line.split()[0]: line for line in text.splitlines() if line and line.split()[0] in {r["family"] for r in rows}
    }
    assert "2.00x" in lines["fast"] and "<" not in lines["fast"] and "?" not in lines["fast"]
    assert "1.60x ?" in lines["unsure"]
    assert "1.45x <" in lines["slow"]
    assert "error: RuntimeError: boom" in lines["broken"]
    summary = text.splitlines()[-1]
    assert "3 families measured, 1 failed" in summary
    assert "below 1.5x: slow;" in summary and "q1 below it: unsure" in summary


def test_merge_later_row_wins_and_workloads_must_agree(table: dict[str, Any], tmp_path: Path) -> None:
    settings = dict(TINY)
    first = tmp_path / "a.json"
    second = tmp_path / "b.json"
    first.write_text(
        json.dumps(
            {
                "settings": settings,
                "load_average": [[1, 1, 1]],
                "cpus": 2,
                "rows": [_row("x", 1.4, 1.3), _row("y", 2.0, 1.9)],
            }
        )
    )
    # More pairs for the re-measured family: the same workload, so it merges.
    second.write_text(
        json.dumps(
            {
                "settings": settings | {"iters": 12},
                "load_average": [[2, 2, 2]],
                "cpus": 2,
                "rows": [_row("x", 1.7, 1.6)],
            }
        )
    )
    merged = table["merge"]([first, second])
    assert [r["family"] for r in merged["rows"]] == ["x", "y"]
    assert merged["rows"][0]["ratio"] == 1.7
    assert merged["settings"]["iters"] == [3, 12]
    # A merged table merges again (the committed table plus a run of newly ported families).
    again = tmp_path / "merged.json"
    again.write_text(json.dumps(merged))
    third = tmp_path / "d.json"
    third.write_text(
        json.dumps({"settings": settings, "load_average": [[3, 3, 3]], "cpus": 2, "rows": [_row("z", 1.9, 1.8)]})
    )
    remerged = table["merge"]([again, third])
    assert [r["family"] for r in remerged["rows"]] == ["x", "y", "z"]
    assert remerged["settings"]["iters"] == [3, 12]
    other = tmp_path / "c.json"
    other.write_text(
        json.dumps({"settings": settings | {"size": "default"}, "load_average": [], "cpus": 2, "rows": []})
    )
    with pytest.raises(SystemExit, match="not merging"):
        table["merge"]([first, other])


@pytest.mark.slow
def test_measure_pairs_one_family(table: dict[str, Any]) -> None:
    """One family, tiny documents: both sides compute the same loss, every pair is timed,
    and the headline ratio is the median pair's."""
    row = table["measure"]("llama", TINY)
    assert row["same_loss"], (row["loss_hf"], row["loss_archon"])
    assert row["pairs"] == 3 and len(row["cpu_s_hf"]) == len(row["cpu_s_archon"]) == 3
    pairs = [h / a for h, a in zip(row["cpu_s_hf"], row["cpu_s_archon"], strict=True)]
    assert row["ratio"] == pytest.approx(statistics.median(pairs))
    assert row["ratio_min"] <= row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"] <= row["ratio_max"]
    assert row["archon_attention"] == "VarlenAttentionWrapper"
