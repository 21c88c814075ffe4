"""The serial lane runs on the process's default BLAS thread count, whatever the batch lane chose.

OpenBLAS's thread count is process-wide and the batch lane keeps its chosen
count between its steps; a serial step must not inherit it, or the same
request (a resumed generation checkpoint, say) gives other low bits.
"""

from __future__ import annotations

from typing import Any

import pytest

from actors.backend import MlxBackend
from kernels.engine import BlasTuning, ThreadChooser, find_openblas
from kernels.engine._blas_threads import serial_threads, track_tuning
from messages.gateway import Generate, GenerationParams
from tests.kernels.test_batch import _prompts


class FakePort:
    """Records every thread-count change and every synchronisation."""

    def __init__(self) -> None:
        self.sets: list[int] = []
        self.syncs = 0

    def set_threads(self, n: int) -> None:
        self.sets.append(n)

    def sync(self) -> None:
        self.syncs += 1


def test_serial_threads_gives_a_tracked_tuning_s_threads_back_after_a_synchronisation() -> None:
    """A tracked tuning holding 1 of 2 threads is put back on 2 (synchronised first); at the default nothing happens."""
    port = FakePort()
    tuning = track_tuning(
        BlasTuning(port, 2, port.sync, chooser=ThreadChooser(2, 1, window=1, explore_every=1))
    )
    tuning.before_step()
    tuning.after_step(4, clean=True)
    tuning.before_step()  # the chooser's trial: 1 thread
    assert (tuning.threads, port.sets) == (1, [1])
    assert serial_threads() == 1
    assert (tuning.threads, port.sets, port.syncs) == (2, [1, 2], 2)
    assert serial_threads() == 0, "at the default: no synchronisation, no call"
    assert port.syncs == 2


def _serial_run(backend: MlxBackend, prompt: list[int], max_tokens: int) -> tuple[list[int], list[Any]]:
    import mlx.core as mx

    request = Generate(request_id="r", prompt_tokens=tuple(prompt),
                       params=GenerationParams(max_tokens=max_tokens, logprobs=True))
    gen = backend.open(request, None, 0)
    tokens: list[int] = []
    logprobs: list[Any] = []
    while True:
        out = backend.step(gen)
        if out.token is not None:
            tokens.append(out.token.token_id)
            logprobs.append(out.token.logprob)
        if out.finish_reason is not None:
            break
    keys = [mx.array(c.keys[..., : c.offset, :]) for c in gen.cache]
    mx.eval(keys)
    return tokens, [logprobs, [k.tolist() for k in keys]]


@pytest.mark.skipif(find_openblas() is None, reason="needs OpenBLAS (LD_PRELOAD) to change threads")
def test_a_serial_request_is_bit_for_bit_the_same_while_the_batch_lane_holds_one_thread(
    model: Any, tok: Any
) -> None:
    """A serial prefill + decode run after the batch lane's tuning set 1 thread equals, bit for bit
    (tokens, logprobs, every layer's keys), the same request on the default count."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    blas = find_openblas()
    assert blas is not None
    default = blas.get_threads()
    if default < 2:
        pytest.skip("OpenBLAS runs one thread here: nothing to switch")
    backend = MlxBackend(model, tok, prefill_step_size=64)
    prompt = _prompts(len(tok), 1, seed=41, lo=40, hi=60)[0]
    reference = _serial_run(backend, prompt, 8)
    # NOTE: the batch lane's tuning, having chosen 1 thread (its trial), between two of its steps.
    chooser = ThreadChooser(default, 1, window=1, explore_every=1)
    tuning = track_tuning(BlasTuning(blas, default, lambda: mx.synchronize(generation_stream),
                                     chooser=chooser))
    try:
        tuning.before_step()
        tuning.after_step(4, clean=True)
        tuning.before_step()
        assert blas.get_threads() == 1, "the batch lane's trial count is set"
        got = _serial_run(backend, prompt, 8)
    finally:
        tuning.release()
    assert blas.get_threads() == default
    assert got == reference
