"""The cluster benchmark's placement model (``--simulate``): what round-robin's misses cost in prefill."""

from __future__ import annotations

import argparse

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
