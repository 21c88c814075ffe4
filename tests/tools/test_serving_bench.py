"""tools/bench/serving.py: its figures from guidellm's records, its ratios, and a tiny run end to end."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tools._bench_modules import BENCH, REPO, load_bench

serving = load_bench("serving")


def _record(start: float, end: float, ttft_ms: float, itl_ms: float, out: int) -> dict[str, Any]:
    """One successful request as guidellm 0.8 writes it (the fields serving.py reads)."""
    return {
        "request_start_time": start,
        "request_end_time": end,
        "request_latency": end - start,
        "time_to_first_token_ms": ttft_ms,
        "inter_token_latency_ms": itl_ms,
        "prompt_tokens": 100,
        "output_tokens": out,
    }


def _report(streams: int, records: list[dict[str, Any]], errored: int = 0) -> dict[str, Any]:
    return {
        "benchmarks": [
            {
                "config": {"strategy": {"type_": "concurrent", "streams": streams}},
                "duration": 999.0,
                "requests": {
                    "successful": records,
                    "errored": [{}] * errored,
                    "incomplete": [],
                },
            }
        ]
    }


def test_help_does_not_import_mlx() -> None:
    """Parsing the command line (what --help does) imports neither MLX nor kvtier's packages."""
    code = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import serving; "
        "serving.parse_args(['--tiny']); "
        "print(sorted(m for m in ('mlx', 'kernels', 'actors', 'matplotlib') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_timeline_line_gives_its_decode_time_per_token_after_the_first() -> None:
    """``decode_per_token`` is the line's ``decode_ms`` over its tokens after the first; a one-token line has none."""
    phases = {"admission": 1.0, "first_step": 50.0}
    row = serving._timeline_row({"phases_ms": phases, "decode_ms": 1048.0, "tokens": 128})
    assert row == {"admission": 1.0, "first_step": 50.0, "decode_per_token": 1048.0 / 127}
    assert serving._timeline_row({"phases_ms": phases, "decode_ms": 0.0, "tokens": 1}) == phases
    assert serving._timeline_row({"decode_ms": 10.0, "tokens": 4}) is None


def test_turn_phases_come_from_the_timeline_lines_of_either_log_format(tmp_path: Path) -> None:
    """Each agent turn gets the phases of the ``request.timeline`` line naming its request id (its
    admission's parts too, where the line has them) and the figures of the ``batch.join_step``
    line that joined it."""
    console = tmp_path / "kvtier.stderr"
    console.write_text(
        "2026-12-03 [info ] request.served request_id=chatcmpl-a\n"
        "2026-12-03 [info ] request.timeline request_id=chatcmpl-a looked_up=True "
        "phases_ms={'admission': 1.5, 'join': 20.0, 'first_step': 90.25}\n"
        "2026-12-03 [info ] batch.join_step actor=batch cached=[5162] decode_rows=7 "
        "join_ms=0.844 joined=['chatcmpl-a'] prefill_tokens=23 since_clear=1 step_ms=177.38 turn=5\n"
    )
    jsonl = tmp_path / "kvtier.stdout"
    jsonl.write_text(
        json.dumps({"event": "request.timeline", "request_id": "chatcmpl-b",
                    "phases_ms": {"admission": 2.0, "join": 5.0, "first_step": 30.0},
                    "admission_parts_ms": {"parse": 0.5, "render_wait": 0.25, "render": 1.0,
                                           "admit": 0.25}}) + "\n"
        + json.dumps({"event": "batch.join_step", "joined": ["chatcmpl-b", "chatcmpl-c"],
                      "prefill_tokens": 48, "decode_rows": 0, "join_ms": 1.5, "step_ms": 90.0}) + "\n"
    )
    agent = serving.AgentResult(1, 3, 10, [
        serving.AgentTurn(0, 1, 100.0, 10, 0, "chatcmpl-a"),
        serving.AgentTurn(0, 2, 40.0, 12, 9, "chatcmpl-b"),
        serving.AgentTurn(0, 3, 40.0, 14, 11, "chatcmpl-c"),
    ])
    serving.attach_phases(agent, [console, jsonl, tmp_path / "absent.log"])
    assert [t.phases_ms for t in agent.turns_list] == [
        {"admission": 1.5, "join": 20.0, "first_step": 90.25},
        {"admission": 2.0, "join": 5.0, "first_step": 30.0, "admission.parse": 0.5,
         "admission.render_wait": 0.25, "admission.render": 1.0, "admission.admit": 0.25},
        None,
    ]
    both = {"step_ms": 90.0, "join_ms": 1.5, "prefill_tokens": 48.0, "decode_rows": 0.0, "rows": 2.0}
    assert [t.join_step for t in agent.turns_list] == [
        {"step_ms": 177.38, "join_ms": 0.844, "prefill_tokens": 23.0, "decode_rows": 7.0,
         "since_clear": 1.0, "rows": 1.0},
        both,
        both,
    ]


def test_level_figures_come_from_the_request_records() -> None:
    """Throughput is output tokens over first start to last end; TTFT/ITL are nearest-rank percentiles."""
    records = [
        _record(10.0, 12.0, ttft_ms=100.0, itl_ms=10.0, out=64),
        _record(10.5, 14.0, ttft_ms=300.0, itl_ms=30.0, out=64),
        _record(11.0, 13.0, ttft_ms=200.0, itl_ms=20.0, out=32),
    ]
    (lv,) = serving.level_results(_report(4, records, errored=1))
    assert (lv.profile, lv.level, lv.ok, lv.errored) == ("concurrent", 4.0, 3, 1)
    assert lv.seconds == pytest.approx(4.0)  # 10.0 -> 14.0, not guidellm's duration
    assert lv.output_tps == pytest.approx(160 / 4.0)
    assert lv.requests_per_s == pytest.approx(3 / 4.0)
    assert (lv.ttft_ms.p50, lv.ttft_ms.p99, lv.ttft_ms.max) == (200.0, 300.0, 300.0)
    assert lv.itl_ms.p50 == 20.0
    assert lv.latency_ms.p50 == pytest.approx(2000.0)


def test_saturation_is_the_best_concurrency_level_and_ratios_are_kvtier_over_peer() -> None:
    """The constant rate's base is the peer's best req/s; every ratio is kvtier / mlx_lm per level."""
    peer = serving.level_results(_report(1, [_record(0.0, 2.0, 100.0, 10.0, 10)]))
    peer += serving.level_results(
        _report(4, [_record(0.0, 1.0, 400.0, 10.0, 10), _record(0.0, 1.0, 400.0, 10.0, 10)])
    )
    assert serving.saturation_rps(peer) == pytest.approx(2.0)
    ours = serving.level_results(_report(1, [_record(0.0, 1.0, 50.0, 10.0, 10)]))
    ours += serving.level_results(
        _report(4, [_record(0.0, 0.5, 100.0, 10.0, 10), _record(0.0, 0.5, 100.0, 10.0, 10)])
    )
    rnd = {
        "mlx_lm": serving.ServerRun("mlx_lm", 1.0, levels=peer),
        "kvtier": serving.ServerRun("kvtier", 1.0, levels=ours),
    }
    summary = serving.summarize([rnd])
    by_level = {row["level"]: row for row in summary["levels"]}
    assert by_level[1.0]["ratio"]["output_tps"]["median"] == pytest.approx(10.0 / 5.0)
    assert by_level[4.0]["ratio"]["output_tps"]["median"] == pytest.approx(40.0 / 20.0)
    assert by_level[4.0]["ratio"]["ttft_p50"]["median"] == pytest.approx(100.0 / 400.0)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.model
def test_agent_trace_end_to_end_against_kvtier(default_model_path: Path, tmp_path: Path) -> None:
    """A tiny run (kvtier only, agent trace 2x2, no load generator) writes JSON and a PNG; later turns hit the prompt cache."""
    out = tmp_path / "serving.json"
    png = tmp_path / "serving.png"
    env = dict(os.environ)
    env.setdefault("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "serving.py"),
            "--tiny",
            "--servers",
            "kvtier",
            "--skip-loadgen",
            "--model",
            str(default_model_path),
            "--out",
            str(tmp_path / "work"),
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    agent = data["rounds"][0]["kvtier"]["agent"]
    turns = agent["turns_list"]
    assert sorted((t["conversation"], t["turn"]) for t in turns) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(t["ttft_ms"] > 0 for t in turns)
    # NOTE: turn 2 carries turn 1's prompt and answer (at least ~10 more
    # tokens), and the RAM tier serves at least the ~200-token system prompt.
    first = {t["conversation"]: t["prompt_tokens"] for t in turns if t["turn"] == 1}
    for t in turns:
        if t["turn"] == 2:
            assert t["prompt_tokens"] > first[t["conversation"]] + 8
            assert t["cached_tokens"] >= 150
    assert data["summary"]["agent"]["kvtier"]["ttft_p50_turns2plus_ms"] > 0
    assert data["meta"]["commit"]
    assert data["meta"]["mlx"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.e2e
@pytest.mark.model
@pytest.mark.skipif(
    not Path(os.environ.get("KVTIER_GUIDELLM_PYTHON", serving.DEFAULT_GUIDELLM_PYTHON)).exists(),
    reason="no guidellm environment (pip install -e .[bench] into its own venv, see serving.py)",
)
def test_tiny_run_through_guidellm_both_servers(default_model_path: Path, tmp_path: Path) -> None:
    """``--tiny`` drives both servers through guidellm: every request succeeds, the ratios exist."""
    out = tmp_path / "serving.json"
    env = dict(os.environ)
    env.setdefault("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "serving.py"),
            "--tiny",
            "--agent",
            "",
            "--model",
            str(default_model_path),
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    for who in ("mlx_lm", "kvtier"):
        levels = data["rounds"][0][who]["levels"]
        assert [lv["level"] for lv in levels] == [1.0, 2.0]
        assert all(lv["ok"] == 2 and lv["errored"] == 0 for lv in levels)
        assert all(lv["output_tokens"] > 0 for lv in levels)
    assert all("ratio" in row for row in data["summary"]["levels"])


def test_slow_background_turns_are_summed_by_callable_from_either_log_format(tmp_path: Path) -> None:
    """engine.background_step_slow lines (console and JSON) are grouped by the callable's short
    name with their count, median, max and total milliseconds; other lines are ignored."""
    console = tmp_path / "kvtier.stderr"
    console.write_text(
        "2026-12-03 [info ] engine.background_step_slow actor=gateway.runner "
        "fn=EngineTensorSource.plan.<locals>.plan_step ms=16.6 step_id=s-1\n"
        "2026-12-03 [info ] engine.background_step_slow actor=gateway.runner "
        "fn=EngineTensorSource.plan.<locals>.plan_step ms=10.4 step_id=s-3\n"
        "2026-12-03 [info ] batch.join_step actor=batch joined=['x'] step_ms=9.0\n"
    )
    as_json = tmp_path / "kvtier.stdout"
    as_json.write_text(json.dumps({"event": "engine.background_step_slow",
                                   "fn": "EngineTensorSource.finish.<locals>.step", "ms": 24.0}) + "\n")
    slow = serving.slow_background_turns([console, as_json])
    assert slow == {
        "finish": {"count": 1.0, "median_ms": 24.0, "max_ms": 24.0, "total_ms": 24.0},
        "plan": {"count": 2.0, "median_ms": 13.5, "max_ms": 16.6, "total_ms": 27.0},
    }


def test_the_ssd_tier_line_reads_the_last_phase_that_has_the_tier() -> None:
    """ssd_tier_line gives the cap and what the tier held, wrote, evicted and dropped from the last
    phase's /stats that has an ssd_cache section; no such section gives None (the tier was off)."""
    first = {"ssd_cache": {"max_bytes": 3_749_184_512, "bytes": 1e9, "entries": 5, "writebehind_written": 9,
                           "evicted": 1, "dropped_spills": 0, "writebehind_evicted_unwritten": 0}}
    last = {"ssd_cache": {"max_bytes": 3_749_184_512, "bytes": 3_612_471_296, "entries": 41,
                          "writebehind_written": 108, "evicted": 95, "dropped_spills": 169,
                          "writebehind_evicted_unwritten": 0}}
    line = serving.ssd_tier_line({"loads": first, "agent": last, "background_slow": {"plan": {}}})
    assert line == ("cap 3.7 GB, holds 3.6 GB in 41 entries; written 108, evicted 95, "
                    "dropped spills 169, evicted unwritten 0")
    assert serving.ssd_tier_line({"loads": {"prompt_cache": {}}, "cache_clears": {}}) is None


def test_cache_clears_are_counted_from_their_log_lines(tmp_path: Path) -> None:
    """The batch lane's ``batch.cache_cleared`` lines give a count, median and max ms, the median GB
    freed and the median step they ended; none gives an empty summary."""
    log = tmp_path / "kvtier.stderr"
    log.write_text(
        "2026-12-06 [info ] batch.cache_cleared actor=batch clear_ms=12.5 freed_bytes=2000000000 step_ms=40.0 turn=3\n"
        "2026-12-06 [info ] batch.join_step actor=batch joined=['x'] step_ms=9.0\n"
        + json.dumps({"event": "batch.cache_cleared", "clear_ms": 30.5, "freed_bytes": 4000000000,
                      "step_ms": 60.0}) + "\n"
        "2026-12-06 [info ] batch.cache_cleared actor=batch clear_ms=7.0 freed_bytes=0 step_ms=20.0 turn=9\n"
    )
    assert serving.cache_clears([log]) == {"count": 3.0, "median_ms": 12.5, "max_ms": 30.5,
                                           "median_freed_gb": 2.0, "median_step_ms": 40.0}
    empty = tmp_path / "none.stderr"
    empty.write_text("2026-12-06 [info ] batch.join_step actor=batch joined=['x'] step_ms=9.0\n")
    assert serving.cache_clears([empty]) == {}


class _Proc:
    """A server process as ``subprocess.Popen`` reports it: running (None) or its exit status."""

    def __init__(self, status: int | None) -> None:
        self.status = status

    def poll(self) -> int | None:
        return self.status


class _FakeServer:
    """What ``run_server`` uses of ``_common.Server``: a URL, its logs, its process, ``stop``."""

    def __init__(self, tmp_path: Path, status: int | None) -> None:
        self.url = "http://127.0.0.1:9"
        self.ready_s = 1.0
        self.stdout = tmp_path / "mlx_lm.stdout"
        self.stderr = tmp_path / "mlx_lm.stderr"
        self.stdout.write_text("")
        self.stderr.write_text(
            "INFO - Prompt processing progress: 515/515\n"
            "ERROR - mlx_lm.server generation thread died: cudaMallocAsync failed: out of memory\n"
            "double free or corruption (fasttop)\n"
        )
        self.proc = _Proc(status)
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def _agent_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int | None) -> Any:
    server = _FakeServer(tmp_path, status)
    monkeypatch.setattr(serving, "start_server", lambda *a, **k: server)
    monkeypatch.setattr(importlib.import_module("_common"), "stream_chat", lambda *a, **k: None)

    def refused(*a: Any, **k: Any) -> Any:
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(serving, "agent_trace", refused)
    args = serving.parse_args(["--servers", "mlx_lm", "--skip-loadgen", "--no-warmup", "--agent", "2x2"])
    try:
        return serving.run_server("mlx_lm", tmp_path, 9, tmp_path, args, 3, [])
    finally:
        assert server.stopped


def test_a_server_that_died_mid_run_ends_its_own_run_not_the_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose process exited when the agent trace met a closed port: its run is kept with
    how it died (the phase, the status, the last error line), summarized and printed."""
    run = _agent_run(tmp_path, monkeypatch, -6)
    assert run.agent is None
    assert run.died is not None
    assert run.died.startswith("round 3: exited with status -6 during the agent trace")
    assert "out of memory" in run.died
    summary = serving.summarize([{"mlx_lm": run}])
    assert summary["died"] == [f"mlx_lm {run.died}"]
    assert f"DIED mlx_lm {run.died}" in serving.summary_lines(summary)


def test_a_run_records_the_host_probe_before_its_server_and_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``host_loop`` runs once before the server starts and once after it stopped (a run that died
    included); both land in the run and its JSON, in that order."""
    probes = iter([0.25, 0.4])
    monkeypatch.setattr(importlib.import_module("_common"), "host_loop", lambda: next(probes))
    run = _agent_run(tmp_path, monkeypatch, -6)
    assert run.host_loop_s == [0.25, 0.4]
    out = tmp_path / "run.json"
    args = serving.parse_args(["--servers", "mlx_lm", "--skip-loadgen"])
    serving.write_json(out, {"commit": "test"}, args, [], [{"mlx_lm": run}], complete=True)
    assert json.loads(out.read_text())["rounds"][0]["mlx_lm"]["host_loop_s"] == [0.25, 0.4]


def test_the_host_probe_times_its_loop() -> None:
    """``host_loop`` grows with its loop: ten times the additions take longer (best of three each)."""
    common = importlib.import_module("_common")
    assert common.host_loop(2_000_000) > common.host_loop(200_000) > 0


def test_a_failure_with_the_server_still_up_is_the_benchmarks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same failure while the server's process still runs propagates: only a dead server is
    recorded and passed over."""
    with pytest.raises(ConnectionRefusedError):
        _agent_run(tmp_path, monkeypatch, None)


def test_every_finished_phase_is_in_the_json_before_a_later_phase_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JSON is written after each phase: a run cut short later (a device call's time limit, here
    the agent trace failing) still leaves the levels it finished, marked incomplete."""
    server = _FakeServer(tmp_path, None)
    monkeypatch.setattr(serving, "start_server", lambda *a, **k: server)
    monkeypatch.setattr(importlib.import_module("_common"), "stream_chat", lambda *a, **k: None)
    records = [_record(10.0, 12.0, 100.0, 10.0, 64), _record(10.5, 14.0, 300.0, 30.0, 64)]
    monkeypatch.setattr(serving, "run_guidellm", lambda *a, **k: _report(4, records))

    def cut(*a: Any, **k: Any) -> Any:
        raise TimeoutError("the call's time ran out")

    monkeypatch.setattr(serving, "agent_trace", cut)
    args = serving.parse_args(["--servers", "mlx_lm", "--no-warmup", "--concurrency", "4",
                               "--rate-fractions", "", "--agent", "2x2"])
    out = tmp_path / "run.json"
    meta = {"commit": "test"}

    def progress(run: Any) -> None:
        serving.write_json(out, meta, args, [], [{"mlx_lm": run}], complete=False)

    with pytest.raises(TimeoutError):
        serving.run_server("mlx_lm", tmp_path, 9, tmp_path, args, 0, [], progress)
    doc = json.loads(out.read_text())
    assert doc["complete"] is False
    (level,) = doc["rounds"][0]["mlx_lm"]["levels"]
    assert (level["profile"], level["level"], level["ok"]) == ("concurrent", 4.0, 2)
    assert doc["summary"]["levels"][0]["mlx_lm"]["output_tps"] == pytest.approx(128 / 4.0)
    assert not list(tmp_path.glob("*.tmp"))


def test_each_level_gets_the_timeline_phases_of_the_requests_in_its_window(tmp_path: Path) -> None:
    """A timeline line belongs to the level whose window (first request sent to last ended, plus a
    second's slack) holds its timestamp, console or JSON format; a warm-up line before both and a
    line between them belong to none; each level keeps the medians of its lines' phases and parts,
    and its join steps' count, medians and share of its window."""
    import datetime

    def iso(epoch: float) -> str:
        return datetime.datetime.fromtimestamp(epoch, datetime.UTC).isoformat().replace("+00:00", "Z")

    base = 1_800_000_000.0
    report = _report(1, [_record(base + 10, base + 12, 100.0, 10.0, 8)])
    report["benchmarks"].append(_report(8, [_record(base + 20, base + 25, 300.0, 30.0, 8)],
                                        errored=0)["benchmarks"][0])
    low, high = serving.level_results(report)
    assert (low.first_start, low.last_end) == (base + 10, base + 12)
    console = tmp_path / "kvtier.stderr"
    console.write_text(
        f"{iso(base + 5)} [info ] request.timeline request_id=warm phases_ms={{'admission': 99.0}}\n"
        f"{iso(base + 11)} [info ] request.timeline request_id=a "
        "phases_ms={'admission': 2.0, 'join': 4.0} "
        "admission_parts_ms={'parse': 0.5, 'render_wait': 0.5, 'render': 0.5, 'admit': 0.5}\n"
        f"{iso(base + 12.5)} [info ] request.timeline request_id=b phases_ms={{'admission': 4.0, 'join': 8.0}}\n"
        f"{iso(base + 17)} [info ] request.timeline request_id=between phases_ms={{'admission': 77.0}}\n"
        f"{iso(base + 10.5)} [info ] batch.join_step turn=1 joined=['a'] cached=[0] prefill_tokens=500 "
        "decode_rows=0 join_ms=1.0 step_ms=100.0 since_clear=1\n"
        f"{iso(base + 11.5)} [info ] batch.join_step turn=1 joined=['b', 'x', 'y'] cached=[0, 0, 0] "
        "prefill_tokens=1500 decode_rows=1 join_ms=1.0 step_ms=300.0 since_clear=2\n"
        f"{iso(base + 17)} [info ] batch.join_step turn=1 joined=['between'] cached=[0] prefill_tokens=9 "
        "decode_rows=0 join_ms=1.0 step_ms=999.0 since_clear=3\n"
    )
    jsonl = tmp_path / "kvtier.stdout"
    jsonl.write_text(json.dumps({"event": "request.timeline", "request_id": "c", "timestamp": iso(base + 24),
                                 "phases_ms": {"admission": 6.0, "join": 1.0}}) + "\n")
    serving.level_phases([low, high], [console, jsonl])
    assert low.timed == 2
    assert low.phases_ms == {"admission": 3.0, "join": 6.0, "admission.parse": 0.5,
                             "admission.render_wait": 0.5, "admission.render": 0.5,
                             "admission.admit": 0.5}
    assert high.timed == 1
    assert high.phases_ms == {"admission": 6.0, "join": 1.0}
    assert low.join_steps == {"count": 2.0, "step_ms_p50": 200.0, "step_ms_max": 300.0,
                              "prefill_tokens_p50": 1000.0, "rows_p50": 2.0, "share": pytest.approx(0.2)}
    assert high.join_steps == {}


def test_a_request_the_load_generator_sent_but_did_not_record_is_counted() -> None:
    """guidellm's scheduler counts beside its request lists: a level whose lists hold fewer
    requests than it created reports the difference; a report without the counts reports none."""
    report = _report(4, [_record(0.0, 1.0, 10.0, 1.0, 4)] * 3)
    report["benchmarks"][0]["scheduler_state"] = {
        "created_requests": 4, "processed_requests": 4, "successful_requests": 4,
        "errored_requests": 0, "cancelled_requests": 0}
    (lv,) = serving.level_results(report)
    assert lv.scheduler == {"created": 4, "processed": 4, "successful": 4, "errored": 0, "cancelled": 0}
    assert serving.unrecorded_requests(lv) == 1
    (plain,) = serving.level_results(_report(4, [_record(0.0, 1.0, 10.0, 1.0, 4)] * 3))
    assert plain.scheduler == {}
    assert serving.unrecorded_requests(plain) == 0


def test_the_start_up_warm_up_line_is_read_from_either_log_format(tmp_path: Path) -> None:
    """kvtier's engine.warm_up line gives its figures (console or JSON format); none gives {}."""
    console = tmp_path / "kvtier.stderr"
    console.write_text("2026-12-06T14:48:00.000000Z [info     ] engine.warm_up                 rows=4 "
                       "seconds=21.5 skipped=None steps=18 warm_rows=2\n")
    assert serving.warm_up_pass([console]) == {"steps": 18, "rows": 4, "warm_rows": 2, "seconds": 21.5,
                                               "skipped": None}
    jsonl = tmp_path / "kvtier.stdout"
    jsonl.write_text(json.dumps({"event": "engine.warm_up", "steps": 3, "rows": 0, "warm_rows": 0,
                                 "seconds": 0.1, "skipped": "recurrent_disabled"}) + "\n")
    assert serving.warm_up_pass([jsonl])["skipped"] == "recurrent_disabled"
    assert serving.warm_up_pass([tmp_path / "missing.log"]) == {}


def test_a_tree_named_on_pythonpath_is_the_code_kvtier_runs(tmp_path: Path) -> None:
    """With PYTHONPATH naming an earlier tree, kvtier's child runs outside this checkout and imports that tree; without, this checkout."""
    tree = tmp_path / "base"
    (tree / "actors").mkdir(parents=True)
    (tree / "actors" / "__init__.py").write_text("")
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {"PYTHONPATH": str(tree)}
    cwd = serving.server_cwd("kvtier", env, workdir)
    assert cwd == workdir
    assert serving.code_dir(env, cwd) == str(tree)
    # NOTE: the trap the working directory avoids: from this checkout, `-m` / `-c`
    # put it first on sys.path and its own actors package wins over PYTHONPATH.
    assert serving.code_dir(env, REPO) == str(REPO)
    assert serving.server_cwd("kvtier", None, workdir) == REPO
    assert serving.server_cwd("mlx_lm", env, workdir) == REPO


def test_a_run_records_the_host_state_before_its_server_and_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``host_state`` is read once before the server starts and once after it stopped (a run that
    died included); both land in the run and its JSON, in that order, and are printed."""
    states = iter([{"meminfo": {"Cached": 1 << 30}, "disk_free": 5 << 30, "gpu": {}},
                   {"meminfo": {"Cached": 3 << 30}, "disk_free": 2 << 30, "gpu": {}}])
    monkeypatch.setattr(importlib.import_module("_common"), "host_state", lambda workdir: next(states))
    run = _agent_run(tmp_path, monkeypatch, -6)
    assert [s["meminfo"]["Cached"] for s in run.host_state] == [1 << 30, 3 << 30]
    out = tmp_path / "run.json"
    args = serving.parse_args(["--servers", "mlx_lm", "--skip-loadgen"])
    serving.write_json(out, {"commit": "test"}, args, [], [{"mlx_lm": run}], complete=True)
    saved = json.loads(out.read_text())["rounds"][0]["mlx_lm"]["host_state"]
    assert [s["disk_free"] for s in saved] == [5 << 30, 2 << 30]


def test_meminfo_keeps_its_fields_in_bytes(tmp_path: Path) -> None:
    """``meminfo`` reads the kept ``/proc/meminfo`` lines in bytes (kB lines times 1024) and skips the rest."""
    common = importlib.import_module("_common")
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       131072 kB\nMemFree:         2048 kB\nCached:        4096 kB\n"
                    "Dirty:             12 kB\nHugePages_Total:       0\n")
    assert common.meminfo(str(path)) == {"MemFree": 2048 * 1024, "Cached": 4096 * 1024, "Dirty": 12 * 1024}
    assert common.meminfo(str(tmp_path / "absent")) == {}


def test_gpu_state_reads_nvidia_smi_and_is_empty_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gpu_state`` runs ``nvidia-smi`` from PATH and names its CSV fields; the throttle reasons
    come from a query of their own, under the older name where the newer one is refused; with no
    ``nvidia-smi`` on PATH it is ``{}``."""
    common = importlib.import_module("_common")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert common.gpu_state() == {}
    fake = tmp_path / "nvidia-smi"
    # NOTE: an older driver's nvidia-smi: it refuses the newer field name (exit 2).
    fake.write_text("#!/bin/sh\ncase \"$1\" in\n"
                    "  *clocks_event_reasons*) echo 'Field is not a valid field' >&2; exit 2;;\n"
                    "  *clocks_throttle_reasons*) echo '0x0000000000000004';;\n"
                    "  *) echo '1980 MHz, 2619 MHz, 41, 118.52 W';;\nesac\n")
    fake.chmod(0o755)
    state = common.gpu_state()
    assert state["clocks.sm"] == "1980 MHz"
    assert state["power.draw"] == "118.52 W"
    assert state["throttle_reasons"] == "0x0000000000000004"
    line = common.host_state_line({"meminfo": {"Cached": 3 << 30, "Dirty": 5 << 20}, "disk_free": 7 << 30,
                                   "gpu": state})
    assert line == "cached 3.0 GiB, dirty 5 MiB, disk free 7.0 GiB, gpu sm 1980 MHz, throttle 0x0000000000000004"


@pytest.mark.parametrize(("env", "flag"), [([], True), (["--kvtier-env", "KVTIER_SSD_CACHE=off"], False)],
                         ids=["default", "tier-named-by-env"])
def test_kvtier_gets_a_fresh_ssd_tier_unless_its_environment_names_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: list[str], flag: bool
) -> None:
    """``start_server`` gives kvtier ``--ssd-cache`` in a directory of this start, except where
    ``--kvtier-env KVTIER_SSD_CACHE=...`` names the tier (a flag would override it)."""
    started: list[tuple[list[str], dict[str, str] | None]] = []

    class Started:
        def __init__(self, cmd: list[str], workdir: Path, name: str, env: dict[str, str] | None = None,
                     cwd: Path | None = None) -> None:
            started.append((cmd, env))

        def wait_ready(self, url: str, timeout: float) -> None:
            """Ready at once."""

    monkeypatch.setattr(importlib.import_module("_common"), "Server", Started)
    args = serving.parse_args(["--servers", "kvtier", *env])
    serving.start_server("kvtier", tmp_path / "model", 9, tmp_path, args, "r0")
    cmd, given = started[0]
    assert ("--ssd-cache" in cmd) is flag
    if flag:
        assert cmd[cmd.index("--ssd-cache") + 1] == str(tmp_path / "kv-r0")
    else:
        assert given == {"KVTIER_SSD_CACHE": "off"}
