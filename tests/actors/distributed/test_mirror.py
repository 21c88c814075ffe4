"""Rank 0's mirrored backend and a follower, in one process over a tiny model: the follower's KV follows rank 0's."""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
import pytest

from actors.backend import MlxBackend
from actors.distributed import Follower, LeaderBackend, Op, OutOfStep, encode_handles, seeded
from kernels import CacheRegistry
from kernels.cache import cache_arrays
from kernels.distributed import Command
from messages.gateway import Generate, GenerationParams
from tests.tiny_models import tiny_llama, tiny_tokenizer


class Loopback:
    """A ``Sender`` that hands every command straight to a follower (and records it)."""

    def __init__(self, follower: Follower) -> None:
        self.follower = follower
        self.ops: list[Op] = []

    def send(self, command: Command) -> None:
        self.ops.append(Op(command.op))
        assert self.follower.apply(command)


class Ranks:
    """Rank 0's leader backend and a follower over the same weights, each with its own registry."""

    def __init__(self) -> None:
        tok = tiny_tokenizer()
        model = tiny_llama(vocab_size=len(tok))
        self.r0 = CacheRegistry()
        self.r1 = CacheRegistry()
        self.follower = Follower(MlxBackend(model, tok, prefill_step_size=8, registry=self.r1), self.r1)
        self.wire = Loopback(self.follower)
        self.leader = LeaderBackend(
            MlxBackend(model, tok, prefill_step_size=8, registry=self.r0), self.wire, self.r0
        )

    def run(self, request: Generate, handle: str | None = None, cached: int = 0) -> tuple[Any, str]:
        """Open, step to the end and register on rank 0 (as the runner does); the generation and entry."""
        gen = self.leader.open(request, handle, cached)
        while True:
            result = self.leader.step(gen)
            self.leader.end_turn()
            if result.finish_reason is not None:
                break
        reg = self.leader.register(gen)
        self.leader.end_turn()
        assert reg is not None
        return gen, reg.handle

    def same_kv(self, handle: str) -> bool:
        """Whether the follower's entry for rank 0's ``handle`` holds rank 0's KV, bit for bit."""
        local = self.follower.entries[handle]
        a, b = self.r0.get(handle), self.r1.get(local)
        if len(a) != len(b):
            return False
        if [x.offset for x in a] != [y.offset for y in b]:
            return False
        xs, ys = cache_arrays(list(a)), cache_arrays(list(b))
        return len(xs) == len(ys) > 0 and all(
            x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys, strict=True)
        )


def _request(rid: str, prompt: tuple[int, ...], **params: Any) -> Generate:
    return Generate(request_id=rid, prompt_tokens=prompt, params=GenerationParams(**params))


PROMPT = tuple(range(5, 40))


def test_follower_keeps_the_same_entries_with_the_same_kv() -> None:
    """A greedy request, then one reusing its entry: the follower holds both entries with rank 0's KV."""
    ranks = Ranks()
    _, first = ranks.run(_request("a", PROMPT, max_tokens=6))
    assert ranks.same_kv(first)
    gen, second = ranks.run(_request("b", (*PROMPT, 50, 51, 52), max_tokens=6), first, len(PROMPT))
    assert gen.cached_tokens == len(PROMPT)
    assert ranks.same_kv(second)
    assert ranks.follower.open_generations == 0
    assert ranks.wire.ops.count(Op.OPEN) == 2


def test_unseeded_sampling_draws_the_same_tokens_on_every_rank() -> None:
    """Temperature sampling without a seed: rank 0 seeds the request, so the follower's KV matches."""
    ranks = Ranks()
    mx.random.seed(3)
    _, handle = ranks.run(_request("t", PROMPT, max_tokens=12, temperature=1.5))
    assert ranks.same_kv(handle)


def test_seeded_leaves_greedy_and_seeded_requests_alone() -> None:
    """Only a sampling request without a seed gets one."""
    greedy = _request("g", PROMPT)
    fixed = _request("s", PROMPT, temperature=1.0, seed=7)
    free = _request("f", PROMPT, temperature=1.0)
    assert seeded(greedy, lambda: 5) is greedy
    assert seeded(fixed, lambda: 5) is fixed
    assert seeded(free, lambda: 5).params.seed == 5


def test_disposed_entries_are_disposed_on_the_follower() -> None:
    """An entry rank 0's prompt cache disposes leaves the follower at the end of the next turn."""
    ranks = Ranks()
    _, handle = ranks.run(_request("a", PROMPT, max_tokens=4))
    local = ranks.follower.entries[handle]
    ranks.r0.dispose(handle)
    ranks.leader.end_turn()
    assert handle not in ranks.follower.entries
    assert local not in ranks.r1
    assert ranks.wire.ops[-1] is Op.DISPOSE


def test_a_generation_dropped_without_discard_ends_on_the_follower() -> None:
    """A generation rank 0 loses (a failed turn) is discarded on the follower at the next turn's end."""
    ranks = Ranks()
    gen = ranks.leader.open(_request("x", PROMPT, max_tokens=4), None, 0)
    ranks.leader.step(gen)
    assert ranks.follower.open_generations == 1
    del gen
    gc.collect()
    ranks.leader.end_turn()
    assert ranks.follower.open_generations == 0
    assert ranks.wire.ops[-1] is Op.DISCARD


def test_a_command_the_follower_cannot_match_is_out_of_step() -> None:
    """Disposing or reusing an entry the follower does not hold raises OutOfStep."""
    ranks = Ranks()
    with pytest.raises(OutOfStep):
        ranks.follower.apply(encode_handles(Op.DISPOSE, 0, ["kv-99"]))
    with pytest.raises(OutOfStep):
        ranks.follower.apply(Command(Op.STEP, 42))
