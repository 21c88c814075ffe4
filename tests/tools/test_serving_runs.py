"""tools/bench/serving_runs.py: a kvtier-only run paired with another run's peer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
