"""Read first: where async_eval blocks (the CPU) a decode step computes its own tokens before it builds the next forward, and every token stays the same."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

import kernels._device as device
from kernels import READ_FIRST_ENV, SamplingParams, cache_arrays, read_first_setting
from kernels.engine import BatchGeneration, Generation, run_generation
from tests.kernels.test_batch import Plan, _prompts, drive


def _plans(tok: Any) -> list[Plan]:
    """Five rows joining at staggered steps, greedy, seeded sampling and logprobs, leaving at different lengths."""
    prompts = _prompts(len(tok), 5, seed=71, lo=4, hi=30)
    params = [
        SamplingParams(max_tokens=9),
        SamplingParams(max_tokens=5, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=7, temperature=1.1, top_p=0.9, seed=5),
    ]
    return [Plan(str(i), p, q, join_at=2 * i) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]


def _record_decode_steps(model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch, *, read_first: bool) -> list[list[str]]:
    """The async_eval calls and one-position forwards of every step that only decoded, in order."""
    events: list[str] = []
    real_eval = mx.async_eval
    real_call = type(model).__call__

    def spy_eval(*args: Any) -> None:
        events.append("async_eval")
        real_eval(*args)

    def spy_call(self: Any, inputs: mx.array, *args: Any, **kw: Any) -> Any:
        if inputs.shape[-1] == 1:
            events.append("forward")
        return real_call(self, inputs, *args, **kw)

    monkeypatch.setattr(mx, "async_eval", spy_eval)
    monkeypatch.setattr(type(model), "__call__", spy_call)
    batch = BatchGeneration(model, tok, prefill_step_size=64, read_first=read_first)
    batch.join("a", _prompts(len(tok), 1, seed=72, lo=12, hi=12)[0], SamplingParams(max_tokens=8))
    steps: list[list[str]] = []
    while not batch.idle:
        events.clear()
        result = batch.step()
        if result.prefill_tokens == 0 and not result.joined and not result.exits:
            steps.append(list(events))
    batch.close()
    return steps


def test_a_read_first_step_computes_its_tokens_before_it_builds_the_next_forward(
    model: Any, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read first: a decode step starts its own tokens (async_eval) and then builds the next forward, which it leaves unevaluated; mlx-lm's order queues the next forward after building it."""
    first = _record_decode_steps(model, tok, monkeypatch, read_first=True)
    mlx_order = _record_decode_steps(model, tok, monkeypatch, read_first=False)
    assert len(first) >= 5
    assert len(mlx_order) == len(first)
    assert all(step == ["async_eval", "forward"] for step in first), first
    assert all(step == ["forward", "async_eval"] for step in mlx_order), mlx_order


def test_batch_rows_emit_the_same_tokens_either_way(model: Any, tok: Any) -> None:
    """Staggered greedy, seeded and logprob rows: every row's tokens, logprobs and finish reasons are the same with and without read first."""
    runs = [
        drive(BatchGeneration(model, tok, prefill_step_size=8, read_first=flag), _plans(tok))
        for flag in (True, False)
    ]
    first, mlx_order = runs
    assert set(first.outputs) == set(mlx_order.outputs) == {str(i) for i in range(5)}
    for row_id, outputs in first.outputs.items():
        other = mlx_order.outputs[row_id]
        assert [o.token_id for o in outputs] == [o.token_id for o in other], row_id
        assert [o.finish_reason for o in outputs] == [o.finish_reason for o in other], row_id
        assert [o.logprob for o in outputs] == [o.logprob for o in other], row_id
        assert first.exits[row_id].completion_tokens == mlx_order.exits[row_id].completion_tokens


def test_exit_caches_hold_the_same_keys_either_way(model: Any, tok: Any) -> None:
    """A leaving row's cache (its answer's last token included) holds the same keys and values with and without read first."""
    caches = []
    for flag in (True, False):
        run = drive(BatchGeneration(model, tok, prefill_step_size=8, read_first=flag), _plans(tok))
        caches.append(run.exits["2"])
    first, mlx_order = caches
    assert first.cache_tokens == mlx_order.cache_tokens
    arrays = [cache_arrays(c.cache) for c in (first, mlx_order)]
    assert len(arrays[0]) == len(arrays[1]) > 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(*arrays, strict=True))


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=0.9, seed=11)])
def test_serial_lane_tokens_are_the_same_either_way(
    model: Any, tok: Any, params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serial lane with and without read first: the same tokens and the same cache tokens."""
    prompt = _prompts(len(tok), 1, seed=73, lo=20, hi=20)[0]
    outs = []
    for value in ("on", "off"):
        monkeypatch.setenv(READ_FIRST_ENV, value)
        gen = Generation(model, tok, prompt, params, prefill_step_size=8)
        outs.append(([o.token_id for o in run_generation(gen)], gen.cache_tokens))
    assert outs[0] == outs[1]


def test_the_setting_is_on_where_async_eval_blocks_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU read first is on unless KVTIER_READ_FIRST says off; where async_eval does not block it is off."""
    assert device.async_eval_blocks()  # NOTE: these tests run on MLX's CPU device.
    assert read_first_setting({})
    assert not read_first_setting({READ_FIRST_ENV: "off"})
    monkeypatch.setattr(device, "async_eval_blocks", lambda: False)
    assert not read_first_setting({})
