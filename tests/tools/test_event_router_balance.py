"""The event router's load balancing: sglang-router's imbalance rule, with the cached prefix kept
among the least loaded replicas, and a conversation at home while the load is balanced."""

from __future__ import annotations

import pytest

from tools.cluster._event_index import choose, imbalanced
from tools.cluster.event_router import EventRouter, ReplicaLink

pytestmark = pytest.mark.anyio


def test_imbalance_is_sglang_routers_rule() -> None:
    """Balancing needs max - min > abs and max > min x rel, both strictly."""
    assert imbalanced([3, 0], 2, 1.5)
    assert not imbalanced([2, 0], 2, 1.5)  # difference 2 is not > 2
    assert not imbalanced([6, 4], 1, 1.5)  # 6 is not > 4 x 1.5
    assert imbalanced([7, 4], 1, 1.5)
    assert not imbalanced([], 0, 1.0)


def test_imbalanced_load_leaves_only_the_least_loaded_and_the_cost_decides_among_them() -> None:
    """Replica 0 holds the prefix but 3 requests: with abs 2 the choice is among the idle ones, and
    of those the one holding more of the prefix (2); with the default (off) the prefix wins."""
    cached, queued, load = [8, 0, 4, 0], [0, 0, 0, 0], [3, 1, 0, 0]
    off = choose(10, cached, queued, load, 0)
    assert (off.replica, off.reason) == (0, "cost")
    on = choose(10, cached, queued, load, 0, abs_threshold=2, rel_threshold=1.5)
    assert (on.replica, on.cached_blocks, on.reason) == (2, 4, "balance")
    balanced = choose(10, cached, queued, [2, 1, 1, 0], 0, abs_threshold=2, rel_threshold=1.5)
    assert (balanced.replica, balanced.reason) == (0, "cost")


class _CharTokenizer:
    """One token per character (a scripted stand-in for the model's tokenizer)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _router(balance_abs: float) -> EventRouter:
    links = [ReplicaLink(f"http://127.0.0.1:{9 + k}", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
             for k in range(2)]
    return EventRouter(links, _CharTokenizer(), balance_abs=balance_abs, balance_rel=1.5)


async def _next_turn_with_two_in_flight_at_home(router: EventRouter) -> tuple[int, int]:
    """A conversation's first turn ended at its home, which then has two other requests in flight
    (decoding, nothing queued): (home, where the next turn goes)."""
    prompt = "conv 00 " + "x" * 56
    home, chain, uncached = await router.pick("/v1/completions", {"prompt": prompt})
    router.admit(home, chain, uncached)()
    router.replicas[home].in_flight = 2
    nxt, _, _ = await router.pick("/v1/completions", {"prompt": prompt + "y" * 16})
    return home, nxt


async def test_the_routers_threshold_moves_work_off_a_busy_home() -> None:
    """With abs 1 the next turn leaves a home with 2 in flight (2 - 0 > 1) although its prefix is
    there; with sglang-router's default 64 it stays home (1 block to compute there, 5 elsewhere)."""
    for abs_threshold, stays in ((1.0, False), (64.0, True)):
        router = _router(abs_threshold)
        try:
            home, nxt = await _next_turn_with_two_in_flight_at_home(router)
        finally:
            await router.aclose()
        assert (nxt == home) is stays


async def _cold_fleet(rule: str) -> tuple[list[int], int]:
    """Four agents' first calls at once on 4 replicas (thresholds 2 / 1.5), one 16-block system
    prompt and 3 blocks of their own each: (the replica of each call, blocks to compute in all)."""
    links = [ReplicaLink(f"http://127.0.0.1:{9 + k}", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
             for k in range(4)]
    router = EventRouter(links, _CharTokenizer(), balance_abs=2.0, balance_rel=1.5, rule=rule)
    system = "S" * 256
    homes, computed = [], 0
    try:
        for agent in range(4):
            i, chain, uncached = await router.pick(
                "/v1/completions", {"prompt": system + f"agent {agent:02d} " + "t" * 39})
            router.admit(i, chain, uncached)  # NOTE: all four stay in flight
            homes.append(i)
            computed += uncached
    finally:
        await router.aclose()
    return homes, computed


async def test_cold_calls_sharing_a_prompt_stay_together_until_the_balance_rule_moves_one() -> None:
    """Rule prefix computes the system prompt on 2 replicas (three calls on its holder, the
    fourth moved by the 2 / 1.5 rule, as cache_aware does); rule prefill, the queued work
    counted, spread the four calls over 4 replicas and computed it four times."""
    homes, computed = await _cold_fleet("prefix")
    assert sorted(homes.count(r) for r in set(homes)) == [1, 3]
    assert computed == 2 * 16 + 4 * 3
    spread, spread_computed = await _cold_fleet("prefill")
    assert sorted(spread) == [0, 1, 2, 3]
    assert spread_computed == 4 * 16 + 4 * 3
