"""tools/bench/soak_compare.py: runs grouped by label, each percentile's median over them."""

from __future__ import annotations

from typing import Any

from tests.tools._bench_modules import load_bench


def _summary(greedy: tuple[float, float, float], agent: tuple[float, float, float],
             violations: int = 0) -> dict[str, Any]:
    def spread(values: tuple[float, float, float]) -> dict[str, float | int]:
        return {"n": 5, "p50": values[0], "p90": values[1], "p99": values[2]}

    return {"latency_ms": {"greedy": spread(greedy), "agent_turn": spread(agent)},
            "violations": ["x"] * violations, "serve_args": ["--memory-budget", "1.0"]}


def test_compare_groups_runs_by_label_and_takes_each_percentiles_median() -> None:
    """Three runs of one label give the per-percentile median of the three (not of one run),
    another label stays apart, and violations add up over a label's runs."""
    bench = load_bench("soak_compare")
    variants = {
        "held": [("a", _summary((1, 5, 9), (2, 4, 30))), ("b", _summary((3, 2, 7), (1, 8, 10))),
                 ("c", _summary((2, 9, 8), (3, 6, 20), violations=2))],
        "back": [("d", _summary((1, 1, 1), (1, 1, 1)))],
    }
    result = bench.compare(variants)
    assert result["held"]["greedy"]["median"] == {"p50": 2, "p90": 5, "p99": 8}
    assert result["held"]["agent_turn"]["median"] == {"p50": 2, "p90": 6, "p99": 20}
    assert result["held"]["violations"] == 2
    assert result["held"]["files"] == ["a", "b", "c"]
    assert result["back"]["greedy"]["median"] == {"p50": 1, "p90": 1, "p99": 1}
    assert [r["p99"] for r in result["held"]["agent_turn"]["runs"]] == [30, 10, 20]
