"""tools/bench/level_ab.py: each variant's runs per level, with the median and the spread, phases included."""

from __future__ import annotations

import json
from pathlib import Path

from tests.tools._bench_modules import load_bench

level_ab = load_bench("level_ab")


def _run(path: Path, tps: float, ttft: float, admission: float) -> Path:
    """A serving.py JSON with one 32-stream concurrent level (and a constant-rate one to skip)."""
    kv = {"output_tps": tps, "ttft_p50": ttft, "ttft_p99": 2 * ttft, "itl_p50": 10.0, "errors": 0.0}
    data = {
        "summary": {"levels": [
            {"profile": "concurrent", "level": 32.0, "kvtier": kv},
            {"profile": "constant", "level": 5.0, "kvtier": kv},
        ]},
        "rounds": [{"kvtier": {"levels": [{"level": 32.0, "phases_ms": {"admission": admission, "lookup": 1.0}}]}}],
    }
    path.write_text(json.dumps(data))
    return path


def test_the_table_keeps_every_run_and_the_median_and_spread_per_variant(tmp_path: Path) -> None:
    """Three runs of A and two of B at 32 streams: the runs in order, their medians and ranges; constant levels left out."""
    a = [_run(tmp_path / f"a{i}.json", t, 100 + i, adm) for i, (t, adm) in enumerate([(10, 30), (60, 20), (20, 40)])]
    b = [_run(tmp_path / f"b{i}.json", t, 90, adm) for i, (t, adm) in enumerate([(40, 10), (50, 12)])]
    result = level_ab.table({"A": a, "B": b})
    assert set(result["A"]) == {32.0}
    tps = result["A"][32.0]["output_tps"]
    assert tps["runs"] == [10, 60, 20]
    assert (tps["median"], tps["min"], tps["max"]) == (20, 10, 60)
    assert result["A"][32.0]["admission"]["median"] == 30
    assert result["B"][32.0]["output_tps"]["median"] == 45
    assert result["B"][32.0]["ttft_p99"]["runs"] == [180, 180]
