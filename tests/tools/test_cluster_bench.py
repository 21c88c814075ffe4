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
