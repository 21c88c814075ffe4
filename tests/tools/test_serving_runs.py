"""tools/bench/serving_runs.py: a kvtier-only run paired with another run's peer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tools._bench_modules import load_bench


def _level(profile: str, level: float, **servers: dict[str, float]) -> dict[str, Any]:
    return {"profile": profile, "level": level, **servers}


def test_a_kvtier_only_run_takes_the_peers_figures_of_its_pair(tmp_path: Path) -> None:
    """KVTIER+PEER: every level and the agent trace get the peer file's mlx_lm figures beside the
    kvtier-only file's own; the files themselves are left as they were; a plain path loads as is."""
    runs = load_bench("serving_runs")
    peer = {"summary": {"levels": [
        _level("concurrent", 8.0, mlx_lm={"output_tps": 100.0}, kvtier={"output_tps": 120.0}),
        _level("constant", 2.5, mlx_lm={"output_tps": 50.0}, kvtier={"output_tps": 55.0})]},
        "rounds": [{"mlx_lm": {"agent": {"turns_list": [{"turn": 2, "ttft_ms": 700.0}]}},
                    "kvtier": {"agent": {"turns_list": [{"turn": 2, "ttft_ms": 300.0}]}}}]}
    alone = {"summary": {"levels": [
        _level("concurrent", 8.0, kvtier={"output_tps": 150.0}),
        _level("constant", 2.5, kvtier={"output_tps": 60.0})]},
        "rounds": [{"kvtier": {"agent": {"turns_list": [{"turn": 2, "ttft_ms": 200.0}]}}}]}
    (tmp_path / "full.json").write_text(json.dumps(peer))
    (tmp_path / "alone.json").write_text(json.dumps(alone))
    merged = runs.load_run(f"{tmp_path / 'alone.json'}+{tmp_path / 'full.json'}")
    levels = runs._levels(merged)
    assert levels["concurrent 8"]["mlx_lm"] == {"output_tps": 100.0}
    assert levels["concurrent 8"]["kvtier"] == {"output_tps": 150.0}
    assert levels["constant #0"]["mlx_lm"] == {"output_tps": 50.0}
    assert runs._agent(merged) == {"kvtier": 200.0, "mlx_lm": 700.0}
    assert "mlx_lm" not in json.loads((tmp_path / "alone.json").read_text())["summary"]["levels"][0]
    assert runs.load_run(str(tmp_path / "full.json")) == peer


def test_a_run_cut_short_keeps_the_levels_the_others_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose JSON is incomplete (no constant rate) is named as cut short; the constant rate's
    line is still printed from the run that has it, with no figure for the one that does not."""
    runs = load_bench("serving_runs")
    figures = {"output_tps": 100.0, "ttft_p50": 50.0, "ttft_p99": 90.0, "itl_p50": 10.0}
    double = {k: 2 * v for k, v in figures.items()}
    whole = {"summary": {"levels": [_level("concurrent", 8.0, mlx_lm=figures, kvtier=double),
                                    _level("constant", 2.5, mlx_lm=figures, kvtier=double)]}}
    cut = {"complete": False,
           "summary": {"levels": [_level("concurrent", 8.0, mlx_lm=figures, kvtier=figures)]}}
    (tmp_path / "whole.json").write_text(json.dumps(whole))
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    monkeypatch.setattr(sys, "argv", ["serving_runs.py", str(tmp_path / "whole.json"),
                                      str(tmp_path / "cut.json"), "--label", "a", "--label", "b"])
    runs.main()
    out = capsys.readouterr().out
    assert "b: cut short" in out
    assert "a: cut short" not in out
    constant = [ln for ln in out.splitlines() if "constant #0" in ln]
    assert len(constant) == len(runs.MEASURES)
    assert all("n/a" in ln and "2.00 [2.00..2.00]" in ln for ln in constant)


def test_each_runs_host_probe_is_printed_per_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose servers recorded ``host_loop_s`` gets them printed under its label, per server; a
    run without them (older JSON) is left out of that line."""
    runs = load_bench("serving_runs")
    figures = {"output_tps": 100.0, "ttft_p50": 50.0, "ttft_p99": 90.0, "itl_p50": 10.0}
    levels = {"levels": [_level("concurrent", 1.0, mlx_lm=figures, kvtier=figures)]}
    probed = {"summary": levels, "rounds": [{"mlx_lm": {"host_loop_s": [0.14, 0.15]},
                                             "kvtier": {"host_loop_s": [0.15, 0.23]}}]}
    (tmp_path / "probed.json").write_text(json.dumps(probed))
    (tmp_path / "old.json").write_text(json.dumps({"summary": levels, "rounds": [{"kvtier": {}}]}))
    monkeypatch.setattr(sys, "argv", ["serving_runs.py", str(tmp_path / "probed.json"),
                                      str(tmp_path / "old.json"), "--label", "p", "--label", "o"])
    runs.main()
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("host loop"))
    assert line.endswith(": p kvtier 0.150/0.230, mlx_lm 0.140/0.150")


def test_each_runs_page_cache_is_printed_per_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose servers recorded ``host_state`` gets their page cache (GiB, before / after)
    printed under its label; a run without it (older JSON) is left out of that line."""
    runs = load_bench("serving_runs")
    figures = {"output_tps": 100.0, "ttft_p50": 50.0, "ttft_p99": 90.0, "itl_p50": 10.0}
    levels = {"levels": [_level("concurrent", 1.0, mlx_lm=figures, kvtier=figures)]}
    gib = 1 << 30
    state = [{"meminfo": {"Cached": 2 * gib}}, {"meminfo": {"Cached": 9 * gib // 2}}]
    recorded = {"summary": levels, "rounds": [{"kvtier": {"host_state": state}}]}
    (tmp_path / "new.json").write_text(json.dumps(recorded))
    (tmp_path / "old.json").write_text(json.dumps({"summary": levels, "rounds": [{"kvtier": {}}]}))
    monkeypatch.setattr(sys, "argv", ["serving_runs.py", str(tmp_path / "old.json"),
                                      str(tmp_path / "new.json"), "--label", "o", "--label", "n"])
    runs.main()
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("page cache"))
    assert line.endswith(": n kvtier 2.0/4.5")
