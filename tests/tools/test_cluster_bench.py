"""The cluster benchmark's placement model (``--simulate``): what round-robin's misses cost in
prefill; failed answers are counted, never figures; the open loop's arrival schedule and the
concurrency it measured."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tools.bench import cluster
from tools.bench.cluster import prefill_work


def _args() -> argparse.Namespace:
    return argparse.Namespace(model=None, system_tokens=64, turn_tokens=32, conversations=4,
                              concurrency=2)


def test_round_robin_prefills_more_only_when_turns_can_leave_their_replica() -> None:
    """With one replica, or one turn per conversation, both placements prefill the same tokens;
    with two replicas and three turns round-robin prefills more (a turn away from its
    conversation's replica recomputes the history), and never less than affinity."""
    args = _args()
    one_replica = prefill_work(args, turns=3, replicas=1)
    assert one_replica["affinity"] == one_replica["round_robin"]
    one_turn = prefill_work(args, turns=1, replicas=2)
    assert one_turn["affinity"] == one_turn["round_robin"]
    three = prefill_work(args, turns=3, replicas=2)
    assert three["round_robin"] > three["affinity"]
    assert three["ratio"] == three["round_robin"] / three["affinity"]
    # affinity computes each conversation's new part once plus the system prompt once per replica
    assert three["affinity"] < three["prompt_tokens"] / 2


def test_tool_results_are_skewed_seeded_and_average_the_asked_size() -> None:
    """Tool-result sizes repeat for the same (conversation, turn), average about the asked mean
    over many turns, and are skewed (most short: the median under the mean; some 3x longer)."""
    import statistics

    from tools.bench.cluster import tool_result_tokens, tool_seconds

    sizes = [tool_result_tokens(c, t, 48) for c in range(40) for t in range(10)]
    assert sizes == [tool_result_tokens(c, t, 48) for c in range(40) for t in range(10)]
    assert 40 <= statistics.mean(sizes) <= 56
    assert statistics.median(sizes) < statistics.mean(sizes)
    assert max(sizes) > 3 * 48
    assert min(sizes) >= 8
    waits = [tool_seconds(c, t, 2.0) for c in range(40) for t in range(10)]
    assert waits[:5] == [tool_seconds(0, t, 2.0) for t in range(5)]
    assert 1.6 <= statistics.mean(waits) <= 2.4
    assert tool_seconds(3, 4, 0.0) == 0.0


def test_prefix_share_counts_repeated_prefixes_and_splits_first_and_follow_up_turns() -> None:
    """One-turn conversations repeat only the system prompt (no follow-up share); with more turns
    the follow-up share (history repeated) is the larger and raises the total share."""
    from tools.bench.cluster import ideal_share

    args = _args()
    args.turns = 1
    one = ideal_share(args)
    assert one["follow_up_share"] == 0.0
    assert one["share"] == one["first_share"]
    assert 0 < one["first_share"] < 1
    args.turns = 4
    four = ideal_share(args)
    assert four["first_share"] == one["first_share"]
    assert four["follow_up_share"] > four["first_share"]
    assert four["share"] > one["share"]


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _answer(body: bytes) -> tuple[float, float, dict[str, Any], str | None, str | None]:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def go() -> tuple[float, float, dict[str, Any], str | None, str | None]:
        async with httpx.AsyncClient(transport=transport) as client:
            return await cluster._chat(client, "http://replica", [{"role": "user", "content": "x"}], 4)

    return asyncio.run(go())


def test_an_error_event_after_the_200_fails_the_answer_and_leaves_the_figures() -> None:
    """A stream that carries an error event (an engine failure after the 200) or no usage is a
    failed answer: counted in ``errors``, left out of TTFT and the cached share."""
    usage = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}
    good = _answer(_sse({"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": usage}))
    failed = _answer(_sse({"error": {"code": "batch_step_failed", "message": "no stream"}}))
    bare = _answer(_sse({"choices": [{"delta": {"content": "hi"}}]}))
    assert (good[2], good[4]) == (usage, None)
    assert failed[4] == "batch_step_failed"
    assert bare[4] == "no usage in the stream"
    samples = [
        cluster.Sample("p", 0, 0, 0.1, 0.2, 10, 8, None, 0.2),
        cluster.Sample("p", 1, 0, 9.0, 9.0, 0, 0, None, 9.0, error="batch_step_failed"),
    ]
    summary = cluster.summarize(samples, 10.0, [2])
    assert (summary["requests"], summary["errors"]) == (2, 1)
    assert summary["ttft_p99_s"] == 0.1
    assert summary["cached_share"] == 0.8


def test_a_cut_runs_printout_is_plotted_from_each_policys_last_round_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--from-printout reads the per-round lines (the last per policy counts) and writes a plot;
    a printout without them is refused."""
    printout = tmp_path / "cut.txt"
    printout.write_text(
        "trace prefix share 0.886\n"
        "round 0 round_robin  ttft p50 1.837s p99 6.104s cached 0.682 1749 tok/s errors 0 load 1 1 1\n"
        "round 0 cache_aware  ttft p50 1.286s p99 5.134s cached 0.791 2557 tok/s errors 0 load 1 1 1\n"
        "round 1 cache_aware  ttft p50 1.100s p99 4.000s cached 0.800 2600 tok/s errors 0 load 1 1 1\n"
        "cluster-4r-16a: exit 124\n")
    out = tmp_path / "out"
    assert cluster.plot_printout(printout, out) == 0
    assert (out / "printout.png").stat().st_size > 0
    printed = [line.split()[:4] for line in capsys.readouterr().out.splitlines()[:2]]
    assert printed == [["round_robin", "ttft", "p50", "1.837"], ["cache_aware", "ttft", "p50", "1.100"]]
    empty = tmp_path / "empty.txt"
    empty.write_text("cluster-4r-16a: exit 124\n")
    assert cluster.plot_printout(empty, tmp_path / "none") == 1


def test_the_open_loop_schedule_is_seeded_ordered_and_arrives_at_the_asked_rate() -> None:
    """The arrival schedule repeats for a seed (and differs for another), starts at 0, never goes
    back in time, and its mean gap over many arrivals is about 1 / rate."""
    import itertools
    import statistics

    times = cluster.arrival_times(2000, 4.0, seed=7)
    assert times == cluster.arrival_times(2000, 4.0, seed=7)
    assert times != cluster.arrival_times(2000, 4.0, seed=8)
    assert len(times) == 2000
    assert times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0
    assert 0.9 * 0.25 <= statistics.mean(gaps) <= 1.1 * 0.25
    assert cluster.arrival_times(1, 4.0, seed=7) == [0.0]
    with pytest.raises(ValueError):
        cluster.arrival_times(3, 0.0, seed=7)


def test_in_flight_is_the_time_weighted_mean_and_the_peak_of_open_intervals() -> None:
    """Over 10 s, intervals [0, 4), [2, 6), [3, 5) and [6, 8) hold 1, 2, 3, 2, 1, 1, 0 open:
    over 2, 1, 1, 1, 1, 2, 2 s: a time-weighted mean of 12 / 10 and a max of 3; one ending as
    another starts does not overlap it."""
    assert cluster.in_flight([(0.0, 4.0), (2.0, 6.0), (3.0, 5.0), (6.0, 8.0)], 10.0) == (1.2, 3)
    assert cluster.in_flight([(0.0, 2.0), (2.0, 4.0)], 4.0) == (1.0, 1)
    assert cluster.in_flight([], 4.0) == (0.0, 0)


def test_the_summary_measures_requests_and_conversations_in_flight_per_replay() -> None:
    """Requests count from send to end, conversations from their first send to their last end
    (tool time included); each replay counts on its own clock, their means add over the summed wall."""
    samples = [
        # conversation 0: requests [0, 1) and [3, 4); conversation 1: [0.5, 2.5)
        cluster.Sample("p", 0, 0, 0.1, 1.0, 10, 0, None, 1.0),
        cluster.Sample("p", 0, 1, 0.1, 1.0, 10, 0, None, 4.0),
        cluster.Sample("p", 1, 0, 0.1, 2.0, 10, 0, None, 2.5),
    ]
    one = cluster.summarize(samples, 8.0, [3])
    assert (one["requests_in_flight_mean"], one["requests_in_flight_max"]) == (0.5, 2)
    assert (one["conversations_in_flight_mean"], one["conversations_in_flight_max"]) == (0.75, 2)
    again = [cluster.Sample("p", 0, 0, 0.1, 4.0, 10, 0, None, 4.0, round=1)]
    two = cluster.summarize(samples + again, 16.0, [4])
    assert (two["requests_in_flight_mean"], two["requests_in_flight_max"]) == (0.5, 2)
    assert (two["conversations_in_flight_mean"], two["conversations_in_flight_max"]) == (0.625, 2)


def test_each_replay_is_probed_before_and_after_and_the_probes_are_returned_in_order() -> None:
    """``probed_replay`` runs the host probe, then the replay, then the probe again, and hands back
    the replay's samples and wall with both probes (before first)."""
    calls: list[str] = []
    probes = iter([0.25, 0.4])

    def probe() -> float:
        calls.append("probe")
        return next(probes)

    def replay() -> tuple[list[cluster.Sample], float]:
        calls.append("replay")
        return [cluster.Sample("p", 0, 0, 0.1, 1.0, 10, 0, None, 1.0)], 3.0

    samples, wall, probed = cluster.probed_replay(replay, probe)
    assert calls == ["probe", "replay", "probe"]
    assert (len(samples), wall, probed) == (1, 3.0, [0.25, 0.4])


def test_the_capacity_rate_is_answered_requests_a_second_over_turns_at_the_fraction() -> None:
    """``capacity_rate``: 40 answered requests in 20 s of 10-call conversations is 2 requests/s,
    0.2 conversations/s, and the open loop at 0.8 of it arrives at 0.16; a failed answer or no
    answer at all measures nothing."""
    ok = [cluster.Sample("capacity", c, t, 0.1, 0.5, 10, 0, None, 1.0) for c in range(4) for t in range(10)]
    rate = cluster.capacity_rate(ok, 20.0, 10, 0.8)
    assert rate == pytest.approx({"requests_per_s": 2.0, "conversations_per_s": 0.2, "fraction": 0.8,
                                  "arrival_rate": 0.16})
    failed = [*ok[:-1], cluster.Sample("capacity", 3, 9, 0.1, 0.5, 10, 0, None, 1.0, "no usage")]
    with pytest.raises(ValueError, match="answered 39 of 40"):
        cluster.capacity_rate(failed, 20.0, 10, 0.8)
    with pytest.raises(ValueError, match="answered 0 of 0"):
        cluster.capacity_rate([], 20.0, 10, 0.8)
    with pytest.raises(ValueError, match="fraction must be > 0"):
        cluster.capacity_rate(ok, 20.0, 10, 0.0)


def test_the_capacity_replay_is_a_closed_loop_of_its_own_without_tool_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``measure_capacity`` replays as policy "capacity" (its own system prompt), closed loop, no
    tool time, 2 agents a replica and 2 conversations an agent by default, and turns what it
    measured into the open loop's rate; the caller's arguments are left as they were."""
    seen: list[tuple[str, str, argparse.Namespace]] = []

    def replay(url: str, policy: str, run: argparse.Namespace, rnd: int) -> tuple[list[cluster.Sample], float]:
        seen.append((url, policy, run))
        n = run.conversations * run.turns
        return [cluster.Sample(policy, i // run.turns, i % run.turns, 0.2, 0.4, 10, 0, None, 1.0)
                for i in range(n)], 40.0

    monkeypatch.setattr(cluster, "_replay_once", replay)
    monkeypatch.setattr(cluster, "probed_replay", lambda f: (*f(), [0.06, 0.07]))
    args = argparse.Namespace(replicas=4, turns=10, tool_s=1.0, arrival_rate=0.0, concurrency=16,
                              conversations=32, capacity_agents=0, capacity_conversations=0,
                              arrival_rate_fraction=0.9)
    out = cluster.measure_capacity("http://router", args)
    url, policy, run = seen[0]
    assert (url, policy) == ("http://router", "capacity")
    assert (run.concurrency, run.conversations, run.tool_s, run.arrival_rate) == (8, 16, 0.0, 0.0)
    assert (args.concurrency, args.conversations, args.tool_s) == (16, 32, 1.0)
    # 160 requests in 40 s: 4 a second, 0.4 conversations a second, 0.36 at 0.9.
    assert out["arrival_rate"] == pytest.approx(0.36)
    assert (out["agents"], out["conversations"], out["host_loop_s"]) == (8, 16, [0.06, 0.07])


@pytest.mark.parametrize("flags", [["--arrival-rate-fraction", "-0.5"],
                                   ["--arrival-rate", "0.2", "--arrival-rate-fraction", "0.9"]],
                         ids=["negative-fraction", "rate-and-fraction"])
def test_a_bad_open_loop_rate_is_refused_before_any_replica_starts(flags: list[str], tmp_path: Path) -> None:
    """A negative fraction, or a rate beside a fraction, ends ``cluster.py`` with argparse's usage
    error (exit 2) and names the flag, before the replicas or the capacity replay start."""
    import subprocess
    import sys

    script = Path(cluster.__file__)
    done = subprocess.run([sys.executable, str(script), *flags, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--arrival-rate-fraction" in done.stderr
    assert not (tmp_path / "out").exists()
