"""tools/bench/agent_ab.py: the agent line's A/B runs read, grouped by variant and summarized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools._bench_modules import load_bench


def _run(path: Path, later_ms: list[float], step_ms: float) -> None:
    turns: list[dict[str, object]] = [
        {"conversation": c, "turn": 1, "ttft_ms": 500.0 + c} for c in range(len(later_ms))]
    turns += [{"conversation": c, "turn": 2, "ttft_ms": v, "join_step": {"step_ms": step_ms}}
              for c, v in enumerate(later_ms)]
    doc = {"rounds": [{"kvtier": {"agent": {"turns_list": turns}}}]}
    path.write_text(json.dumps(doc))


def test_runs_group_by_variant_and_a_skipped_run_leaves_the_medians(tmp_path: Path) -> None:
    """Each runI-VAR.json gives its turns 2+ p50; per variant the median and range of the runs,
    a --skip run shown but not counted; files that are no run are ignored."""
    ab = load_bench("agent_ab")
    _run(tmp_path / "run0-off.json", [900.0, 1000.0, 1100.0], 700.0)
    _run(tmp_path / "run1-on.json", [150.0, 170.0, 190.0], 90.0)
    _run(tmp_path / "run2-on.json", [200.0, 210.0, 220.0], 100.0)
    _run(tmp_path / "run3-off.json", [240.0, 250.0, 260.0], 140.0)
    _run(tmp_path / "run4-off.json", [220.0, 230.0, 280.0], 130.0)
    (tmp_path / "notes.json").write_text("{}")
    runs = [ab.load_run(f, i) for i, f in enumerate(ab._files([tmp_path]))]
    assert [(r.variant, r.later_p50, r.later_step_p50) for r in runs] == [
        ("off", 1000.0, 700.0), ("on", 170.0, 90.0), ("on", 210.0, 100.0),
        ("off", 250.0, 140.0), ("off", 230.0, 130.0)]
    summary = ab.summarize(runs, {f"{tmp_path.name}/run0-off"})
    assert summary["off"] == {"median": 240.0, "min": 230.0, "max": 250.0, "runs": 2.0}
    assert summary["on"] == {"median": 190.0, "min": 170.0, "max": 210.0, "runs": 2.0}


def test_a_run_without_agent_turns_is_refused(tmp_path: Path) -> None:
    """A JSON with no agent trace is an error naming the file, not a zero."""
    ab = load_bench("agent_ab")
    path = tmp_path / "run0-on.json"
    path.write_text(json.dumps({"rounds": [{"kvtier": {"agent": None}}]}))
    with pytest.raises(ValueError, match="no agent turns"):
        ab.load_run(path, 0)


def test_runs_past_nine_keep_their_order_and_any_variant_name_is_read(tmp_path: Path) -> None:
    """A folder's runs are read by their number (run10 after run9, not after run1) and a variant
    may have any name; summarize keeps the variants in order of first appearance."""
    ab = load_bench("agent_ab")
    names = ["off", "pair", "fold"] * 4
    for i, name in enumerate(names):
        _run(tmp_path / f"run{i}-{name}.json", [100.0 + i], 50.0)
    runs = [ab.load_run(f, i) for i, f in enumerate(ab._files([tmp_path]))]
    assert [r.name.split("/")[1] for r in runs] == [f"run{i}-{n}" for i, n in enumerate(names)]
    summary = ab.summarize(runs, set())
    assert list(summary) == ["off", "pair", "fold"]
    assert summary["fold"] == {"median": 106.5, "min": 102.0, "max": 111.0, "runs": 4.0}


def test_the_schedule_rotates_the_variants_each_cycle_and_refuses_bad_specs() -> None:
    """Cycle c runs the variants rotated by c (two give off on on off off on), each with its
    KEY=VALUE assignments; a bad name, a repeated name or a bare word as an assignment is refused."""
    ab = load_bench("agent_ab")
    two = ab.schedule("off|on:A=1 B=2", 3)
    assert [(i, v) for i, v, _ in two] == [(0, "off"), (1, "on"), (2, "on"), (3, "off"), (4, "off"), (5, "on")]
    assert {v: a for _, v, a in two} == {"off": [], "on": ["A=1", "B=2"]}
    three = [v for _, v, _ in ab.schedule("a|b:X=1|c:Y=2", 3)]
    assert three == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    for bad in ("off|on:A=1|on:B=2", "off|o-n:A=1", "off|on:A=1 B"):
        with pytest.raises(ValueError):
            ab.schedule(bad, 1)
