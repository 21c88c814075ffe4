"""``land_entry(streams=...)``: arrays allocated on several MLX CPU streams land the same bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kernels.cache._kv_landing import LandingPool, land_entry
from kernels.cache._kv_reader import open_entry
from tests.kernels.cache.test_kv_file import PROMPT, greedy, kv_step, tiny_llama, write_entry
from tests.kernels.cache.test_kv_file_landing import CASES, PORT, _all_bytes, _cases, _header


def _land(path: Path, streams: list[Any] | None, pool: LandingPool | None) -> list[Any]:
    entry = open_entry(PORT, str(path), _header(path))
    try:
        return land_entry(entry, step=4, pool=pool, streams=streams)
    finally:
        entry.close()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pooled", [False, True])
def test_landing_on_several_streams_equals_landing_on_one(
    tmp_path: Path, case: str, pooled: bool
) -> None:
    """Two streams and three (tensor counts not a multiple of them) land every kind bit for bit
    as the default one stream does, slack included, inline and on landing threads."""
    caches, tokens = _cases()[case]
    path = write_entry(caches, tokens, tmp_path)
    extra = [mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)]
    pool = LandingPool(2) if pooled else None
    try:
        one = _all_bytes(_land(path, None, pool))
        two = _all_bytes(_land(path, [mx.cpu, extra[0]], pool))
        three = _all_bytes(_land(path, [mx.cpu, *extra], pool))
    finally:
        if pool is not None:
            pool.close()
    assert two == one
    assert three == one


def test_arrays_filled_on_an_extra_stream_continue_like_the_original(tmp_path: Path) -> None:
    """A landing on two streams decodes the same greedy tokens, and its next step writes in
    place into the slack."""
    model = tiny_llama(mx.bfloat16)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=cache)
    path = write_entry(cache, PROMPT[:-1], tmp_path)
    streams = [mx.cpu, mx.new_stream(mx.cpu)]
    landed = _land(path, streams, None)
    assert greedy(model, landed, PROMPT[-1]) == greedy(model, cache, PROMPT[-1])
    again = _land(path, streams, None)
    kv_step(again[0], seed=1, dtype=mx.bfloat16, dim=16)
    assert (again[0].keys.shape[2], again[0].offset) == (12, 9)  # written in place
