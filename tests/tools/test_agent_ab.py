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
