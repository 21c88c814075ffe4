"""The event-driven router's placement: a conversation's next turn follows its prefix before the
replica's KV events announce it, while cold conversations spread over the replicas."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tools.cluster.event_router import EventRouter, ReplicaLink

pytestmark = pytest.mark.anyio


class _CharTokenizer:
    """One token per character (a scripted stand-in for the model's tokenizer)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _router(ttl: float) -> EventRouter:
    links = [ReplicaLink(f"http://127.0.0.1:{9 + k}", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
             for k in range(2)]
    return EventRouter(links, _CharTokenizer(), predict_ttl=ttl)


async def _turns(router: EventRouter) -> list[tuple[int, int, int]]:
    """Four concurrent 4-block first turns, then each conversation's 6-block second turn:
    (home replica, replica of the second turn, uncached blocks of the second turn)."""
    prompts = [f"conv {c:02d} " + "x" * 56 for c in range(4)]
    firsts = [await _first(router, p) for p in prompts]
    for _, ended in firsts:
        ended()  # NOTE: every first turn ended; no replica published an event.
    out = []
    for (home, _), prompt in zip(firsts, prompts, strict=True):
        i, _, uncached = await router.pick("/v1/completions", {"prompt": prompt + "y" * 32})
        out.append((home, i, uncached))
    return out


async def _first(router: EventRouter, prompt: str) -> tuple[int, Callable[[], None]]:
    i, chain, uncached = await router.pick("/v1/completions", {"prompt": prompt})
    assert (len(chain), uncached) == (4, 4)
    return i, router.admit(i, chain, uncached)


async def test_next_turn_follows_its_unannounced_prefix_and_cold_conversations_spread() -> None:
    """With predictions, every second turn goes home with only its 2 new blocks to compute,
    and the 4 cold first turns went 2 and 2 (the queued prefill spread them)."""
    router = _router(ttl=30.0)
    try:
        turns = await _turns(router)
    finally:
        await router.aclose()
    assert [(home, uncached) for home, i, uncached in turns if i == home] == \
        [(home, 2) for home, _, _ in turns]
    assert sorted(home for home, _, _ in turns) == [0, 0, 1, 1]


async def test_without_predictions_the_next_turn_sees_no_cached_prefix() -> None:
    """With a zero TTL the ended first turns are forgotten at once: each second turn looks
    uncached everywhere (the race the predictions close)."""
    router = _router(ttl=0.0)
    try:
        turns = await _turns(router)
    finally:
        await router.aclose()
    assert [uncached for _, _, uncached in turns] == [6, 6, 6, 6]


async def test_token_id_prompts_and_batches_are_routed_by_their_tokens() -> None:
    """A prompt of token ids routes by those ids; a batch by its first prompt, so it follows that prompt's home."""
    router = _router(ttl=30.0)
    try:
        text = "conv 00 " + "x" * 56
        home, ended = await _first(router, text)
        ended()
        ids = [ord(c) for c in text] + [ord("y")] * 32
        i, chain, uncached = await router.pick("/v1/completions", {"prompt": ids})
        assert (i, len(chain), uncached) == (home, 6, 2)
        i, chain, uncached = await router.pick(
            "/v1/completions", {"prompt": [text + "z" * 16, "other " * 20]})
        assert (i, len(chain), uncached) == (home, 5, 1)
        i, chain, uncached = await router.pick("/v1/completions", {"prompt": [ids, [1, 2, 3]]})
        assert (i, len(chain)) == (home, 6)
    finally:
        await router.aclose()
