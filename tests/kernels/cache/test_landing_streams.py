"""The landing's fill streams: arrays allocated on several MLX CPU streams land the same bytes."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kernels.cache import FILL_STREAMS, landing_streams
from kernels.cache._kv_file import LandingPool, land_entry, open_entry
from tests.kernels.cache.test_kv_file import PROMPT, greedy, kv_step, tiny_llama, write_entry
from tests.kernels.cache.test_kv_file_landing import CASES, PORT, _all_bytes, _cases, _header

CPU = mx.Device(mx.cpu)


def _land(path: Path, streams: list[Any] | None, pool: LandingPool | None) -> list[Any]:
    entry = open_entry(PORT, str(path), _header(path))
    try:
        return land_entry(entry, step=4, pool=pool, streams=streams)
    finally:
        entry.close()


def _in_thread(fn: Any) -> Any:
    """``fn()`` run on a new thread (its MLX streams are its own)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    assert out, "the thread raised"
    return out[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pooled", [False, True])
def test_landing_on_several_streams_equals_landing_on_one(
    tmp_path: Path, case: str, pooled: bool
) -> None:
    """Two streams and three (tensor counts not a multiple of them) land every kind bit for bit
    as one stream does, slack included, inline and on landing threads."""
    caches, tokens = _cases()[case]
    path = write_entry(caches, tokens, tmp_path)
    pool = LandingPool(2) if pooled else None
    try:
        one = _all_bytes(_land(path, [mx.cpu], pool))
        two = _all_bytes(_land(path, landing_streams(), pool))
        three = _all_bytes(_land(path, [*landing_streams(), mx.new_stream(mx.cpu)], pool))
    finally:
        if pool is not None:
            pool.close()
    assert two == one
    assert three == one


def test_arrays_filled_on_an_extra_stream_continue_like_the_original(tmp_path: Path) -> None:
    """A landing on the fill streams decodes the same greedy tokens and its next step writes in
    place into the slack."""
    model = tiny_llama(mx.bfloat16)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:-1]]), cache=cache)
    path = write_entry(cache, PROMPT[:-1], tmp_path)
    streams = landing_streams()
    landed = _land(path, streams, None)
    assert greedy(model, landed, PROMPT[-1]) == greedy(model, cache, PROMPT[-1])
    again = _land(path, streams, None)
    kv_step(again[0], seed=1, dtype=mx.bfloat16, dim=16)
    assert (again[0].keys.shape[2], again[0].offset) == (12, 9)


def test_on_a_cpu_device_each_thread_gets_its_own_streams_once() -> None:
    """On the CPU device: the thread's CPU stream first, FILL_STREAMS in all, the same ones on
    every call from a thread and other ones on another thread (MLX streams are per thread)."""
    mine = landing_streams(CPU)
    assert len(mine) == FILL_STREAMS == 2
    assert mine[0] == mx.cpu
    assert landing_streams(CPU) == mine
    theirs = _in_thread(lambda: landing_streams(CPU))
    assert len(theirs) == FILL_STREAMS
    assert theirs[1:] != mine[1:]


def test_on_another_device_the_landing_keeps_the_one_cpu_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU default device (CUDA, Metal) gets ``[mx.cpu]`` alone, and no stream is made for it."""
    made: list[Any] = []
    real = mx.new_stream

    def recording(device: Any) -> Any:
        made.append(device)
        return real(device)

    monkeypatch.setattr(mx, "new_stream", recording)
    gpu = SimpleNamespace(type=mx.DeviceType.gpu)
    assert _in_thread(lambda: landing_streams(gpu)) == [mx.cpu]
    assert made == []
    assert len(_in_thread(lambda: landing_streams(CPU))) == FILL_STREAMS
    assert made == [mx.cpu]  # the recording does see the streams a CPU device gets
