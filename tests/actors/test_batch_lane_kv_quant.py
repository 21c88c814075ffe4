"""``Engine(max_batch>1, kv_quant=...)``: quantizing schemes run in the batch lane as transitioning rows."""

from __future__ import annotations

import random
from typing import Any

import anyio
import mlx.core as mx
import pytest
from mlx.utils import tree_map

from actors.engine import Engine, GenerationParams
from tests.engine_runs import collect
from tests.tiny_models import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny byte-level BPE tokenizer."""
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Any) -> Any:
    """A tiny fp32 Llama with 64-wide heads (the server's 64-element groups) and varied greedy output."""
    m = tiny_llama(vocab_size=len(tok), head_dim=64, dtype=mx.float32, seed=1)
    m.update(tree_map(lambda p: p * 2.0, m.parameters()))
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("kv_quant", ["4", "8"])
async def test_kv_quant_requests_are_batch_rows_with_the_serial_lanes_tokens(
    model: Any, tok: Any, kv_quant: str
) -> None:
    """6 concurrent requests with kv_quant and max_batch=4 run as batch rows (several decode together), give the
    serial lane's kv-quant greedy tokens, store entries in the scheme's quantized kind, and a follow-up reuses one."""
    rng = random.Random(4)
    prompts = [[rng.randrange(0, len(tok) - 2) for _ in range(n)] for n in (9, 23, 41, 5, 30, 17)]
    params = [GenerationParams(max_tokens=6 + 3 * i) for i in range(len(prompts))]
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=1 << 26, max_batch=1, kv_quant=kv_quant
    ) as serial:
        expected = [await collect(serial, p, q) for p, q in zip(prompts, params, strict=True)]
        follow = [*prompts[1], *expected[1][0], 7, 8, 9]
        # NOTE: a quantized history is not a cold prefill's: compare the warm turns.
        serial_follow, serial_done = await collect(serial, follow, params[1])
    assert serial_done.usage.cached_tokens >= len(prompts[1])
    got: list[Any] = [None] * len(prompts)
    async with Engine.from_loaded(
        model, tok, model_id="tiny", prompt_cache_bytes=1 << 26, max_batch=4, kv_quant=kv_quant
    ) as eng:

        async def one(i: int) -> None:
            got[i] = await collect(eng, prompts[i], params[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        warm_follow, done = await collect(eng, follow, params[1])
        stats = await eng.stats()
        registry = eng.cache_registry
        assert registry is not None
        entries = registry.entries()
    for (ids, _), (want, _) in zip(got, expected, strict=True):
        assert ids == want
    batch = stats["batch"]["batch"]
    assert batch["steps"]["max_rows_decoded"] >= 3, batch
    assert batch["requests"]["finished_length"] + batch["requests"]["finished_stop"] == 7
    assert warm_follow == serial_follow
    assert done.usage.cached_tokens >= len(prompts[1])
    assert entries
    for meta in entries.values():
        assert set(meta.signatures) == {f"kv:quant:{kv_quant}:64"}
