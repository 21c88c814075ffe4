"""Greedy rows that read no logprob skip the vocabulary-wide log-softmax, on both lanes, and keep their tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest

from kernels import Generation, SamplingParams, run_generation
from kernels.engine import BatchGeneration


@pytest.fixture
def lse_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``mx.logsumexp`` calls (the log-softmax of mlx-lm's and kvtier's sampling steps)."""
    calls = [0]
    real: Callable[..., mx.array] = mx.logsumexp

    def counting(*args: Any, **kwargs: Any) -> mx.array:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(mx, "logsumexp", counting)
    return calls


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 90 + 5 for j in range(6 + 5 * i)] for i in range(n)]


def _batch(
    model: Any, tok: Any, rows: list[tuple[list[int], SamplingParams]]
) -> tuple[dict[str, list[int]], dict[str, list[float]], int]:
    """Run rows joined together; tokens and logprobs per row, and how many steps handed out tokens."""
    batch = BatchGeneration(model, tok, max_rows=8, prefill_step_size=64)
    for i, (prompt, params) in enumerate(rows):
        batch.join(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(rows))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(rows))}
    decode_steps = 0
    while not batch.idle:
        step = batch.step()
        decode_steps += bool(step.tokens)
        for t in step.tokens:
            tokens[t.row_id].append(t.output.token_id)
            if t.output.logprob is not None:
                logprobs[t.row_id].append(t.output.logprob)
    batch.close()
    return tokens, logprobs, decode_steps


def test_an_all_greedy_batch_decodes_without_the_log_softmax(
    model: Any, tok: Any, lse_calls: list[int]
) -> None:
    """Four greedy rows without logprobs: no decode step normalizes; each row's tokens equal its serial run."""
    prompts = _prompts(4)
    params = SamplingParams(max_tokens=12)
    tokens, _, steps = _batch(model, tok, [(p, params) for p in prompts])
    assert steps >= 12
    # NOTE: only the first forward of the rows entering decode (mlx-lm's own
    # GenerationBatch constructor) may normalize; the steps after it do not.
    assert lse_calls[0] <= 1
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == [
            o.token_id for o in run_generation(Generation(model, tok, p, params))
        ]


def test_a_row_reading_logprobs_keeps_the_log_softmax(
    model: Any, tok: Any, lse_calls: list[int]
) -> None:
    """One greedy row asking for logprobs: every decode step normalizes, and its logprobs equal its serial run's."""
    prompts = _prompts(3)
    plain = SamplingParams(max_tokens=10)
    wants = SamplingParams(max_tokens=10, logprobs=True)
    rows = [(prompts[0], plain), (prompts[1], wants), (prompts[2], plain)]
    tokens, logprobs, steps = _batch(model, tok, rows)
    assert lse_calls[0] >= steps
    serial = run_generation(Generation(model, tok, prompts[1], wants))
    assert tokens["1"] == [o.token_id for o in serial]
    assert len(logprobs["1"]) == 10
    for got, want in zip(logprobs["1"], serial, strict=True):
        assert want.logprob is not None
        assert abs(got - want.logprob) < 1e-4


def test_skipping_the_log_softmax_keeps_the_greedy_tokens(model: Any, tok: Any) -> None:
    """The same eight greedy rows with and without logprobs (normalized or not) pick the same tokens."""
    prompts = _prompts(8)
    skipped, _, _ = _batch(model, tok, [(p, SamplingParams(max_tokens=16)) for p in prompts])
    normalized, _, _ = _batch(
        model, tok, [(p, SamplingParams(max_tokens=16, logprobs=True)) for p in prompts]
    )
    assert skipped == normalized


def test_the_serial_lane_skips_it_for_plain_greedy_only(
    model: Any, tok: Any, lse_calls: list[int]
) -> None:
    """Serial greedy without logprobs never normalizes and gives the tokens of a run that does."""
    prompt = _prompts(2)[1]
    plain = run_generation(Generation(model, tok, prompt, SamplingParams(max_tokens=12)))
    assert lse_calls[0] == 0
    with_lp = run_generation(
        Generation(model, tok, prompt, SamplingParams(max_tokens=12, logprobs=True))
    )
    assert lse_calls[0] >= 11
    assert [o.token_id for o in plain] == [o.token_id for o in with_lp]
    before = lse_calls[0]
    run_generation(
        Generation(model, tok, prompt, SamplingParams(max_tokens=5, temperature=0.7, seed=3))
    )
    assert lse_calls[0] > before
